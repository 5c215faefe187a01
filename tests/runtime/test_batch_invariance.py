"""Batch invariance (issue 26, item 4): a request's greedy tokens do not depend on what else is in the batch.
16 prompts of real English text (8-158 tokens) generate 48 greedy tokens each, first one at a time, then all
16 submitted together, each run on a fresh executor (no prefix cache shared between the two). The engines:
SmolLM2's whole-model ones that CI builds anyway (tests/conftest.py, ``SMOLLM2_CI_ENGINES``), and for the other
formats engines of its first layers (``smollm2_truncated_dir``: the same kernels, shapes, LM head and
vocabulary), which cost a fraction of a whole-model build.

With KILNLM_BATCH_INVARIANT=1 every format, on any CPU: every kernel then sums each row in one order at
every token count (plugins/csrc/cpu_features.h). Without it, the formats whose kernels do so anyway, on CPUs
with AVX512-BF16 and VBMI: int8_sq (exact int32 sums) and, without AMX-BF16 (whose tiles take fp8's context
phase), fp8 (the GEMV and the tiles in one column order), the bf16 LM head's direct kernel serving their
one row per sequence. docs/reliability.md gives the measurements, the kernels responsible and what the
switch costs."""

from __future__ import annotations

import pytest
from conftest import ci_builds_whole_smollm2

from factories import BATCH_INVARIANT_CPU_FLAGS, BATCH_INVARIANT_SKIP_REASON, cpu_has
from kilnlm.builder.formats import FORMATS
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.request import SamplingParams

pytestmark = pytest.mark.e2e

INVARIANT_WITHOUT_SWITCH = ["int8_sq"] + ([] if cpu_has("amx_bf16") else ["fp8"])
NUM_PROMPTS, MAX_TOKENS = 16, 48


def english_prompts(tokenizer) -> list[list[int]]:
    from pydoc_data.topics import topics

    words = " ".join(topics[key] for key in sorted(topics)).split()
    return [tokenizer.encode(" ".join(words[2000 + 500 * i:2000 + 500 * i + 8 + (i * 37) % 150]))
            for i in range(NUM_PROMPTS)]


def generate(engine_dir, together: bool) -> list[list[int]]:
    executor = Executor.from_engine_dir(engine_dir, ExecutorConfig())
    try:
        prompts = english_prompts(executor.tokenizer)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        if not together:
            return [list(executor.generate(p, params, timeout_s=600).token_ids) for p in prompts]
        ids = [executor.submit(p, params) for p in prompts]
        return [[t for r in executor.stream(i, timeout_s=600) for t in r.token_ids] for i in ids]
    finally:
        executor.shutdown()


def format_engine(smollm2_format_engine, qformat: str):
    """The whole-model engine where CI builds it anyway, else the first layers' (module docstring)."""
    return smollm2_format_engine(qformat, truncated=not ci_builds_whole_smollm2(qformat))


def assert_alone_equals_together(engine_dir) -> None:
    alone, together = generate(engine_dir, together=False), generate(engine_dir, together=True)
    assert all(len(tokens) == MAX_TOKENS for tokens in alone + together)
    differing = {i: next(j for j, (a, b) in enumerate(zip(x, y)) if a != b)
                 for i, (x, y) in enumerate(zip(alone, together)) if x != y}
    assert not differing, f"prompt -> first differing token: {differing}"


@pytest.mark.parametrize("qformat", list(FORMATS))
def test_with_the_switch_every_format_gives_greedy_tokens_alone_equal_those_in_a_batch(smollm2_format_engine, qformat,
                                                                                       monkeypatch):
    monkeypatch.setenv("KILNLM_BATCH_INVARIANT", "1")
    assert_alone_equals_together(format_engine(smollm2_format_engine, qformat))


@pytest.mark.skipif(not cpu_has(*BATCH_INVARIANT_CPU_FLAGS), reason=BATCH_INVARIANT_SKIP_REASON)
@pytest.mark.parametrize("qformat", INVARIANT_WITHOUT_SWITCH)
def test_greedy_tokens_alone_equal_those_in_a_batch_of_16(smollm2_format_engine, qformat, monkeypatch):
    monkeypatch.delenv("KILNLM_BATCH_INVARIANT", raising=False)
    assert_alone_equals_together(format_engine(smollm2_format_engine, qformat))
