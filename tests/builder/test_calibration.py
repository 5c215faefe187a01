"""Calibration data (--calib-data), ModelOpt's int4 layout conversion and the integer layers' fusion rules:
fast unit tests, no engine builds."""

from __future__ import annotations

import json

import pytest
import torch

from kilnlm.builder.calibration import (CalibrationConfig, calibration_batches, default_calibration_texts,
                                        read_calibration_text)
from kilnlm.builder.errors import BuildError
from kilnlm.builder.network.layers import Int4Linear, Int8SqLinear, IntQuantization, QuantizedWeights, int4_engine_scales
from kilnlm.plugins.reference import int4_linear_reference, pack_int4, unpack_int4

ENGLISH = ("The quick brown fox jumps over the lazy dog. " * 40).strip()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_plain_text_and_jsonl_give_the_same_text(tmp_path):
    (tmp_path / "calib.txt").write_text("first record\n\nsecond record")
    (tmp_path / "calib.jsonl").write_text(json.dumps({"text": "first record"}) + "\n\n"
                                          + json.dumps({"text": "second record", "id": 2}) + "\n")
    assert read_calibration_text(tmp_path / "calib.txt") == read_calibration_text(tmp_path / "calib.jsonl")


# The factual questions the quality and serving tests ask (test_formats_triton, test_quality's probes): the
# bundled calibration text must never contain their answers, or a right answer would prove nothing.
HELD_OUT_WORDS = ("france", "french", "paris", "tokyo", "berlin", "madrid", "romeo", "jupiter", "capital of")


def test_default_text_is_general_english_then_the_standard_library_reference():
    general, reference = default_calibration_texts()
    assert len(reference) > 400_000 and " the " in reference
    assert len(general) > 40_000 and general.count("\n\nQuestion: ") >= 40
    lowered = general.lower()
    assert [word for word in HELD_OUT_WORDS if word in lowered] == []


def _is_window_of(window: torch.Tensor, ids: list[int]) -> bool:
    tokens = window[0].tolist()
    return any(ids[i: i + len(tokens)] == tokens for i, first in enumerate(ids) if first == tokens[0])


@pytest.mark.parametrize("num_samples", [1, 5, 6])
def test_default_samples_alternate_between_the_general_text_and_the_reference(tokenizer, num_samples):
    general, reference = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in default_calibration_texts())
    batches = calibration_batches(tokenizer, CalibrationConfig(num_samples=num_samples, seq_len=64))
    assert len(batches) == num_samples and all(b.shape == (1, 64) for b in batches)
    assert all(_is_window_of(b, general if i % 2 == 0 else reference) for i, b in enumerate(batches))
    assert len({tuple(b[0].tolist()) for b in batches}) == num_samples


def test_default_validation_windows_are_disjoint_from_the_calibration_windows(tokenizer):
    """At the default 24 x 256 tokens each default text holds two windows per sample, so int8_sq's alpha
    search validates on windows the calibration never saw."""
    cfg = CalibrationConfig(num_samples=24, seq_len=256)
    calibration, validation = calibration_batches(tokenizer, cfg), calibration_batches(tokenizer, cfg, validation=True)
    assert len(calibration) == len(validation) == 24
    assert not any(torch.equal(c, v) for c in calibration for v in validation)


def test_default_windows_longer_than_the_general_text_come_from_the_reference(tokenizer):
    general, reference = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in default_calibration_texts())
    seq_len = len(general) + 1
    batches = calibration_batches(tokenizer, CalibrationConfig(num_samples=2, seq_len=seq_len))
    assert len(batches) == 2 and all(_is_window_of(b, reference) for b in batches)


@pytest.mark.parametrize("content, suffix, fragment", [
    (None, ".txt", "does not exist"),
    ("   \n\n", ".txt", "holds no text"),
    ('{"content": "no text field"}\n', ".jsonl", 'no string "text" field'),
    ("not json at all\n", ".jsonl", "line 1 is not JSON"),
    ("", ".jsonl", "holds no text"),
])
def test_bad_calibration_files_are_refused(tmp_path, content, suffix, fragment):
    path = tmp_path / f"calib{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BuildError, match=fragment) as info:
        read_calibration_text(path)
    assert str(path) in str(info.value)


def test_batches_from_a_file_are_deterministic_and_evenly_spaced(tmp_path, tokenizer):
    path = tmp_path / "calib.txt"
    path.write_text(ENGLISH)
    cfg = CalibrationConfig(num_samples=3, seq_len=16, data_path=path)
    first, second = calibration_batches(tokenizer, cfg), calibration_batches(tokenizer, cfg)
    assert len(first) == 3 and all(b.shape == (1, 16) and b.dtype == torch.int64 for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ids = tokenizer(ENGLISH, add_special_tokens=False)["input_ids"]
    stride = (len(ids) // 16) // 3
    assert first[1][0].tolist() == ids[stride * 16: stride * 16 + 16]


def test_validation_windows_are_disjoint_from_the_calibration_windows(tmp_path, tokenizer):
    """The validation windows (int8_sq's alpha search) sit half a spacing past the calibration ones: the
    same count and shape, no token position shared where the text holds two windows per sample."""
    path = tmp_path / "calib.txt"
    path.write_text(ENGLISH)
    cfg = CalibrationConfig(num_samples=3, seq_len=16, data_path=path)
    ids = tokenizer(ENGLISH, add_special_tokens=False)["input_ids"]
    stride = (len(ids) // 16) // 3
    assert stride >= 2, "the test text must hold two windows per sample"
    calibration, validation = calibration_batches(tokenizer, cfg), calibration_batches(tokenizer, cfg, validation=True)
    assert len(validation) == 3 and all(b.shape == (1, 16) for b in validation)
    shift = stride // 2
    assert validation[1][0].tolist() == ids[(stride + shift) * 16: (stride + shift) * 16 + 16]
    starts = lambda i, s: set(range((i * stride + s) * 16, (i * stride + s) * 16 + 16))
    assert not set().union(*(starts(i, 0) for i in range(3))) & set().union(*(starts(i, shift) for i in range(3)))
    assert not any(torch.equal(c, v) for c in calibration for v in validation)


def test_text_shorter_than_one_sample_names_the_fix(tmp_path, tokenizer):
    path = tmp_path / "short.txt"
    path.write_text("too short")
    with pytest.raises(BuildError, match="lower --calib-max-seq-len or pass a longer --calib-data"):
        calibration_batches(tokenizer, CalibrationConfig(num_samples=4, seq_len=256, data_path=path))


def test_modelopt_int4_packing_converts_exactly():
    """ModelOpt packs pairs of output rows per byte; kilnlm pairs of input columns. Same integers after."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    from kilnlm.builder.export import modelopt_int4_to_kilnlm

    torch.manual_seed(0)
    weight, group_size = torch.randn(12, 64), 16
    scale = weight.reshape(12, 4, 16).abs().amax(-1) / 7  # [out, in // group]
    q = (weight / scale.repeat_interleave(group_size, 1)).round().clamp(-8, 7).to(torch.int8)
    converted = modelopt_int4_to_kilnlm(pack_int4_in_uint8(weight, scale, group_size))
    assert converted.shape == (12, 32) and converted.dtype == torch.uint8
    assert torch.equal(unpack_int4(converted), q)


def test_kilnlm_int4_packing_converts_back_to_modelopts():
    """The zero-point rewrite packs int4 values as ModelOpt does (two output rows per byte); reading that back
    gives the same integers, every value of [-8, 7] in both nibbles."""
    from kilnlm.builder.export import kilnlm_int4_to_modelopt, modelopt_int4_to_kilnlm

    q = torch.randint(-8, 8, (16, 48), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    q[:2, :16] = torch.arange(-8, 8, dtype=torch.int8)
    packed = kilnlm_int4_to_modelopt(q)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 48)
    assert torch.equal(unpack_int4(modelopt_int4_to_kilnlm(packed)), q)


def _int4_part(out_features: int, in_features: int, group_size: int, seed: int) -> QuantizedWeights:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, in_features // group_size, generator=g) + 0.01
    return QuantizedWeights(pack_int4(q), scale)


@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-point"])
def test_fused_int4_linear_equals_its_parts(zero_points):
    """Fused q/k/v-like parts (with zero points: two parts with, one without, which counts as zeros)."""
    parts = [_int4_part(8, 32, 16, 0), _int4_part(4, 32, 16, 1), _int4_part(4, 32, 16, 2)]
    if zero_points:
        for i in (0, 2):
            parts[i].zero_point = torch.randint(-8, 8, parts[i].weight_scale.shape, generator=torch.Generator().manual_seed(i),
                                                dtype=torch.int8)
    fused = Int4Linear(parts, 16, torch.float32)
    assert (fused.zero_point is not None) == zero_points
    # the engine stores each linear's scales as int4_engine_scales does (float16 for these): the parts' rows, as stored
    scales = [int4_engine_scales(p.weight_scale) for p in parts]
    assert torch.equal(fused.weight_scale, torch.cat(scales))
    x = torch.randn(5, 32)
    y = int4_linear_reference(x, fused.weight, fused.weight_scale, fused.pre_quant_scale, fused.bias, 16, fused.zero_point)
    expected = torch.cat([int4_linear_reference(x, p.weight, s, None, None, 16, p.zero_point) for p, s in zip(parts, scales)],
                         dim=1)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)


def test_fused_parts_must_share_one_pre_quant_scale():
    a, b = _int4_part(4, 32, 16, 0), _int4_part(4, 32, 16, 1)
    a.pre_quant_scale, b.pre_quant_scale = torch.ones(32), 2 * torch.ones(32)
    with pytest.raises(BuildError, match="different pre_quant_scales"):
        Int4Linear([a, b], 16, torch.float32)


def test_fused_int8_sq_takes_the_largest_input_scale():
    parts = [QuantizedWeights(torch.ones(4, 8, dtype=torch.int8), torch.ones(4), torch.tensor(s)) for s in (0.5, 2.0, 1.0)]
    assert float(Int8SqLinear(parts, torch.float32).input_scale) == 2.0


def test_smoothing_folds_into_the_norms_exactly():
    """norm(x) * w then * s equals norm(x) * (w * s): the folded network computes the same activations.
    A quantized LM head's smoothing folds into the final norm."""
    from kilnlm.builder.network.llama import fold_smoothing_into_norms

    hidden = 16
    scale = torch.rand(hidden) + 0.5
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    linears = {f"model.layers.0.{n}": QuantizedWeights(torch.zeros(4, hidden, dtype=torch.int8), torch.ones(4),
                                                       torch.tensor(1.0), scale.clone()) for n in names}
    linears["model.layers.0.self_attn.o_proj"] = QuantizedWeights(torch.zeros(4, hidden, dtype=torch.int8), torch.ones(4),
                                                                  torch.tensor(1.0), scale.clone())
    linears["lm_head"] = QuantizedWeights(torch.zeros(4, hidden, dtype=torch.int8), torch.ones(4), torch.tensor(1.0),
                                          scale.clone())
    norm_w = torch.rand(hidden)
    state = {"model.layers.0.input_layernorm.weight": norm_w.clone(),
             "model.layers.0.post_attention_layernorm.weight": norm_w.clone(), "model.norm.weight": norm_w.clone()}
    fold_smoothing_into_norms(state, IntQuantization("int8_sq", None, linears), num_layers=1)
    for key in state:
        torch.testing.assert_close(state[key], norm_w * scale, rtol=0, atol=0)
    assert all(linears[f"model.layers.0.{n}"].pre_quant_scale is None for n in names)
    assert linears["lm_head"].pre_quant_scale is None
    assert linears["model.layers.0.self_attn.o_proj"].pre_quant_scale is not None  # no norm precedes o_proj


def test_group_size_refusal_names_the_layer_and_valid_sizes(tiny_llama_dir):
    from transformers import AutoConfig

    from kilnlm.builder.quantize_int import check_group_size

    config = AutoConfig.from_pretrained(tiny_llama_dir)  # hidden 64, intermediate 128
    check_group_size(config, 32, quantize_lm_head=False)
    with pytest.raises(BuildError, match=r"--group-size 128 does not divide self_attn.q_proj / k_proj / v_proj "
                                         r"\(in_features 64\).*valid group sizes for this model: 16, 32, 64"):
        check_group_size(config, 128, quantize_lm_head=False)
