"""Fixtures of the engine-cache tests (and of the deploy tests that reuse them).

``s3_server``: a real S3-protocol server (moto in server mode) on a free loopback port for the whole
session, with the standard AWS environment variables pointing at it (``AWS_ENDPOINT_URL``, dummy
credentials, region), so s3fs -- and any subprocess (the ``kilnlm`` CLI, tritonserver) -- talks to it.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

import pytest


@dataclass
class S3Server:
    """A running moto S3 server. ``endpoint_url``: ``http://127.0.0.1:<port>``."""

    endpoint_url: str

    def client(self):
        """A boto3 S3 client for the server (to inspect or tamper with objects in tests)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket (a unique name unless ``name``) and return ``s3://<bucket>``."""
        name = name or f"kilnlm-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs", reason="s3:// caches need s3fs (pip install 'kilnlm[s3]')")
    server_mod = pytest.importorskip("moto.server", reason="the S3 test server needs moto[server]")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        try:
            yield S3Server(endpoint_url=env["AWS_ENDPOINT_URL"])
        finally:
            server.stop()


@pytest.fixture(params=["local", "s3"])
def cache_url(request, tmp_path) -> str:
    """An empty engine cache: a local directory, or a prefix in a fresh bucket of the moto S3 server."""
    if request.param == "local":
        return str(tmp_path / "cache")
    return request.getfixturevalue("s3_server").make_bucket() + "/team/engines"


def write_fake_engine(out_dir, key: str, payload: bytes, model_bytes: int = 1 << 16):
    """A small engine directory the cache treats like a real one (the cache never loads engines):
    ``model.pt2`` (``payload`` followed by ``model_bytes`` seeded random bytes), ``tokenizer/tokenizer.json``
    and a manifest with ``cache_key`` = ``key`` written by :func:`kilnlm.runtime.manifest.write_manifest`."""
    import random
    from pathlib import Path

    from kilnlm.runtime.manifest import BuildConfig, GenerationDefaults, Manifest, ModelConfig, write_manifest

    out = Path(out_dir)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer" / "tokenizer.json").write_text('{"model": "fake"}\n')
    rng = random.Random(payload)
    (out / "model.pt2").write_bytes(payload + rng.randbytes(model_bytes))
    manifest = Manifest(
        model=ModelConfig(architecture="LlamaForCausalLM", num_layers=2, hidden_size=64, intermediate_size=128,
                          num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=512,
                          rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
        build=BuildConfig(qformat="fp32", dtype="float32", kv_cache_dtype="float32", max_batch_size=8, max_num_tokens=256,
                          max_seq_len=256, tokens_per_block=16, target="cpu"),
        generation=GenerationDefaults(eos_token_ids=[2]), plugins={"paged_attention": 1},
        toolchain={"torch": "test"}, source_checkpoint_digest="sha256:" + "0" * 64, cache_key=key,
        cache_key_inputs={"test": payload.hex()},
    )
    write_manifest(out, manifest)
    return out


@pytest.fixture
def fake_engine(tmp_path):
    """``fake_engine(name, key, payload=b"a", model_bytes=65536)`` -> a fake engine directory under tmp_path
    (see :func:`write_fake_engine`)."""

    def make(name: str, key: str, payload: bytes = b"a", model_bytes: int = 1 << 16):
        return write_fake_engine(tmp_path / name, key, payload, model_bytes)

    return make
