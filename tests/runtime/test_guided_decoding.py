"""Guided decoding (structured output with xgrammar): outputs of the tiny random-weight Llama (eager engine)
and of SmolLM2 (compiled engine, e2e) under regular expressions, JSON schemas and EBNF grammars match
them; bad guides are refused at submit; guided and unguided requests share a batch without changing the
unguided ones' outputs."""

from __future__ import annotations

import json
import re
import sys

import pytest

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.guided_decoding import GuidedDecoder
from kilnlm.runtime.request import FinishReason, GuidedDecodingParams, SamplingParams
from kilnlm.runtime.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar", reason="guided decoding needs xgrammar (pip install 'kilnlm[guided]')")

EMAIL_REGEX = r"[a-z]{2,8}@example\.(com|org)"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
}


@pytest.fixture(scope="module")
def tokenizer(rt_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(rt_tokenizer_dir)


@pytest.fixture
def executor(make_eager_engine, tokenizer):
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=32, max_seq_len=128)
    with Executor(engine, tokenizer) as executor:
        yield executor


def guided(guide_type: str, guide: str | None = None, **sampling) -> SamplingParams:
    params = dict(max_tokens=64, temperature=1.0)
    params.update(sampling)
    return SamplingParams(guided_decoding=GuidedDecodingParams(guide_type, guide), **params)


def validate_person(value) -> None:
    """Validate against PERSON_SCHEMA with jsonschema where installed, else by keys and types."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == {"name", "age", "member"}
        assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 12
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 150
        assert isinstance(value["member"], bool)
    else:
        jsonschema.validate(value, PERSON_SCHEMA)


def test_tokenizer_info_matches_xgrammars_from_huggingface(tokenizer, hf_tokenizer):
    """The vocabulary kilnlm hands xgrammar (from the ``tokenizers`` backend, no transformers) is the one
    xgrammar reads from the transformers tokenizer itself."""
    decoder = GuidedDecoder(tokenizer, vocab_size=49152, stop_token_ids=[2], max_batch_size=1)
    decoder.load()
    ours = decoder.tokenizer_info
    reference = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=49152, stop_token_ids=[2])
    assert ours.vocab_type == reference.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert ours.add_prefix_space == reference.add_prefix_space
    assert ours.vocab_size == reference.vocab_size == 49152
    assert ours.decoded_vocab == reference.decoded_vocab
    assert ours.stop_token_ids == reference.stop_token_ids == [2]
    assert ours.special_token_ids == reference.special_token_ids


def test_regex_guided_sampled_output_matches(executor, tokenizer):
    prompt = tokenizer.encode("Contact:")
    ids = [executor.submit(prompt, guided("regex", EMAIL_REGEX, seed=seed)) for seed in range(4)]
    for request_id in ids:
        response = collect(executor, request_id)
        assert response.finish_reason is FinishReason.END_ID, response
        assert re.fullmatch(EMAIL_REGEX, response.text), response.text
        assert response.text == tokenizer.decode(response.token_ids)


def test_json_schema_guided_sampled_output_validates(executor, tokenizer):
    prompt = tokenizer.encode("A person as JSON:")
    ids = [executor.submit(prompt, guided("json_schema", json.dumps(PERSON_SCHEMA), seed=seed, max_tokens=100))
           for seed in range(4)]
    for request_id in ids:
        response = collect(executor, request_id)
        assert response.finish_reason is FinishReason.END_ID, response
        validate_person(json.loads(response.text))


def test_json_and_ebnf_guides(executor, tokenizer):
    prompt = tokenizer.encode("Answer:")
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    response = executor.generate(prompt, guided("ebnf_grammar", grammar, seed=1))
    assert response.finish_reason is FinishReason.END_ID
    assert re.fullmatch(r"yes|no|maybe [0-9]", response.text), response.text
    # "json": any JSON value, on one line (no free whitespace); its strings and numbers are unbounded, so a
    # random model may take every token: the output is then a prefix of a JSON value.
    response = executor.generate(prompt, guided("json", seed=2, max_tokens=100))
    if response.finish_reason is FinishReason.END_ID:
        json.loads(response.text)
    else:
        assert response.finish_reason is FinishReason.LENGTH
        assert response.text[:1] in set('{["-0123456789tfn')


def test_bad_guides_are_refused_at_submit(executor, tokenizer):
    prompt = tokenizer.encode("Hi")
    cases = [
        (guided("regex", "[a-"), r"guided_decoding's regex guide does not compile: .*Unclosed '\['"),
        (guided("json_schema", "{not json"), r"guided_decoding's json_schema guide does not compile: .*JSON"),
        (guided("json_schema", '{"type": "frobnicate"}'), r"guided_decoding's json_schema guide does not compile: .*frobnicate"),
        (guided("ebnf_grammar", "root ::= undefined_rule"), r"guided_decoding's ebnf_grammar guide does not compile: .*undefined_rule"),
        (guided("regex", "a+", ignore_eos=True), r"guided_decoding .*ignore_eos cannot be combined"),
    ]
    for params, message in cases:
        with pytest.raises(RequestError, match=message):
            executor.submit(prompt, params)
    # The executor keeps serving: a good guide still works.
    assert re.fullmatch("ab+", executor.generate(prompt, guided("regex", "ab{1,5}", seed=0)).text)


def test_guided_and_unguided_requests_share_a_batch(executor, tokenizer):
    """Greedy: each output in a shared in-flight batch equals its output alone."""
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("Contact us at")]
    no_eos = tuple((e,) for e in executor.eos_token_ids)
    plain = SamplingParams(max_tokens=20, bad_words=no_eos)
    email = guided("regex", EMAIL_REGEX, temperature=0.0)
    alone = [executor.generate(prompts[0], plain).token_ids, executor.generate(prompts[1], email).token_ids]
    ids = [executor.submit(prompts[0], plain), executor.submit(prompts[1], email)]
    together = [collect(executor, request_id).token_ids for request_id in ids]
    assert together == alone
    assert re.fullmatch(EMAIL_REGEX, tokenizer.decode(together[1]))
    assert executor.guided_decoder._matchers == {}  # every matcher released


def test_a_guide_no_token_can_follow_finishes_with_an_error(executor, tokenizer):
    """bad_words bans the only token the guide allows: the request ends with reason "error" (the
    grammar rejected what was sampled) and the executor goes on serving."""
    prompt = tokenizer.encode("Say b:")
    b = tokenizer.backend.token_to_id("b")
    response = executor.generate(prompt, guided("regex", "b", temperature=0.0, bad_words=[[b]]))
    assert response.finish_reason is FinishReason.ERROR
    assert "guided_decoding" in response.error
    assert executor.generate(prompt, guided("regex", "b", temperature=0.0)).text == "b"
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_without_xgrammar_a_guided_request_says_what_to_install(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    decoder = GuidedDecoder(tokenizer, vocab_size=49152, stop_token_ids=[2], max_batch_size=1)
    decoder.check(SamplingParams())  # unguided requests never load it
    with pytest.raises(RequestError, match=r"guided_decoding needs xgrammar.*pip install 'kilnlm\[guided\]'"):
        decoder.check(guided("regex", "a+"))


@pytest.mark.e2e
def test_smollm2_sampled_answers_follow_a_json_schema(smollm2_engine_fp32_dir):
    """Issue 24: 20 sampled SmolLM2 chat answers (temperature 0.8, distinct seeds) under a JSON schema all
    parse and validate, and end with the end id. The string and the integer are bounded, so every output
    the schema allows fits ``max_tokens`` (an unbounded integer lets a sampled answer run on in digits)."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
    }
    messages = [{"role": "user", "content": "Name a large city as JSON with its population and whether it is a capital."}]
    with Executor.from_engine_dir(smollm2_engine_fp32_dir, ExecutorConfig(max_batch_size=20)) as executor:
        tokenizer = executor.tokenizer
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        params = [guided("json_schema", json.dumps(schema), temperature=0.8, seed=seed, max_tokens=200) for seed in range(20)]
        ids = [executor.submit(prompt, p) for p in params]
        responses = [collect(executor, request_id) for request_id in ids]
    for response in responses:
        assert response.finish_reason is FinishReason.END_ID, response
        answer = json.loads(response.text)
        try:
            import jsonschema
        except ImportError:
            assert set(answer) == {"city", "population", "capital"}
            assert isinstance(answer["city"], str) and isinstance(answer["capital"], bool)
            assert isinstance(answer["population"], int) and not isinstance(answer["population"], bool)
        else:
            jsonschema.validate(answer, schema)
    assert len({r.text for r in responses}) > 1  # sampled, not one greedy answer 20 times


def collect(executor: Executor, request_id: int):
    """The request's whole result from its stream (token ids and text joined; the final response's rest)."""
    token_ids, text = [], []
    for response in executor.stream(request_id, timeout_s=120):
        token_ids += response.token_ids
        text.append(response.text)
    response.token_ids, response.text = token_ids, "".join(text)
    return response
