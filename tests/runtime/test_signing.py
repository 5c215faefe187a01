"""Signed engines (kilnlm.runtime.signing): an Ed25519 signature of the manifest, checked against trusted
keys before anything in the engine is read -- by the runtime, `kilnlm build --sign-key`, the engine cache,
`kilnlm deploy`, the served model's parameter and the CLI's --trusted-keys. Real keys (cryptography), the
tiny compiled engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kilnlm.cli.main import main as kilnlm_main
from kilnlm.runtime.engine import Engine, verify_engine
from kilnlm.runtime.errors import CacheError, EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, SIGNATURE_NAME, read_manifest
from kilnlm.runtime.signing import (MAX_SIGNATURE_BYTES, TRUSTED_KEYS_ENV, SigningKeyError, TrustedKeys, key_id,
                                    load_signing_key, resolve_trusted_keys, sign_engine)


def write_private_key(path: Path, key=None, openssh: bool = False) -> Path:
    key = key or Ed25519PrivateKey.generate()
    fmt = serialization.PrivateFormat.OpenSSH if openssh else serialization.PrivateFormat.PKCS8
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    return path


def public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture
def keys(tmp_path):
    """Two signing keys (``ours``, ``theirs``) and a trusted-keys file holding only ``ours``'s public key."""
    ours, theirs = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trusted = tmp_path / "trusted.pem"
    trusted.write_bytes(public_pem(ours))
    return ours, theirs, TrustedKeys.load(trusted), trusted


@pytest.fixture
def engine(tiny_engine_dir, tmp_path) -> Path:
    """A copy of the tiny compiled engine, unsigned."""
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, copy)
    assert not (copy / SIGNATURE_NAME).exists()
    return copy


def test_a_signed_engine_loads_with_its_key_and_the_signature_covers_every_file(engine, keys):
    ours, _, trusted, _ = keys
    assert sign_engine(engine, ours) == key_id(ours.public_key())
    manifest = verify_engine(engine, trusted)
    assert SIGNATURE_NAME not in manifest.files  # beside the manifest, not listed in it
    assert Engine.load(engine, trusted).manifest.cache_key == manifest.cache_key
    verify_engine(engine, None)  # without trusted keys the signature is not needed, and does not disturb

    package = engine / manifest.engine_file  # the compiled code: pinned by the signed manifest's SHA-256
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x01
    package.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"model\.pt2 does not match its SHA-256"):
        Engine.load(engine, trusted)


def test_unsigned_or_foreign_or_altered_engines_are_refused_before_the_manifest_is_read(engine, keys):
    ours, theirs, trusted, _ = keys
    with pytest.raises(EngineError, match=r"manifest\.sig is missing: the engine is unsigned"):
        verify_engine(engine, trusted)
    sign_engine(engine, theirs)
    with pytest.raises(EngineError, match=rf"signed by key {key_id(theirs.public_key())[:16]}\.\.\., which is not among"):
        Engine.load(engine, trusted)

    sign_engine(engine, ours)
    manifest_path = engine / MANIFEST_NAME
    data = json.loads(manifest_path.read_bytes())
    data["build"]["max_batch_size"] = 64  # a limit raised after signing
    manifest_path.write_text(json.dumps(data))
    with pytest.raises(EngineError, match="does not match the engine's manifest"):
        verify_engine(engine, trusted)
    manifest_path.write_text("not json")  # the signature is checked first, on the bytes: no parse error
    with pytest.raises(EngineError, match="does not match the engine's manifest"):
        verify_engine(engine, trusted)


@pytest.mark.parametrize("signature", [b"", b"{}", b"not json", json.dumps({
    "format_version": 1, "algorithm": "rsa", "key_id": "x", "signature": ""}).encode(),
    json.dumps({"format_version": 1, "algorithm": "ed25519", "key_id": "x", "signature": "%%%"}).encode(),
    b" " * (MAX_SIGNATURE_BYTES + 1)], ids=["empty", "no-fields", "not-json", "other-algorithm", "bad-base64", "oversized"])
def test_malformed_signatures_are_refused(engine, keys, signature):
    (engine / SIGNATURE_NAME).write_bytes(signature)
    with pytest.raises(EngineError, match=r"manifest\.sig .*(not a kilnlm Ed25519 signature|not a signature)"):
        verify_engine(engine, keys[2])


def test_a_signature_symlinked_in_is_not_followed(engine, keys, tmp_path):
    ours, _, trusted, _ = keys
    sign_engine(engine, ours)
    outside = tmp_path / "elsewhere.sig"
    (engine / SIGNATURE_NAME).rename(outside)
    (engine / SIGNATURE_NAME).symlink_to(outside)
    with pytest.raises(EngineError, match="is missing: the engine is unsigned"):
        verify_engine(engine, trusted)


def test_the_environment_sets_the_default_policy(engine, keys, monkeypatch):
    ours, _, trusted, trusted_file = keys
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(trusted_file))
    with pytest.raises(EngineError, match="unsigned"):
        verify_engine(engine)
    verify_engine(engine, None)  # an explicit None: no check (the builder's smoke test of its own output)
    sign_engine(engine, ours)
    verify_engine(engine)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, str(engine / "no-such-keys.pem"))
    with pytest.raises(SigningKeyError, match="no-such-keys.pem does not exist"):
        verify_engine(engine)


def test_trusted_keys_files_and_directories(tmp_path):
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ssh_line = b.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    both = tmp_path / "both.pem"
    both.write_bytes(b"# release keys\n" + public_pem(a) + ssh_line + b" ci@example\n")
    assert set(TrustedKeys.load(both).keys) == {key_id(a.public_key()), key_id(b.public_key())}
    directory = tmp_path / "keys.d"
    directory.mkdir()
    (directory / "a.pem").write_bytes(public_pem(a))
    (directory / "b.pub").write_bytes(ssh_line + b"\n")
    assert set(TrustedKeys.load(directory).keys) == set(TrustedKeys.load(both).keys)
    assert resolve_trusted_keys(None, environ={}) is None
    assert set(resolve_trusted_keys(None, environ={TRUSTED_KEYS_ENV: str(directory)}).keys) == set(TrustedKeys.load(both).keys)

    ec_pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "ec.pem").write_bytes(ec_pem)
    with pytest.raises(SigningKeyError, match="only Ed25519 public keys"):
        TrustedKeys.load(tmp_path / "ec.pem")
    (tmp_path / "empty.pem").write_text("# nothing here\n")
    with pytest.raises(SigningKeyError, match="hold no Ed25519 public key"):
        TrustedKeys.load(tmp_path / "empty.pem")


def test_signing_keys_pem_openssh_and_refusals(tmp_path):
    key = Ed25519PrivateKey.generate()
    for openssh in (False, True):
        loaded = load_signing_key(write_private_key(tmp_path / f"k{openssh}", key, openssh))
        assert key_id(loaded.public_key()) == key_id(key.public_key())
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(SigningKeyError, match="is encrypted"):
        load_signing_key(encrypted)
    ec_key = tmp_path / "ec.pem"
    ec_key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(SigningKeyError, match="not an Ed25519 key"):
        load_signing_key(ec_key)
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(SigningKeyError, match="not a PEM or OpenSSH private key"):
        load_signing_key(tmp_path / "junk.pem")
    with pytest.raises(SigningKeyError, match="does not exist"):
        load_signing_key(tmp_path / "missing.pem")


def test_build_signs_the_engine_and_an_unusable_key_fails_before_building(tiny_llama_dir, keys, tmp_path):
    from kilnlm.builder.cache_key import compute_cache_key
    from kilnlm.builder.config import BuildOptions, resolve

    ours, _, trusted, _ = keys
    limits = dict(max_batch_size=2, max_seq_len=64, max_num_tokens=64, tokens_per_block=16)
    out = tmp_path / "signed"
    args = ["build", "--checkpoint", str(tiny_llama_dir), "--output", str(out), "--quiet",
            "--sign-key", str(write_private_key(tmp_path / "key.pem", ours)),
            *[f"--{k.replace('_', '-')}={v}" for k, v in limits.items()]]
    assert kilnlm_main(args) == 0
    assert verify_engine(out, trusted).cache_key == read_manifest(out).cache_key
    unsigned = resolve(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "x", **limits))
    assert compute_cache_key(unsigned).key == read_manifest(out).cache_key  # the key is not part of the engine

    (tmp_path / "bad.pem").write_text("not a key")
    bad = [a if a != str(tmp_path / "key.pem") else str(tmp_path / "bad.pem") for a in args]
    bad[bad.index("--output") + 1] = str(tmp_path / "never")
    assert kilnlm_main(bad) == 2
    assert not (tmp_path / "never").exists()


def test_the_cache_keeps_signatures_and_push_signs(engine, keys, tmp_path):
    from kilnlm.runtime.distribution.cache import EngineCache

    ours, theirs, trusted, _ = keys
    cache = EngineCache(str(tmp_path / "cache"))
    cache.publish(engine, "tiny")  # unsigned
    cache.fetch("tiny", tmp_path / "plain")
    with pytest.raises(EngineError, match="unsigned"):
        verify_engine(tmp_path / "plain", trusted)

    assert kilnlm_main(["cache", "push", str(engine), "--cache", str(tmp_path / "cache"),
                        "--sign-key", str(write_private_key(tmp_path / "key.pem", ours))]) == 0
    assert not (engine / SIGNATURE_NAME).exists()  # push signs the entry, not the directory it read
    cache.fetch("tiny", tmp_path / "signed")
    verify_engine(tmp_path / "signed", trusted)
    assert cache.gc(min_age_s=0) == []  # the signature is part of the entry, not a leftover
    cache.fetch("tiny", tmp_path / "again")
    verify_engine(tmp_path / "again", trusted)

    sign_engine(engine, theirs)  # an engine directory's own signature travels with publish
    cache.publish(engine)
    cache.fetch("tiny", tmp_path / "theirs")
    with pytest.raises(EngineError, match="not among the trusted keys"):
        verify_engine(tmp_path / "theirs", trusted)

    other = tmp_path / "other"  # another build of the same key: push --sign-key does not vouch for it
    shutil.copytree(engine, other)
    (other / SIGNATURE_NAME).unlink()
    manifest = json.loads((other / MANIFEST_NAME).read_bytes())
    manifest["toolchain"]["note"] = "rebuilt"
    (other / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="holds another build of this engine"):
        cache.publish(other, signing_key=ours)


def test_deploy_and_the_served_model_refuse_untrusted_engines(engine, keys, tmp_path):
    from kilnlm.runtime.distribution.deploy import DeployConfig, DeployError, deploy
    from kilnlm.runtime.distribution.engine_source import served_trusted_keys
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    ours, _, trusted, trusted_file = keys
    repo = tmp_path / "repo"
    with pytest.raises(DeployError, match="refusing to deploy .*unsigned"):
        deploy(DeployConfig(ref=str(engine), model_repository=repo, trusted_keys=trusted))
    assert not repo.exists()
    assert kilnlm_main(["deploy", str(engine), "--model-repository", str(repo),
                        "--trusted-keys", str(trusted_file)]) == 2
    sign_engine(engine, ours)
    assert kilnlm_main(["deploy", str(engine), "--model-repository", str(repo),
                        "--trusted-keys", str(trusted_file)]) == 0

    model_dir = repo / "tensorrt_llm"  # what model_repository/tensorrt_llm/1/model.py does with its parameter
    shutil.copy(trusted_file, model_dir / "trusted.pem")
    relative = served_trusted_keys(model_dir, {"trusted_keys": "trusted.pem"}, environ={})
    assert set(relative.keys) == set(trusted.keys)
    assert served_trusted_keys(model_dir, {"trusted_keys": ""}, environ={}) is None
    executor = Executor.from_engine_dir(model_dir / "1" / "engine", ExecutorConfig(max_batch_size=1), relative)
    executor.shutdown()
    (model_dir / "1" / "engine" / SIGNATURE_NAME).unlink()
    with pytest.raises(EngineError, match="unsigned"):
        Executor.from_engine_dir(model_dir / "1" / "engine", ExecutorConfig(max_batch_size=1), relative)


def test_a_draft_engine_loads_under_the_target_s_trust_policy(engine, keys, tiny_engine_dir):
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    ours, _, trusted, _ = keys
    sign_engine(engine, ours)

    def speculative(draft) -> ExecutorConfig:
        return ExecutorConfig(max_batch_size=1, speculative_config=json.dumps(
            {"method": "draft", "num_speculative_tokens": 2, "model": str(draft)}))

    with pytest.raises(EngineError, match="speculative_config's draft model: .*unsigned"):
        Executor.from_engine_dir(engine, speculative(tiny_engine_dir), trusted)
    Executor.from_engine_dir(engine, speculative(engine), trusted).shutdown()  # a signed draft loads
    Executor.from_engine_dir(engine, speculative(tiny_engine_dir), None).shutdown()  # no policy: no signature needed


def test_cli_trusted_keys_refuse_in_one_line(engine, keys, capsys):
    _, _, _, trusted_file = keys
    assert kilnlm_main(["generate", "hi", "--engine", str(engine), "--max-tokens", "1",
                        "--trusted-keys", str(trusted_file)]) == 2
    err = capsys.readouterr().err
    assert "manifest.sig is missing: the engine is unsigned" in err and err.count("\n") == 1
    assert kilnlm_main(["eval", "--engine", str(engine), "--text", str(trusted_file),
                        "--trusted-keys", str(trusted_file)]) == 2
    assert "unsigned" in capsys.readouterr().err
