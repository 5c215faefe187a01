"""Deploy-test fixtures: the cache tests' moto S3 server (``s3_server``, loaded from tests/cache/conftest.py
so both areas start it the same way), the launcher module, and a tampered copy of the tiny engine."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


s3_server = _load("kilnlm_tests_cache_conftest", TESTS_DIR / "cache" / "conftest.py").s3_server
_serving = _load("kilnlm_tests_serving_conftest", TESTS_DIR / "serving" / "conftest.py")
launcher = _serving.launcher


@pytest.fixture
def tampered_engine(tiny_engine_dir, tmp_path) -> Path:
    """A copy of the tiny engine with one byte of its compiled package flipped."""
    engine = tmp_path / "tampered"
    shutil.copytree(tiny_engine_dir, engine)
    package = engine / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x01
    package.write_bytes(bytes(data))
    return engine

