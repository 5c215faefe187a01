"""Build options resolved once: defaults from one place, CLI flags named as the fields, validation with
the messages the CLI prints, the frozen result the build, cache key and manifest read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kilnlm.builder.config import (DEFAULT_CALIB_MAX_SEQ_LEN, BuildOptions, ResolvedBuildOptions, option_default,
                                   resolve)
from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import FORMATS, PER_TOKEN_SMOOTHQUANT_ALPHA
from kilnlm.builder.targets import TARGETS
from kilnlm.cli.build_cmd import build_options
from kilnlm.cli.main import make_parser

# BuildOptions fields that no flag sets (API only).
API_ONLY = {"smoke_test", "compile"}


def options(**given) -> BuildOptions:
    return BuildOptions(checkpoint=Path("ck"), output=Path("out"), **given)


def parse(*argv: str):
    return make_parser().parse_args(["build", "--checkpoint", "ck", "--output", "out", *argv])


def test_every_field_is_a_flag_of_the_same_name_with_the_same_default():
    args = parse()
    for f in dataclasses.fields(BuildOptions):
        if f.name in API_ONLY or f.default is dataclasses.MISSING:
            continue
        assert hasattr(args, f.name), f"BuildOptions.{f.name} has no --{f.name.replace('_', '-')} flag"
        assert getattr(args, f.name) == f.default, f.name
    assert build_options(args) == options()


def test_cli_flags_reach_the_fields_they_name():
    args = parse("--qformat", "int4_awq", "--calib-size", "8", "--calib-max-seq-len", "64", "--group-size", "32",
                 "--no-zero-point", "--target", "cpu", "--max-seq-len", "512")
    assert build_options(args) == options(qformat="int4_awq", calib_size=8, calib_max_seq_len=64, group_size=32,
                                          zero_point=False, target="cpu", max_seq_len=512)


def test_cli_choices_and_help_come_from_the_registries():
    sub = make_parser()._subparsers._group_actions[0].choices["build"]
    actions = {a.dest: a for a in sub._actions}
    assert tuple(actions["qformat"].choices) == tuple(FORMATS)
    assert tuple(actions["target"].choices) == tuple(TARGETS)
    assert f"(default: {option_default('max_batch_size')})" in actions["max_batch_size"].help
    assert f"(default: {DEFAULT_CALIB_MAX_SEQ_LEN})" in actions["calib_max_seq_len"].help
    assert "16 for int4_awq" in actions["calib_size"].help and FORMATS["int4_awq"].calib_size == 16


def test_resolve_applies_each_default_once():
    fp32 = resolve(options())
    assert (fp32.dtype, fp32.kv_cache_dtype, fp32.target, fp32.zero_point) == ("float32", "float32", "cpu", None)
    assert fp32.calib_size == FORMATS["fp32"].calib_size and fp32.calib_max_seq_len == DEFAULT_CALIB_MAX_SEQ_LEN
    assert fp32.compile == TARGETS["cpu"].default_compile_options()
    awq = resolve(options(qformat="int4_awq"))
    assert (awq.dtype, awq.zero_point, awq.calib_size, awq.group_size) == ("bfloat16", True, 16, None)
    assert resolve(options(qformat="int4_wo")).zero_point is False
    sq = resolve(options(qformat="int8_sq"))  # dynamic per-token scales by default, TensorRT-LLM's alpha
    assert (sq.per_token, sq.smoothquant_alpha) == (True, PER_TOKEN_SMOOTHQUANT_ALPHA) and FORMATS["int8_sq"].per_token
    assert resolve(build_options(parse("--qformat", "int8_sq", "--per-token"))) == sq
    per_tensor = resolve(build_options(parse("--qformat", "int8_sq", "--no-per-token")))
    assert (per_tensor.per_token, per_tensor.smoothquant_alpha) == (False, None)  # one scale per tensor, alpha searched
    assert resolve(options(qformat="int8_wo")).per_token is False
    assert resolve(options(kv_cache_dtype="fp8")).kv_cache_dtype == "fp8"


def test_resolved_options_are_frozen_and_describe_the_manifest():
    resolved = resolve(options(qformat="fp8", max_seq_len=512))
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.qformat = "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options().qformat = "bf16"
    build = resolved.manifest_build_config()
    assert (build.qformat, build.dtype, build.max_seq_len, build.target) == ("fp8", "bfloat16", 512, "cpu")
    assert resolved.plugins_used() == ["paged_attention", "gemm", "fp8_linear"]
    # every option resolved, plus what resolve adds: the target asked for when it builds a stand-in
    assert ({f.name for f in dataclasses.fields(ResolvedBuildOptions)}
            == {f.name for f in dataclasses.fields(BuildOptions)} | {"deferred"})
    assert resolved.deferred is None


def test_use_fp8_rowwise_is_the_same_build_as_qformat_fp8_rowwise():
    """TensorRT-LLM's spelling (``--qformat fp8 --use_fp8_rowwise``) resolves to exactly the options of
    ``--qformat fp8_rowwise``, through the CLI too; fp8 itself is another build."""
    rowwise = resolve(options(qformat="fp8_rowwise"))
    assert resolve(options(qformat="fp8", use_fp8_rowwise=True)) == rowwise
    assert resolve(build_options(parse("--qformat", "fp8", "--use-fp8-rowwise"))) == rowwise
    assert (rowwise.qformat, rowwise.use_fp8_rowwise, rowwise.dtype) == ("fp8_rowwise", True, "bfloat16")
    assert rowwise.plugins_used() == ["paged_attention", "gemm", "fp8_rowwise_linear"]
    assert resolve(options(qformat="fp8")).use_fp8_rowwise is False
    # no calibration text for the format itself, but an 8-bit KV cache still calibrates its scales, and
    # the mixed-precision search (on by default) scores the linears on it
    assert resolve(options(qformat="fp8_rowwise", kv_cache_dtype="fp8", calib_size=8, auto_quantize_bits=8)).calib_size == 8
    assert resolve(options(qformat="fp8_rowwise", calib_size=8)).calib_size == 8


@pytest.mark.parametrize("qformat", [f.name for f in FORMATS.values() if f.auto_quantize_bits is not None])
def test_auto_quantize_bits_default_and_off(qformat):
    """The formats that offer the mixed-precision search resolve their registry budget by default (a search
    where it exceeds the format's weight bits: fp8_rowwise's, not fp8's); ``--auto-quantize-bits`` at the
    format's own weight bits turns it off, above them on; other formats resolve None."""
    fmt = FORMATS[qformat]
    default = resolve(options(qformat=qformat))
    assert (default.auto_quantize_bits, default.searches_precision) == (fmt.auto_quantize_bits,
                                                                        fmt.auto_quantize_bits > fmt.weight_bits)
    assert resolve(options(qformat="fp8_rowwise")).searches_precision and not resolve(options(qformat="fp8")).searches_precision
    assert resolve(options(qformat=qformat, auto_quantize_bits=9)).searches_precision
    off = resolve(options(qformat=qformat, auto_quantize_bits=fmt.weight_bits))
    assert (off.auto_quantize_bits, off.searches_precision) == (fmt.weight_bits, False)
    assert resolve(build_options(parse("--qformat", qformat, "--auto-quantize-bits", "9"))).auto_quantize_bits == 9.0
    assert resolve(options(qformat="int8_wo")).auto_quantize_bits is None


@pytest.mark.parametrize("given, fragment", [
    (dict(qformat="int5"), "--qformat 'int5' is not supported: choose one of fp32, bf16, fp8, fp8_rowwise, int4_awq"),
    (dict(qformat="fp32", dtype="bfloat16"), "--qformat fp32 runs float32 activations, not bfloat16: drop --dtype or "
                                             "pick --qformat bf16"),
    (dict(qformat="bf16", dtype="float32"), "pick --qformat fp32"),
    (dict(dtype="float16"), "--dtype 'float16' is not supported: choose auto, float32, bfloat16"),
    (dict(target="gpu"), "--target 'gpu' is not supported: choose one of cpu"),
    (dict(max_num_tokens=0), "--max-num-tokens is 0: it must be at least 1"),
    (dict(calib_size=8), "--calib-size given but --qformat fp32 does not calibrate"),
    (dict(qformat="fp8", calib_max_seq_len=0), "--calib-max-seq-len is 0: it must be at least 1"),
    (dict(qformat="int8_sq", per_token=True, smoothquant_alpha=2.0), "--smoothquant-alpha 2.0: it must be within [0, 1]"),
    (dict(qformat="int8_wo", use_fp8_rowwise=True), "--use-fp8-rowwise applies to --qformat fp8, not int8_wo: drop it, "
                                                    "or pick --qformat fp8_rowwise"),
    (dict(qformat="fp8", use_fp8_rowwise=True, calib_size=8, auto_quantize_bits=8),
     "--calib-size given but --qformat fp8_rowwise does not calibrate"),
    (dict(qformat="fp8_rowwise", calib_data="x.txt", auto_quantize_bits=8.0),
     "--calib-data given but --qformat fp8_rowwise does not calibrate"),
    (dict(qformat="int8_wo", auto_quantize_bits=8.5), "--auto-quantize-bits applies to --qformat fp8 / fp8_rowwise, "
                                                      "not int8_wo: drop it"),
    (dict(qformat="fp8", auto_quantize_bits=7.5), "--auto-quantize-bits 7.5: it must be within [8, 16] for --qformat fp8"),
    (dict(qformat="fp8_rowwise", auto_quantize_bits=17), "--auto-quantize-bits 17: it must be within [8, 16]"),
])
def test_resolve_refuses_with_what_to_change(given, fragment):
    with pytest.raises(BuildError) as info:
        resolve(options(**given))
    assert fragment in str(info.value)
