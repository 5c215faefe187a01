"""The runtime refuses a tampered or incompatible engine *before* loading any of it."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch

import kilnlm.runtime.backends.cpu as cpu_backend
import kilnlm.runtime.manifest as manifest_module
from kilnlm.runtime.engine import Engine, verify_engine
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import prehash_engine_files


@pytest.fixture
def engine_copy(tiny_engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, dst)
    return dst


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load the compiled package."""

    def refuse(*args, **kwargs):
        raise AssertionError("the engine package was loaded before verification refused it")

    monkeypatch.setattr(cpu_backend, "load_package", refuse)


def edit_manifest(engine_dir, edit) -> None:
    path = engine_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def assert_refused(engine_dir, *fragments: str) -> None:
    with pytest.raises(EngineError) as info:
        Engine.load(engine_dir)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_intact_engine_verifies(tiny_engine_dir):
    manifest = verify_engine(tiny_engine_dir)
    assert manifest.build.target == "cpu" and "model.pt2" in manifest.files


def test_flipped_byte(engine_copy, no_loading):
    package = engine_copy / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x01
    package.write_bytes(bytes(data))
    assert_refused(engine_copy, "model.pt2", "SHA-256")


def test_unknown_format_version(engine_copy, no_loading):
    edit_manifest(engine_copy, lambda d: d.update(format_version=99))
    assert_refused(engine_copy, "manifest.json", "format version 99")


def test_missing_file(engine_copy, no_loading):
    (engine_copy / "tokenizer" / "tokenizer.json").unlink()
    assert_refused(engine_copy, "tokenizer.json", "missing")


def test_extra_file(engine_copy, no_loading):
    (engine_copy / "tokenizer" / "evil.so").write_bytes(b"\x7fELF")
    assert_refused(engine_copy, "evil.so", "not listed")


def test_missing_manifest(engine_copy, no_loading):
    (engine_copy / "manifest.json").unlink()
    assert_refused(engine_copy, "manifest.json", "missing")


def test_plugin_version_mismatch(engine_copy, no_loading):
    edit_manifest(engine_copy, lambda d: d["plugins"].update(paged_attention=999))
    assert_refused(engine_copy, "manifest.json", "paged_attention", "999")


def test_unknown_plugin(engine_copy, no_loading):
    edit_manifest(engine_copy, lambda d: d["plugins"].update(int4_awq_linear=1))
    assert_refused(engine_copy, "int4_awq_linear", "not implemented")


def test_wrong_target(engine_copy, no_loading):
    edit_manifest(engine_copy, lambda d: d["build"].update(target="tensorrt"))
    assert_refused(engine_copy, "build.target", "tensorrt")


def test_foreign_cpu_isa(engine_copy, no_loading):
    edit_manifest(engine_copy, lambda d: d["toolchain"].update(cpu_isa="neon"))
    assert_refused(engine_copy, "cpu_isa", "neon")


def test_an_x86_isa_wider_than_this_cpu_is_refused(engine_copy, no_loading):
    missing = next((isa for isa in ("avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2")
                    if not cpu_backend.cpu_runs_isa(isa)), None)
    if missing is None:
        pytest.skip("this CPU runs code for every x86 ISA inductor targets, AMX included")
    edit_manifest(engine_copy, lambda d: d["toolchain"].update(cpu_isa=missing))
    assert_refused(engine_copy, "cpu_isa", missing)


def test_the_isa_check_from_cpu_probes_agrees_with_inductors_own_list():
    """verify asks torch's CPU probes (fast); inductor's list (seconds: it compiles) must say the same for
    every ISA inductor knows."""
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list

    machine = cpu_backend.machine_cpu_isas()
    for isa in {str(i) for i in supported_vec_isa_list if str(i)}:
        assert cpu_backend.cpu_runs_isa(isa) == (isa in machine), isa


@pytest.mark.parametrize("field,value", [
    ("files", "../outside"), ("files", "/etc/passwd"), ("files", "tokenizer/../../outside"), ("files", "./model.pt2"),
    ("files", "manifest.sig"), ("engine_file", "../evil.pt2"), ("sha256", "../../../etc/passwd"), ("size", -1),
], ids=["dotdot", "absolute", "nested-dotdot", "dot", "signature-name", "engine-file", "digest", "size"])
def test_manifest_paths_outside_the_directory_are_refused(engine_copy, no_loading, field, value):
    """A hostile manifest cannot make the runtime (or the cache, which writes every listed path) touch a
    path outside the engine directory: the file names, the engine file and the digests are checked when
    the manifest is parsed, before any file is opened."""
    outside = engine_copy.parent / "outside"
    outside.write_bytes(b"secret")

    def edit(data):
        if field == "files":  # listed with the outside file's true size and digest
            data["files"][value] = {"size": 6, "sha256": __import__("hashlib").sha256(b"secret").hexdigest()}
        elif field == "engine_file":
            data["engine_file"] = value
        else:
            data["files"]["model.pt2"][field] = value

    edit_manifest(engine_copy, edit)
    assert_refused(engine_copy, "manifest.json is malformed", "not a relative path inside" if field in ("files", "engine_file")
                   else "expected {'size': bytes, 'sha256': 64 hex digits}")


def test_symbolic_links_are_refused(engine_copy, no_loading, tmp_path):
    """A link inside an engine could point anywhere, and its target could change after verification."""
    tokenizer = engine_copy / "tokenizer" / "tokenizer.json"
    moved = tmp_path / "tokenizer.json"
    tokenizer.rename(moved)
    tokenizer.symlink_to(moved)  # same bytes: the digest alone would accept it
    assert_refused(engine_copy, "tokenizer.json is a symbolic link")
    tokenizer.unlink()
    moved.rename(tokenizer)
    shutil.move(engine_copy / "tokenizer", tmp_path / "tokenizer_dir")
    (engine_copy / "tokenizer").symlink_to(tmp_path / "tokenizer_dir", target_is_directory=True)
    assert_refused(engine_copy, "tokenizer is a symbolic link")


def prehash_and_wait(engine_dir) -> None:
    """prehash_engine_files, then wait for its thread to finish every digest."""
    prehash_engine_files(engine_dir)
    for thread in threading.enumerate():
        if thread.name == "kilnlm-prehash":
            thread.join(timeout=60)
            assert not thread.is_alive(), "the digests computed ahead did not finish"


def test_digests_computed_ahead_stand_in_for_reading_the_files(engine_copy, monkeypatch):
    prehash_and_wait(engine_copy)

    def refuse(path):
        raise AssertionError(f"{path} was read again although its digest was computed ahead")

    monkeypatch.setattr(manifest_module, "_sha256_now", refuse)
    verify_engine(engine_copy)
    with pytest.raises(AssertionError, match="read again"):  # each digest computed ahead stands in once
        verify_engine(engine_copy)


@pytest.mark.parametrize("change", ["written in place", "replaced"])
def test_a_file_changed_after_it_was_hashed_ahead_is_read_again(engine_copy, no_loading, change):
    """Same size and modification time: the change time (written in place) or the inode (replaced) tells."""
    prehash_and_wait(engine_copy)
    time.sleep(0.05)  # past the file system's timestamp granularity (a jiffy)
    package = engine_copy / "model.pt2"
    before = package.stat()
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x01
    if change == "replaced":
        (engine_copy / "new.pt2").write_bytes(bytes(data))
        os.replace(engine_copy / "new.pt2", package)
    else:
        package.write_bytes(bytes(data))
    os.utime(package, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert_refused(engine_copy, "model.pt2", "SHA-256")


def test_hashing_ahead_starts_nothing_for_what_is_not_an_engine_and_reads_no_special_file(engine_copy, tmp_path,
                                                                                         no_loading):
    prehash_engine_files(tmp_path / "absent")
    prehash_engine_files(tmp_path / "engine" / "tokenizer")  # a directory without a manifest
    assert not [t for t in threading.enumerate() if t.name == "kilnlm-prehash"]
    tokenizer = engine_copy / "tokenizer" / "tokenizer.json"
    tokenizer.unlink()
    os.mkfifo(tokenizer)  # opened for reading, a FIFO without a writer would block the thread for good
    prehash_and_wait(engine_copy)
    assert_refused(engine_copy, "tokenizer.json is not a regular file")


def test_oversized_or_malformed_manifest(engine_copy, no_loading):
    from kilnlm.runtime.manifest import MAX_MANIFEST_BYTES

    path = engine_copy / "manifest.json"
    original = path.read_bytes()
    path.write_bytes(original + b" " * MAX_MANIFEST_BYTES)  # still valid JSON, but no manifest is that large
    assert_refused(engine_copy, "manifest.json is", "not a kilnlm manifest")
    path.write_bytes(b"\xff\xfe not utf-8")
    assert_refused(engine_copy, "manifest.json is not valid JSON")
    edit = json.loads(original)
    edit["files"] = ["model.pt2"]
    path.write_text(json.dumps(edit))
    assert_refused(engine_copy, "manifest.json is malformed")


def test_kv_cache_allocation(tiny_engine_dir):
    engine = Engine.load(tiny_engine_dir)
    m, b = engine.manifest.model, engine.manifest.build
    kv_cache = engine.allocate_kv_cache(5)
    assert kv_cache.shape == (m.num_layers, 2, 5, b.tokens_per_block, m.num_kv_heads, m.head_dim)
    assert kv_cache.dtype == torch.float32 and not kv_cache.any()
    assert engine.kv_cache_bytes_per_block() * 5 == kv_cache.numel() * kv_cache.element_size()
    with pytest.raises(EngineError):
        engine.allocate_kv_cache(0)
