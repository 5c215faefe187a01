"""Compiled engines against Hugging Face transformers (the reference), through the paged KV cache."""

from __future__ import annotations

import pytest
import torch

from factories import make_engine_inputs

FP32_ATOL = 1e-4
# bf16 weights and activations over 2 layers vs the fp32 reference: bf16 has an 8-bit mantissa
# (relative step 2^-8 ~ 0.4%), so logits of magnitude ~3 move by a few hundredths.
BF16_ATOL = 0.1

PROMPTS = [
    [1, 9519, 28, 314, 1345, 42, 7, 11],  # 8 tokens
    [500, 600, 700],  # 3 tokens
    list(range(1000, 1041)),  # 41 tokens: crosses two KV-block boundaries (tokens_per_block 16)
    [77],  # 1 token
]


def hf_model(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[len(ids), vocab] float32`` of the full sequence in one HF forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny_engine(tiny_engine_dir):
    from kilnlm.runtime.engine import Engine

    return Engine.load(tiny_engine_dir)


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    return hf_model(tiny_llama_dir)


def test_packed_context_batch_matches_hf(tiny_engine, tiny_hf):
    build = tiny_engine.manifest.build
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], build.tokens_per_block, build.max_blocks_per_seq)
    kv_cache = tiny_engine.allocate_kv_cache(len(PROMPTS) * build.max_blocks_per_seq)
    logits = tiny_engine.forward(inputs, kv_cache)
    assert logits.shape == (len(PROMPTS), tiny_engine.manifest.model.vocab_size)
    assert logits.dtype == torch.float32
    for b, prompt in enumerate(PROMPTS):
        ref = hf_logits(tiny_hf, prompt)[-1]
        torch.testing.assert_close(logits[b], ref, atol=FP32_ATOL, rtol=0)


def test_context_then_generation_matches_hf(tiny_engine, tiny_hf):
    """Prefill chunks, then decode steps batched with another sequence's context chunk (in-flight batching):
    every step's logits equal HF's logits at that position of the full sequence."""
    build = tiny_engine.manifest.build
    seq_a = list(range(300, 330))  # 30 tokens: context 20, then 10 generation steps
    seq_b = list(range(2000, 2024))  # 24 tokens: context chunks of 8 alongside a's generation steps
    ref_a, ref_b = hf_logits(tiny_hf, seq_a), hf_logits(tiny_hf, seq_b)
    kv_cache = tiny_engine.allocate_kv_cache(2 * build.max_blocks_per_seq)
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq

    inputs = make_engine_inputs([(seq_a[:20], 0)], tpb, max_blocks)
    torch.testing.assert_close(tiny_engine.forward(inputs, kv_cache)[0], ref_a[19], atol=FP32_ATOL, rtol=0)
    num_b = 0
    for pos in range(20, 30):
        seqs = [(seq_a[pos:pos + 1], pos)]
        chunk_b = seq_b[num_b:num_b + 8]
        if chunk_b:
            seqs.append((chunk_b, num_b))
        logits = tiny_engine.forward(make_engine_inputs(seqs, tpb, max_blocks), kv_cache)
        torch.testing.assert_close(logits[0], ref_a[pos], atol=FP32_ATOL, rtol=0)
        if chunk_b:
            num_b += len(chunk_b)
            torch.testing.assert_close(logits[1], ref_b[num_b - 1], atol=FP32_ATOL, rtol=0)


def test_kv_cache_written_in_place(tiny_engine):
    build = tiny_engine.manifest.build
    kv_cache = tiny_engine.allocate_kv_cache(build.max_blocks_per_seq)
    ptr = kv_cache.data_ptr()
    tiny_engine.forward(make_engine_inputs([([5, 6, 7], 0)], build.tokens_per_block, build.max_blocks_per_seq), kv_cache)
    assert kv_cache.data_ptr() == ptr
    written = kv_cache[:, :, 0, :3]  # block 0, offsets 0..2 of every layer, K and V
    assert written.abs().sum(dim=(-1, -2)).min() > 0
    assert kv_cache[:, :, 0, 3:].abs().sum() == 0


def test_bf16_engine_close_to_hf(tiny_llama_dir, tiny_hf, tmp_path):
    from conftest import TINY_ENGINE_LIMITS, build_test_engine

    from kilnlm.runtime.engine import Engine

    engine = Engine.load(build_test_engine(tiny_llama_dir, tmp_path / "bf16", qformat="bf16", **TINY_ENGINE_LIMITS))
    assert engine.dtype == torch.bfloat16 and engine.manifest.build.kv_cache_dtype == "bfloat16"
    build = engine.manifest.build
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], build.tokens_per_block, build.max_blocks_per_seq)
    logits = engine.forward(inputs, engine.allocate_kv_cache(len(PROMPTS) * build.max_blocks_per_seq))
    assert logits.dtype == torch.float32
    for b, prompt in enumerate(PROMPTS):
        ref = hf_logits(tiny_hf, prompt)[-1]
        torch.testing.assert_close(logits[b], ref, atol=BF16_ATOL, rtol=0)
        assert logits[b].argmax() == ref.argmax() or ref.topk(2).values.diff().abs() < BF16_ATOL


def test_engine_refuses_batches_beyond_its_limits(tiny_engine):
    from kilnlm.runtime.errors import EngineError

    build = tiny_engine.manifest.build
    too_many = [([1], 0)] * (build.max_batch_size + 1)
    inputs = make_engine_inputs(too_many, build.tokens_per_block, build.max_blocks_per_seq)
    with pytest.raises(EngineError, match="max-batch-size"):
        tiny_engine.forward(inputs, tiny_engine.allocate_kv_cache(len(too_many) * build.max_blocks_per_seq))
