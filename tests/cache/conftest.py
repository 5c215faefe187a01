"""Fixtures of the engine-cache tests: an empty cache, local or in the session's S3 server (``s3_server``,
tests/conftest.py), and fake engines to publish into it."""

from __future__ import annotations

import pytest


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
