"""FP8 engines: ModelOpt-calibrated per-tensor scales (per part of fused linears), 1-byte weights, and a real answer from SmolLM2."""

from __future__ import annotations

import pytest
import torch

from factories import CAPITAL_QUESTION, greedy_generate

from kilnlm.builder.network.layers import FP8_E4M3_MAX, Fp8Amax, make_linear


def test_fused_fp8_linear_keeps_each_parts_scale():
    """A fused linear quantizes each part with that part's own per-tensor scale (as the unfused linears
    would be, ModelOpt's recipe): weight_scale is [out_features], constant over each part's rows."""
    torch.manual_seed(0)
    parts = [torch.randn(8, 16), 3 * torch.randn(4, 16)]
    amax = [Fp8Amax(float(p.abs().max()), 2.0) for p in parts]
    linear = make_linear(parts, [None, None], torch.bfloat16, amax)
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight.element_size() == 1
    assert linear.weight.shape == (12, 16)
    expected_scales = torch.cat([torch.full((8,), amax[0].weight_amax / FP8_E4M3_MAX),
                                 torch.full((4,), amax[1].weight_amax / FP8_E4M3_MAX)])
    assert linear.weight_scale.shape == (12,)
    torch.testing.assert_close(linear.weight_scale, expected_scales)
    assert float(linear.input_scale) == pytest.approx(2.0 / FP8_E4M3_MAX)
    for part, a, rows in zip(parts, amax, (slice(0, 8), slice(8, 12))):
        alone = make_linear([part], [None], torch.bfloat16, [a])
        assert alone.weight_scale.dim() == 0
        assert torch.equal(linear.weight[rows].view(torch.uint8), alone.weight.view(torch.uint8))
    dequantized = linear.weight.float() * linear.weight_scale[:, None]
    # E4M3 keeps 3 mantissa bits: relative error at most 2^-4 of the value (plus subnormals near 0).
    torch.testing.assert_close(dequantized, torch.cat(parts), atol=float(expected_scales.max()) * 2**-6 * 8, rtol=2**-4)


def test_calibration_text_is_deterministic_english(smollm2_hf_dir):
    from transformers import AutoTokenizer

    from kilnlm.builder.quantize import CalibrationConfig, calibration_batches

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    cfg = CalibrationConfig(num_samples=4, seq_len=256)
    first, second = calibration_batches(tokenizer, cfg), calibration_batches(tokenizer, cfg)
    assert len(first) == 4 and all(b.shape == (1, 256) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert " the " in tokenizer.decode(first[1][0])


@pytest.mark.e2e
def test_fp8_engine_weights_are_one_byte(smollm2_engine_fp8_dir):
    """The package holds the decoder linears at 1 byte per weight and embedding (tied LM head) at
    2 bytes: its size is bounded by that sum plus a small margin, far below a bf16 engine's."""
    from kilnlm.plugins import PLUGIN_VERSIONS
    from kilnlm.runtime.manifest import read_manifest

    manifest = read_manifest(smollm2_engine_fp8_dir)
    m = manifest.model
    assert manifest.build.qformat == "fp8" and manifest.build.dtype == "bfloat16"
    assert manifest.plugins == {name: PLUGIN_VERSIONS[name] for name in ("paged_attention", "gemm", "fp8_linear")}
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    linear_weights = m.num_layers * (m.hidden_size * (q_dim + 2 * kv_dim) + q_dim * m.hidden_size
                                     + 3 * m.hidden_size * m.intermediate_size)
    embedding_bytes = 2 * m.vocab_size * m.hidden_size
    fp8_bytes = linear_weights + embedding_bytes
    bf16_bytes = 2 * linear_weights + embedding_bytes
    package_bytes = (smollm2_engine_fp8_dir / "model.pt2").stat().st_size
    assert package_bytes < fp8_bytes * 1.05 + 4e6, (package_bytes, fp8_bytes)
    assert package_bytes < 0.7 * bf16_bytes


@pytest.mark.e2e
def test_fp8_smollm2_knows_the_capital_of_france(smollm2_engine_fp8_dir):
    from transformers import AutoTokenizer

    from kilnlm.runtime.engine import Engine

    engine = Engine.load(smollm2_engine_fp8_dir)
    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    generated = greedy_generate(engine, list(prompt_ids), 24, engine.manifest.generation.eos_token_ids)
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer
