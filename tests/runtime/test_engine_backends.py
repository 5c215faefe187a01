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
    def load(cls, engine_dir, manifest):
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


def test_cpu_is_registered():
    assert backends.ENGINE_BACKENDS["cpu"] is CpuBackend and CpuBackend.target == "cpu"


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
    write_engine(tmp_path / "engine", "tensorrt")
    for load in (verify_engine, Engine.load):
        with pytest.raises(EngineError, match=r"build.target is 'tensorrt'.*no 'tensorrt' backend.*rebuild the engine for one of cpu"):
            load(tmp_path / "engine")
