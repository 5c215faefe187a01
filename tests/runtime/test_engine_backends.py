"""The engine-backend registry: the manifest's build.target picks the backend that verifies and loads an
engine; an unknown target is refused before anything is loaded. CPU-only: a stand-in backend registered
for a made-up target, over an engine directory of plain files."""

from __future__ import annotations

import pytest
import torch

import kilnlm.runtime.backends as backends
from factories import build_config, make_engine_inputs, make_manifest
from kilnlm.runtime.abi import kv_cache_shape
from kilnlm.runtime.backends.cpu import CpuBackend
from kilnlm.runtime.engine import Engine, verify_engine
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import write_manifest


class StandInBackend:
    """Target "stand-in": zeros logits; records what the engine asked of it."""

    target = "stand-in"
    verified: list = []

    def __init__(self, manifest):
        self.manifest = manifest
        self.kv_cache_dtype = torch.float32
        self.num_forwards = 0

    @classmethod
    def verify(cls, engine_dir, manifest):
        cls.verified.append(engine_dir)

    @classmethod
    def load(cls, engine_dir, manifest, rank=0, while_loading=None):
        return cls(manifest)

    def kv_cache_bytes_per_block(self) -> int:
        return 123

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        m, b = self.manifest.model, self.manifest.build
        return torch.zeros(kv_cache_shape(m.num_layers, num_blocks, b.tokens_per_block, m.num_kv_heads, m.head_dim))

    def forward(self, inputs, kv_cache):
        self.num_forwards += 1
        return torch.zeros(inputs.num_logits, self.manifest.model.vocab_size)


def write_engine(engine_dir, target: str):
    engine_dir.mkdir()
    (engine_dir / "model.pt2").write_bytes(b"not a package")
    return write_manifest(engine_dir, make_manifest(build_config(target=target)))


def test_cpu_and_tensorrt_are_registered():
    from kilnlm.runtime.backends.tensorrt import TensorRTBackend

    assert backends.ENGINE_BACKENDS["cpu"] is CpuBackend and CpuBackend.target == "cpu"
    assert backends.ENGINE_BACKENDS["tensorrt"] is TensorRTBackend and TensorRTBackend.target == "tensorrt"


def test_the_manifest_target_selects_the_backend(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.ENGINE_BACKENDS, "stand-in", StandInBackend)
    write_engine(tmp_path / "engine", "stand-in")
    engine = Engine.load(tmp_path / "engine")
    assert isinstance(engine.backend, StandInBackend) and StandInBackend.verified[-1] == tmp_path / "engine"
    assert engine.kv_cache_bytes_per_block() == 123
    build = engine.manifest.build
    kv_cache = engine.allocate_kv_cache(2)
    logits = engine.forward(make_engine_inputs([([1, 2, 3], 0)], build.tokens_per_block, build.max_blocks_per_seq), kv_cache)
    assert logits.shape == (1, engine.manifest.model.vocab_size) and engine.backend.num_forwards == 1
    with pytest.raises(EngineError, match="max_num_tokens"):  # the build limits are checked for every target
        engine.forward(make_engine_inputs([(list(range(build.max_num_tokens + 1)), 0)], build.tokens_per_block,
                                          build.max_blocks_per_seq), kv_cache)


def test_an_unknown_target_is_refused_before_loading(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a backend was asked to verify or load an engine of an unknown target")

    monkeypatch.setattr(CpuBackend, "verify", refuse)
    monkeypatch.setattr(CpuBackend, "load", refuse)
    write_engine(tmp_path / "engine", "made-up")
    for load in (verify_engine, Engine.load):
        with pytest.raises(EngineError, match=r"build.target is 'made-up'.*no 'made-up' backend.*rebuild the engine for one of cpu, tensorrt"):
            load(tmp_path / "engine")


def test_extract_package_matches_zipfile(tmp_path):
    """extract_package copies stored members with sendfile from their bytes inside the zip (after a local
    header whose extra field zip64 may fill) and leaves compressed or oddly named members to zipfile: the
    files it writes are zipfile's, byte for byte."""
    import zipfile

    from kilnlm.runtime.backends.cpu import extract_package

    package = tmp_path / "model.pt2"
    members = {"model/data/aotinductor/model/wrapper.so": torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes(),
               "model/archive_format": b"pt2", "model/.data/version": b"1\n", "model/empty": b""}
    with zipfile.ZipFile(package, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("model/compressed.json", b'{"a": 1}' * 1000, compress_type=zipfile.ZIP_DEFLATED)
        with archive.open("model/zip64.bin", "w", force_zip64=True) as member:  # a zip64 extra field
            member.write(b"x" * 5000)
        archive.mkdir("model/folder")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    extract_package(package, ours)
    with zipfile.ZipFile(package) as archive:
        archive.extractall(theirs)
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*"))
    assert files == sorted(p.relative_to(ours) for p in ours.rglob("*"))
    assert len(files) == 12  # 7 files, 5 folders
    for rel in files:
        assert (ours / rel).is_dir() == (theirs / rel).is_dir()
        if (theirs / rel).is_file():
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel


def test_extract_package_refuses_a_member_whose_local_header_is_missing(tmp_path):
    """The zip's directory points at a member's local header; bytes that are not one are a corrupt zip."""
    import zipfile

    from kilnlm.runtime.backends.cpu import extract_package

    package = tmp_path / "model.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("model/wrapper.so", b"w" * 100_000)
    raw = bytearray(package.read_bytes())
    assert raw[:4] == b"PK\x03\x04"
    raw[:4] = b"XXXX"
    package.write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile, match="no local header for 'model/wrapper.so'"):
        extract_package(package, tmp_path / "out")
