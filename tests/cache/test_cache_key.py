"""The cache key: content-based, blind to where things lie, and changed by every option that changes
the engine (checked field by field against the resolved build options, so a new build option needs a case
here)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from kilnlm.builder.cache_key import EXCLUDED_FIELDS, checkpoint_content_digest, compute_cache_key
from kilnlm.builder.config import BuildOptions, ResolvedBuildOptions, resolve
from kilnlm.builder.formats import FORMATS
from kilnlm.builder.targets.cpu import CompileOptions

# field -> (base options, changed options): each pair differs in that one field only and is valid for the build.
ENGINE_CHANGES = {
    "qformat": ({}, {"qformat": "bf16"}),
    "dtype": ({"qformat": "fp8"}, {"qformat": "fp8", "dtype": "float32"}),
    "max_batch_size": ({}, {"max_batch_size": 8}),
    "max_seq_len": ({}, {"max_seq_len": 1024}),
    "max_num_tokens": ({}, {"max_num_tokens": 512}),
    "tokens_per_block": ({}, {"tokens_per_block": 16}),
    "tp_size": ({}, {"tp_size": 3}),
    "kv_cache_dtype": ({}, {"kv_cache_dtype": "fp8"}),
    "group_size": ({"qformat": "int4_awq"}, {"qformat": "int4_awq", "group_size": 64}),
    "calib_data": ({"qformat": "fp8"}, {"qformat": "fp8", "calib_data": "CALIB"}),
    "calib_size": ({"qformat": "fp8"}, {"qformat": "fp8", "calib_size": 8}),
    "calib_max_seq_len": ({"qformat": "fp8"}, {"qformat": "fp8", "calib_max_seq_len": 64}),
    "quantize_lm_head": ({"qformat": "int4_wo"}, {"qformat": "int4_wo", "quantize_lm_head": True}),
    "per_token": ({"qformat": "int8_sq"}, {"qformat": "int8_sq", "per_token": False}),
    "use_fp8_rowwise": ({"qformat": "fp8"}, {"qformat": "fp8", "use_fp8_rowwise": True}),  # fp8 -> fp8_rowwise
    "auto_quantize_bits": ({"qformat": "fp8_rowwise"}, {"qformat": "fp8_rowwise", "auto_quantize_bits": 8}),
    "smoothquant_alpha": ({"qformat": "int8_sq"}, {"qformat": "int8_sq", "smoothquant_alpha": 0.6}),
    "zero_point": ({"qformat": "int4_awq"}, {"qformat": "int4_awq", "zero_point": False}),
    "compile": ({}, {"compile": CompileOptions(inductor_configs={"freezing": False})}),
    "target": ({}, {"target": "cpu"}),  # the only target yet: checked below that it is keyed
}


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A fake HF checkpoint: the key hashes files and loads nothing, so random bytes do."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}\n')
    (ck / "model.safetensors").write_bytes(os.urandom(1 << 16))
    (ck / "tokenizer.json").write_text('{"model": "fake"}\n')
    return ck


def _key(checkpoint: Path, tmp_path: Path, **options) -> str:
    if options.get("calib_data") == "CALIB":
        options["calib_data"] = tmp_path / "calib.txt"
    return _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "engine", **options)).key


def _compute(options: BuildOptions):
    return compute_cache_key(resolve(options))


def test_every_engine_affecting_option_has_a_case():
    fields = {f.name for f in dataclasses.fields(ResolvedBuildOptions)} - EXCLUDED_FIELDS
    assert fields == set(ENGINE_CHANGES), "add the new build option to ENGINE_CHANGES or EXCLUDED_FIELDS"
    # every option, plus resolve's "deferred" (excluded: a stand-in build is its stand-in target's build)
    assert ({f.name for f in dataclasses.fields(BuildOptions)} | {"deferred"}
            == {f.name for f in dataclasses.fields(ResolvedBuildOptions)})


def test_the_target_is_keyed(checkpoint, tmp_path):
    inputs = _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "engine")).inputs
    assert inputs["build"]["target"] == "cpu" and inputs["toolchain"]["target"] == "cpu"


@pytest.mark.parametrize("field", sorted(set(ENGINE_CHANGES) - {"target"}))
def test_changing_an_engine_option_changes_the_key(checkpoint, tmp_path, field):
    (tmp_path / "calib.txt").write_text("Calibration text.\n" * 100)
    base, changed = ENGINE_CHANGES[field]
    assert _key(checkpoint, tmp_path, **base) != _key(checkpoint, tmp_path, **changed)


def test_options_that_do_not_change_the_engine_keep_the_key(checkpoint, tmp_path):
    key = _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "a")).key
    same = [
        BuildOptions(checkpoint=checkpoint, output=tmp_path / "elsewhere" / "b", overwrite=True, smoke_test=False),
        BuildOptions(checkpoint=checkpoint, output=tmp_path / "c", dtype="float32"),  # what auto resolves to
    ]
    assert all(_compute(opts).key == key for opts in same)
    fp8 = [_compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "d", qformat="fp8", **extra)).key
           for extra in ({}, {"calib_size": 24, "calib_max_seq_len": 256, "auto_quantize_bits": 8})]
    assert len(set(fp8)) == 1  # unset options and their defaults
    assert fp8[0] == _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "d", qformat="fp8",
                                           smoothquant_alpha=FORMATS["fp8"].smoothing_alpha)).key
    assert fp8[0] != _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "d", qformat="fp8",
                                           smoothquant_alpha=0.6)).key  # fp8's smoothing changes its weights
    awq = [_compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "e", qformat="int4_awq", **extra)).key
           for extra in ({}, {"calib_size": 16, "zero_point": True})]
    assert len(set(awq)) == 1  # the format's own defaults
    sq = [_compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "f", qformat="int8_sq", per_token=True, **extra)).key
          for extra in ({}, {"smoothquant_alpha": 0.5})]
    assert len(set(sq)) == 1  # --per-token's alpha
    assert _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "f", qformat="int8_sq", per_token=True)).key \
        == _compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "f", qformat="int8_sq")).key  # the default
    rowwise = [_compute(BuildOptions(checkpoint=checkpoint, output=tmp_path / "g", **spelling)).key
               for spelling in ({"qformat": "fp8_rowwise"}, {"qformat": "fp8", "use_fp8_rowwise": True},
                                {"qformat": "fp8_rowwise", "use_fp8_rowwise": True})]
    assert len(set(rowwise)) == 1  # TensorRT-LLM's spelling and kilnlm's


def test_checkpoint_digest_is_content_based(checkpoint, tmp_path):
    digest = checkpoint_content_digest(checkpoint)
    moved = shutil.copytree(checkpoint, tmp_path / "moved", copy_function=shutil.copy)  # new path, new mtimes
    os.utime(moved / "model.safetensors", (0, 0))
    (moved / "README.md").write_text("a model card\n")  # never read by a build
    assert checkpoint_content_digest(moved) == digest
    weights = bytearray((moved / "model.safetensors").read_bytes())
    weights[123] ^= 1
    (moved / "model.safetensors").write_bytes(weights)
    assert checkpoint_content_digest(moved) != digest
    (checkpoint / "tokenizer.json").write_text('{"model": "other"}\n')  # the tokenizer ships in the engine
    assert checkpoint_content_digest(checkpoint) != digest


def test_calibration_data_is_keyed_by_content(checkpoint, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("one text\n" * 50)
    key = _key(checkpoint, tmp_path, qformat="fp8", calib_data=calib)
    copy = tmp_path / "copy.txt"
    shutil.copy(calib, copy)
    assert _key(checkpoint, tmp_path, qformat="fp8", calib_data=copy) == key
    calib.write_text("another text\n" * 50)
    assert _key(checkpoint, tmp_path, qformat="fp8", calib_data=calib) != key
    as_jsonl, as_text = tmp_path / "lines.jsonl", tmp_path / "lines.txt"  # same bytes, another parser
    as_jsonl.write_text('{"text": "one text"}\n' * 50)
    shutil.copy(as_jsonl, as_text)
    assert _key(checkpoint, tmp_path, qformat="fp8", calib_data=as_jsonl) != _key(checkpoint, tmp_path, qformat="fp8",
                                                                                  calib_data=as_text)


def test_toolchain_plugins_and_format_version_change_the_key(checkpoint, tmp_path, monkeypatch):
    import kilnlm.builder.cache_key as cache_key
    import kilnlm.runtime.manifest as manifest
    from kilnlm.plugins import PLUGIN_VERSIONS

    key = _key(checkpoint, tmp_path)
    real = cache_key.toolchain_for_key
    other_isa = "avx512" if real("cpu")["cpu_isa"] != "avx512" else "avx2"  # differs from this machine's
    for change in ({"cpu_isa": other_isa}, {"torch": "9.9.9"}, {"kilnlm_sources": "sha256:0"}):
        monkeypatch.setattr(cache_key, "toolchain_for_key", lambda target, change=change: {**real(target), **change})
        assert _key(checkpoint, tmp_path) != key, change
    monkeypatch.setattr(cache_key, "toolchain_for_key", real)
    monkeypatch.setitem(PLUGIN_VERSIONS, "paged_attention", PLUGIN_VERSIONS["paged_attention"] + 1)
    assert _key(checkpoint, tmp_path) != key
    monkeypatch.setitem(PLUGIN_VERSIONS, "paged_attention", PLUGIN_VERSIONS["paged_attention"] - 1)
    monkeypatch.setattr(manifest, "FORMAT_VERSION", manifest.FORMAT_VERSION + 1)
    assert _key(checkpoint, tmp_path) != key
    monkeypatch.setattr(manifest, "FORMAT_VERSION", manifest.FORMAT_VERSION - 1)
    assert _key(checkpoint, tmp_path) == key


def test_toolchain_probe_is_memoized_per_machine_and_compiler(tmp_path, monkeypatch):
    """The inductor probe runs once per (torch, kilnlm, compiler, ATEN_CPU_CAPABILITY, CPU flags)."""
    from kilnlm.builder.cache_key import toolchain_for_key
    from kilnlm.builder.targets import TARGETS
    from kilnlm.builder.targets import cpu as cpu_target
    from kilnlm.builder.toolchain import memo_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    first = toolchain_for_key("cpu")
    assert memo_path().is_file() and first["cpu_isa"] == TARGETS["cpu"].toolchain_versions()["cpu_isa"]
    calls = []

    def probe():
        calls.append(1)
        return {**first, "cpu_isa": "probed"}

    monkeypatch.setattr(cpu_target, "toolchain_versions", probe)
    assert toolchain_for_key("cpu") == first and calls == []  # memo hit: no probe
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # inductor would pick another ISA
    assert toolchain_for_key("cpu")["cpu_isa"] == "probed" and calls == [1]
