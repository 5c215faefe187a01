"""Generated text against Hugging Face transformers: greedy output of the executor (in-flight batching,
chunked context, paged KV, prefix reuse) equals transformers' ``generate`` greedy output token for token.

Runs on the tiny random-weight Llama through the builder's network executed eagerly (reference paged
attention); the compiled tiny / SmolLM2 engines are covered by the same checks where the builder's engine
fixtures exist."""

from __future__ import annotations

import pytest
import torch

from factories import hf_greedy, make_request, make_scheduler, run_in_flight

from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.inputs import InputBuilder, InputLimits
from kilnlm.runtime.request import FinishReason, SamplingParams
from kilnlm.runtime.scheduler import Scheduler
from kilnlm.runtime.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Hi",
    "A much longer prompt that goes on and on so that its context phase is split into several chunks by "
    "the scheduler's token budget while the other requests keep decoding next to it",
]
MAX_TOKENS = [32, 20, 32, 7, 32, 25]


@pytest.fixture(scope="module")
def tokenizer(rt_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(rt_tokenizer_dir)


@pytest.mark.parametrize("enable_kv_cache_reuse", [True, False])
def test_in_flight_greedy_equals_transformers(make_eager_engine, tiny_hf_model, tokenizer, enable_kv_cache_reuse):
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=24, max_seq_len=96, tokens_per_block=4)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(tiny_hf_model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    with Executor(engine, tokenizer, ExecutorConfig(enable_kv_cache_reuse=enable_kv_cache_reuse)) as executor:
        outputs = run_in_flight(executor, prompts, MAX_TOKENS)
        # Again with shared prefixes (the same prompts): cached blocks are reused, outputs unchanged.
        again = run_in_flight(executor, prompts, MAX_TOKENS)
        stats = executor.stats()
    assert outputs == expected
    assert again == expected
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_cached_blocks > 0) == enable_kv_cache_reuse


def test_requests_sharing_a_prefix_in_flight_equal_transformers(make_eager_engine, tiny_hf_model, tokenizer):
    """Six prompts behind one system prompt, three submitted together and three mid-flight: those submitted
    with the first wait for the blocks it computes and take them (kilnlm.runtime.kv_cache); the output is
    transformers' greedy output all the same, and every later request reused the system prompt's blocks."""
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=24, max_seq_len=96, tokens_per_block=4)
    system = tokenizer.encode("You are a careful assistant who answers every question in one short sentence. Q:")
    questions = [" Why is the sky blue?", " What is a kiln?", " Name a prime.", " Hi", " 1, 2, 3,", " Say yes."]
    prompts = [system + tokenizer.encode(q, add_special_tokens=False) for q in questions]
    expected = [hf_greedy(tiny_hf_model, p, 12) for p in prompts]
    with Executor(engine, tokenizer, ExecutorConfig(enable_kv_cache_reuse=True)) as executor:
        outputs = run_in_flight(executor, prompts, [12] * len(prompts))
        stats = executor.stats()
    assert outputs == expected
    assert stats.num_reused_blocks >= (len(prompts) - 1) * (len(system) // 4)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_text_and_chat_prompt(make_eager_engine, tiny_hf_model, tokenizer, hf_tokenizer):
    engine = make_eager_engine()
    messages = [{"role": "user", "content": "Write a haiku about kilns 🔥"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert prompt == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_greedy(tiny_hf_model, prompt, 16)
    with Executor(engine, tokenizer) as executor:
        no_eos = tuple((e,) for e in executor.eos_token_ids)
        response = executor.generate(prompt, SamplingParams(max_tokens=16, bad_words=no_eos))
    assert response.token_ids == expected
    assert response.text == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert response.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_is_reproducible_across_batches(make_eager_engine, tokenizer):
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=32)
    prompt = tokenizer.encode("Sampling with a seed")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    with Executor(engine, tokenizer) as executor:
        alone = executor.generate(prompt, params).token_ids
        others = [executor.submit(tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True))
                  for i, p in enumerate(PROMPTS[:3])]
        together = executor.generate(prompt, params).token_ids
        for rid in others:
            list(executor.stream(rid, timeout_s=60))
    assert alone == together


def test_prefix_reuse_skips_cached_tokens_and_gives_identical_logits(make_eager_engine, tokenizer):
    """Compute a prompt, then a second prompt sharing its first blocks: only the uncached tail is computed,
    and its logits equal those of computing the second prompt from scratch in a fresh pool."""
    engine = make_eager_engine(max_num_tokens=64, tokens_per_block=4)
    build = engine.manifest.build
    limits = InputLimits(build.max_num_tokens, build.max_batch_size, build.max_blocks_per_seq, build.tokens_per_block)
    first = tokenizer.encode("Shared system prompt: you are a careful assistant. Question one?")
    second = first[:12] + tokenizer.encode(" A different question entirely.", add_special_tokens=False)

    def run(scheduler: Scheduler, pool: torch.Tensor, request_id: int, token_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Schedule the request alone, run its context, sample its one token: the executor's path."""
        request = make_request(request_id, token_ids, max_tokens=1)
        scheduler.add(request)
        batch = scheduler.schedule()
        num_cached = request.num_computed_tokens
        assert [(s.request, s.num_new_tokens) for s in batch.seqs] == [(request, len(token_ids) - num_cached)]
        logits = engine.forward(InputBuilder(limits).build(batch, scheduler.kv_cache), pool)
        scheduler.update(batch, [[token] for token in logits.argmax(-1).tolist()])  # registers the blocks; finishes ("length")
        assert request.finished and not scheduler.has_work()
        return logits, num_cached

    def make(num_blocks: int) -> Scheduler:
        return make_scheduler(num_blocks, build.tokens_per_block, build.max_batch_size, build.max_num_tokens,
                              enable_kv_cache_reuse=True)

    scheduler = make(64)
    pool = engine.allocate_kv_cache(64)
    run(scheduler, pool, 1, first)
    reused_logits, num_cached = run(scheduler, pool, 2, second)
    assert num_cached == 12  # three full blocks of 4 shared tokens skipped

    fresh_logits, fresh_cached = run(make(64), engine.allocate_kv_cache(64), 1, second)
    assert fresh_cached == 0
    torch.testing.assert_close(reused_logits, fresh_logits, rtol=1e-5, atol=1e-5)
