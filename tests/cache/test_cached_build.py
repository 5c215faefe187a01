"""``kilnlm build --cache``: a miss builds and publishes, a hit fetches and verifies without building."""

from __future__ import annotations

import kilnlm.builder.cached_build as cached_build
from kilnlm.cli.main import main
from kilnlm.runtime.engine import Engine, verify_engine
from kilnlm.runtime.distribution.cache import EngineCache
from kilnlm.runtime.manifest import read_manifest


def _limits_args(build) -> list[str]:
    return ["--max-batch-size", str(build.max_batch_size), "--max-seq-len", str(build.max_seq_len),
            "--max-num-tokens", str(build.max_num_tokens), "--tokens-per-block", str(build.tokens_per_block)]


def _forbid_building(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("built an engine although the cache holds its key")

    monkeypatch.setattr(cached_build, "build_engine", fail)


def test_miss_builds_and_publishes_then_hit_fetches(tiny_llama_dir, s3_server, tmp_path, capsys, monkeypatch):
    url = s3_server.make_bucket() + "/ci"
    argv = ["build", "--checkpoint", str(tiny_llama_dir), "--cache", url, "--name", "tiny",
            "--max-batch-size", "4", "--max-seq-len", "128", "--max-num-tokens", "128", "--tokens-per-block", "16"]
    assert main([*argv, "--output", str(tmp_path / "first")]) == 0
    out = capsys.readouterr().out
    built = read_manifest(tmp_path / "first")
    key = built.cache_key
    assert f"cache miss {key}" in out and f"published {key}" in out and "tagged tiny:1" in out
    assert built.cache_key_inputs["build"]["max_seq_len"] == 128

    _forbid_building(monkeypatch)
    assert main([*argv, "--output", str(tmp_path / "second")]) == 0
    out = capsys.readouterr().out
    assert f"cache hit {key}" in out and "tagged tiny:1" in out  # the same version, not a new one
    fetched = verify_engine(tmp_path / "second")
    assert fetched.files == built.files and fetched.cache_key == key
    assert EngineCache(url).lookup(key).names == ["tiny:1"]
    engine = Engine.load(tmp_path / "second")
    assert engine.manifest.build.max_seq_len == 128

    (tmp_path / "third").mkdir()
    (tmp_path / "third" / "keep.txt").write_text("user data")
    assert main([*argv, "--output", str(tmp_path / "third")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "third" / "keep.txt").read_text() == "user data"


def test_engine_built_without_cache_is_a_hit_once_pushed(tiny_llama_dir, tiny_engine_dir, tmp_path, capsys, monkeypatch):
    """The key an API build records equals the key the CLI computes for the same options."""
    cache = str(tmp_path / "cache")
    assert main(["cache", "push", str(tiny_engine_dir), "--cache", cache]) == 0
    _forbid_building(monkeypatch)
    build = read_manifest(tiny_engine_dir).build
    argv = ["build", "--checkpoint", str(tiny_llama_dir), "--output", str(tmp_path / "out"), "--cache", cache,
            "--qformat", build.qformat, *_limits_args(build)]
    assert main(argv) == 0
    assert f"cache hit {read_manifest(tiny_engine_dir).cache_key}" in capsys.readouterr().out


def test_a_hit_with_sign_key_signs_the_fetched_engine_and_the_entry(tiny_llama_dir, tiny_engine_dir, tmp_path,
                                                                    capsys, monkeypatch):
    """--sign-key on a cache hit: no build, the fetched engine is signed and so is the cache entry."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from kilnlm.runtime.signing import TrustedKeys

    key = Ed25519PrivateKey.generate()
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "trusted.pem").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    trusted = TrustedKeys.load(tmp_path / "trusted.pem")
    cache = str(tmp_path / "cache")
    assert main(["cache", "push", str(tiny_engine_dir), "--cache", cache]) == 0  # unsigned
    _forbid_building(monkeypatch)
    build = read_manifest(tiny_engine_dir).build
    assert main(["build", "--checkpoint", str(tiny_llama_dir), "--output", str(tmp_path / "out"), "--cache", cache,
                 "--qformat", build.qformat, *_limits_args(build), "--sign-key", str(tmp_path / "key.pem")]) == 0
    assert "cache hit" in capsys.readouterr().out
    verify_engine(tmp_path / "out", trusted)
    EngineCache(cache).fetch(read_manifest(tiny_engine_dir).cache_key, tmp_path / "again")
    verify_engine(tmp_path / "again", trusted)


def test_name_without_cache_is_refused(tiny_llama_dir, tmp_path, capsys):
    assert main(["build", "--checkpoint", str(tiny_llama_dir), "--output", str(tmp_path / "o"), "--name", "x"]) == 2
    assert "add --cache" in capsys.readouterr().err
