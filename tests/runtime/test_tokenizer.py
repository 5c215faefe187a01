"""The runtime tokenizer (no transformers) against transformers' AutoTokenizer on SmolLM2's files."""

from __future__ import annotations

import pytest

from kilnlm.runtime.detokenizer import IncrementalDetokenizer, find_stop, num_held_back_chars
from kilnlm.runtime.errors import EngineError, RequestError
from kilnlm.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Tabs\tand\nnewlines\n\n  indented",
    "naïve café – “quotes” … ß",
    "日本語のテキストと中文",
    "emoji 🎉🚀 mixed 👩‍👩‍👧 family",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(rt_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(rt_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text).input_ids
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = hf_tokenizer(text).input_ids
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_special_token_ids(tokenizer, hf_tokenizer):
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_raise_exception_becomes_request_error(rt_tokenizer_dir):
    tokenizer = Tokenizer.from_dir(rt_tokenizer_dir)
    tokenizer.chat_template = "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}x"
    with pytest.raises(RequestError, match="no messages"):
        tokenizer.apply_chat_template([])


def test_chat_template_is_compiled_once_per_source(rt_tokenizer_dir, monkeypatch):
    """Each request renders the compiled template; replacing the source compiles the new one."""
    import jinja2

    compiled = []
    real_from_string = jinja2.Environment.from_string
    monkeypatch.setattr(jinja2.Environment, "from_string",
                        lambda env, source, *a, **k: compiled.append(source) or real_from_string(env, source, *a, **k))
    tokenizer = Tokenizer.from_dir(rt_tokenizer_dir)
    tokenizer.prepare_chat_template()
    messages = [{"role": "user", "content": "hi"}]
    first = tokenizer.apply_chat_template(messages)
    assert tokenizer.apply_chat_template(messages) == first and "hi" in first
    assert compiled == [tokenizer.chat_template]
    tokenizer.chat_template = "{{ messages[0]['content'] }}!"
    assert tokenizer.apply_chat_template(messages) == "hi!"
    assert len(compiled) == 2


def test_chat_template_that_does_not_compile_is_a_request_error(rt_tokenizer_dir):
    tokenizer = Tokenizer.from_dir(rt_tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}"  # no endfor
    tokenizer.prepare_chat_template()  # left for the request to report
    with pytest.raises(RequestError, match="does not compile"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    tokenizer.chat_template = None
    with pytest.raises(RequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_tokenizer_module_does_not_import_jinja2():
    """jinja2 (~70 ms) comes with the first compiled template, not with the runtime's imports."""
    import subprocess
    import sys

    code = "import sys, kilnlm.runtime.tokenizer; print('jinja2' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip() == "False"


def test_missing_tokenizer_json_is_an_engine_error(tmp_path):
    with pytest.raises(EngineError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS[:-1])
def test_streamed_deltas_concatenate_to_full_decode(tokenizer, hf_tokenizer, text):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    output = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.add([t]) for t in output] + [detokenizer.flush()]
    assert "".join(deltas) == hf_tokenizer.decode(output, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)  # never a broken multi-byte character


def test_multibyte_character_is_held_back_until_complete(tokenizer):
    output = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output) > 1, "the emoji should span several byte-level tokens for this test to mean anything"
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add([t]) for t in output]
    assert deltas[:-1] == [""] * (len(output) - 1) and deltas[-1] == "🎉"


def test_stop_string_helpers():
    assert find_stop("hello world", ["wor", "lo"]) == 3
    assert find_stop("hello", ["xyz"]) is None
    assert num_held_back_chars("the end is ne", ["near", "x"]) == 2
    assert num_held_back_chars("abc", ["abcd"]) == 3
    assert num_held_back_chars("abc", []) == 0
