"""The real model: SmolLM2-135M-Instruct fp32 engine against transformers on the converted checkpoint."""

from __future__ import annotations

import pytest
import torch

from factories import CAPITAL_QUESTION, greedy_generate, make_engine_inputs

# 30 layers in float32 with kernels that sum in a different order than PyTorch's: measured max abs
# difference 6e-5 on logits of magnitude ~25; the bound leaves room for other CPUs' summation orders.
SMOLLM2_FP32_ATOL = 1e-3

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hf(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(smollm2_engine_fp32_dir):
    from kilnlm.runtime.engine import Engine

    return Engine.load(smollm2_engine_fp32_dir)


def chat_ids(engine, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir)
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def test_manifest_describes_smollm2(engine):
    m, b = engine.manifest.model, engine.manifest.build
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert m.tie_word_embeddings and m.rope_theta == 100000.0
    assert (b.max_batch_size, b.max_seq_len, b.max_num_tokens, b.tokens_per_block) == (32, 2048, 2048, 32)
    assert engine.manifest.generation.eos_token_ids == [2]
    assert engine.manifest.source_checkpoint_digest.startswith("sha256:")


def test_packed_prompts_then_decode_match_hf(engine, hf):
    prompts = [chat_ids(engine, CAPITAL_QUESTION), chat_ids(engine, "Write a haiku about compilers.")]
    build = engine.manifest.build
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq
    kv_cache = engine.allocate_kv_cache(len(prompts) * max_blocks)
    logits = engine.forward(make_engine_inputs([(p, 0) for p in prompts], tpb, max_blocks), kv_cache)
    seqs = [list(p) for p in prompts]
    for step in range(4):
        with torch.no_grad():
            refs = [hf(torch.tensor([s])).logits[0, -1] for s in seqs]
        for b in range(len(seqs)):
            torch.testing.assert_close(logits[b], refs[b], atol=SMOLLM2_FP32_ATOL, rtol=0)
        next_ids = [int(r.argmax()) for r in refs]
        step_inputs = make_engine_inputs([([t], len(s)) for t, s in zip(next_ids, seqs)], tpb, max_blocks)
        for s, t in zip(seqs, next_ids):
            s.append(t)
        logits = engine.forward(step_inputs, kv_cache)


def test_fp32_answers_paris(engine):
    generated = greedy_generate(engine, chat_ids(engine, CAPITAL_QUESTION), 24,
                                engine.manifest.generation.eos_token_ids)
    from transformers import AutoTokenizer

    assert "Paris" in AutoTokenizer.from_pretrained(engine.tokenizer_dir).decode(generated)
