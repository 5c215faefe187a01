"""Signed engines: an Ed25519 signature over an engine's ``manifest.json``, checked against trusted keys
before anything in the engine is read.

The manifest records the size and SHA-256 of every other file of the engine, and
:func:`kilnlm.runtime.manifest.verify_files` refuses a file that differs or that the manifest does not list,
so one signature over the manifest's exact bytes covers the whole directory: the compiled engine (native
code), its weights, tokenizer and configuration. The signature sits beside the manifest as
``manifest.sig`` (JSON)::

    {"format_version": 1, "algorithm": "ed25519", "key_id": "<SHA-256 of the raw 32-byte public key>",
     "signature": "<base64 of the 64-byte Ed25519 signature of manifest.json's bytes>"}

Keys (the ``cryptography`` library's Ed25519, RFC 8032):

- signing key: an Ed25519 private key, PEM PKCS#8 (``openssl genpkey -algorithm ed25519 -out key.pem``) or
  OpenSSH (``ssh-keygen -t ed25519``), unencrypted;
- trusted keys: a file of one or more Ed25519 public keys, PEM SubjectPublicKeyInfo blocks (``openssl pkey
  -in key.pem -pubout``) and/or OpenSSH ``ssh-ed25519 AAAA...`` lines, or a directory of such files.
  ``$KILNLM_TRUSTED_KEYS`` names the default for every process that loads engines (the CLI's
  ``--trusted-keys``, the Triton model's ``trusted_keys`` parameter and :func:`resolve_trusted_keys` take
  precedence). Without trusted keys, signatures are not checked and unsigned engines load. A
  ``trusted_keys`` parameter takes a :class:`TrustedKeys`, None (no check) or :data:`FROM_ENVIRONMENT`.

Never imports kilnlm.builder (serving-only installs run this).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

from kilnlm.runtime.errors import EngineError, KilnError
from kilnlm.runtime.manifest import MANIFEST_NAME, SIGNATURE_NAME

SIGNATURE_FORMAT_VERSION = 1
SIGNATURE_ALGORITHM = "ed25519"
TRUSTED_KEYS_ENV = "KILNLM_TRUSTED_KEYS"
MAX_SIGNATURE_BYTES = 4096  # a signature file is ~250 bytes; anything larger is refused unread
MAX_KEY_FILE_BYTES = 1 << 20
# The default of every ``trusted_keys`` parameter: the keys $KILNLM_TRUSTED_KEYS names, if it is set.
FROM_ENVIRONMENT = "$" + TRUSTED_KEYS_ENV
_PEM_PUBLIC_RE = re.compile(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.S)
_SSH_ED25519_RE = re.compile(rb"^\s*(ssh-ed25519\s+[A-Za-z0-9+/=]+)", re.M)


class SigningKeyError(KilnError):
    """A signing key or trusted-keys file that cannot be used: missing, unreadable, encrypted, or not
    Ed25519. The message names the file."""


def key_id(public_key) -> str:
    """The id of an Ed25519 public key: the hex SHA-256 of its raw 32 bytes (what ``manifest.sig``
    records and the error messages name)."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _read_key_file(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise SigningKeyError(f"{what} {path} does not exist or is not a file")
    if path.stat().st_size > MAX_KEY_FILE_BYTES:
        raise SigningKeyError(f"{what} {path} is {path.stat().st_size:,} bytes: not a key file")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"{what} {path} cannot be read ({exc.strerror})") from None


def load_signing_key(path: str | os.PathLike):
    """The Ed25519 private key in ``path`` (PEM PKCS#8 or OpenSSH, unencrypted). Raises
    :class:`SigningKeyError` naming the file when it is missing, encrypted or not an Ed25519 private key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    data = _read_key_file(path, "--sign-key")
    loader = (serialization.load_ssh_private_key if b"BEGIN OPENSSH PRIVATE KEY" in data
              else serialization.load_pem_private_key)
    try:
        key = loader(data, password=None)
    except TypeError:
        raise SigningKeyError(f"--sign-key {path} is encrypted: give an unencrypted Ed25519 key (keep it in a "
                              "secret store that the build reads)") from None
    except (ValueError, binascii.Error) as exc:
        raise SigningKeyError(f"--sign-key {path} is not a PEM or OpenSSH private key ({exc}): create one with "
                              "`openssl genpkey -algorithm ed25519 -out key.pem`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"--sign-key {path} is a {type(key).__name__}, not an Ed25519 key: create one with "
                              "`openssl genpkey -algorithm ed25519 -out key.pem`")
    return key


@dataclasses.dataclass(frozen=True)
class TrustedKeys:
    """Ed25519 public keys by :func:`key_id`, and where they were read from (for error messages)."""

    keys: dict
    source: str

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrustedKeys":
        """The public keys in the file ``path`` (PEM blocks and/or ``ssh-ed25519`` lines), or in every file
        of the directory ``path``. Raises :class:`SigningKeyError` naming the file when a block is not an
        Ed25519 public key, or when no key is found at all."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        path = Path(path)
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        keys = {}
        for file in files:
            data = _read_key_file(file, "trusted keys file")
            blocks = [(serialization.load_pem_public_key, m.group(0)) for m in _PEM_PUBLIC_RE.finditer(data)]
            blocks += [(serialization.load_ssh_public_key, m.group(1)) for m in _SSH_ED25519_RE.finditer(data)]
            for loader, block in blocks:
                try:
                    key = loader(block)
                except (ValueError, binascii.Error) as exc:
                    raise SigningKeyError(f"trusted keys file {file}: a public key does not parse ({exc})") from None
                if not isinstance(key, Ed25519PublicKey):
                    raise SigningKeyError(f"trusted keys file {file} holds a {type(key).__name__}: only Ed25519 "
                                          "public keys are accepted")
                keys[key_id(key)] = key
        if not keys:
            raise SigningKeyError(f"trusted keys {path} hold no Ed25519 public key (PEM 'BEGIN PUBLIC KEY' blocks or "
                                  "'ssh-ed25519 ...' lines): a policy that trusts no key would refuse every engine")
        return cls(keys, str(path))


def resolve_trusted_keys(path: str | os.PathLike | None = None, environ=None) -> TrustedKeys | None:
    """The trusted keys at ``path`` (a path, or :data:`FROM_ENVIRONMENT`), else at ``$KILNLM_TRUSTED_KEYS``,
    else None (signatures not checked). Raises :class:`SigningKeyError` for keys that cannot be used."""
    env = os.environ if environ is None else environ
    if path in (None, "", FROM_ENVIRONMENT):
        path = env.get(TRUSTED_KEYS_ENV) or None
    return None if path is None else TrustedKeys.load(path)


def trusted_keys_of(trusted_keys) -> TrustedKeys | None:
    """A ``trusted_keys`` parameter's keys: as given (a :class:`TrustedKeys` or None), or
    :func:`resolve_trusted_keys` for :data:`FROM_ENVIRONMENT`."""
    return resolve_trusted_keys() if isinstance(trusted_keys, str) and trusted_keys == FROM_ENVIRONMENT else trusted_keys


def sign_manifest_bytes(manifest_bytes: bytes, private_key) -> bytes:
    """The ``manifest.sig`` document (UTF-8 JSON) signing ``manifest_bytes`` with ``private_key``."""
    doc = {"format_version": SIGNATURE_FORMAT_VERSION, "algorithm": SIGNATURE_ALGORITHM,
           "key_id": key_id(private_key.public_key()),
           "signature": base64.b64encode(private_key.sign(manifest_bytes)).decode("ascii")}
    return (json.dumps(doc, indent=1) + "\n").encode()


def sign_engine(engine_dir: str | os.PathLike, private_key) -> str:
    """Write ``engine_dir/manifest.sig`` for the engine's current ``manifest.json`` (replacing an earlier
    signature; the file appears whole or not at all). Returns the signing key's id."""
    root = Path(engine_dir)
    document = sign_manifest_bytes((root / MANIFEST_NAME).read_bytes(), private_key)
    tmp = root / (SIGNATURE_NAME + ".tmp")
    tmp.write_bytes(document)
    os.replace(tmp, root / SIGNATURE_NAME)
    return key_id(private_key.public_key())


def check_signature(manifest_bytes: bytes, signature_bytes: bytes | None, trusted: TrustedKeys, where: str) -> str:
    """Check that ``signature_bytes`` (a ``manifest.sig`` document, None when there is none) signs
    ``manifest_bytes`` with one of ``trusted``'s keys. Returns the key id. Raises :class:`EngineError`
    naming ``where`` (the signature file) for a missing, malformed, untrusted or non-matching signature."""
    from cryptography.exceptions import InvalidSignature

    if signature_bytes is None:
        raise EngineError(f"{where} is missing: the engine is unsigned and trusted keys ({trusted.source}) are "
                          "required; sign it (`kilnlm build --sign-key`, `kilnlm cache push --sign-key`) or load it "
                          "without trusted keys")
    if len(signature_bytes) > MAX_SIGNATURE_BYTES:
        raise EngineError(f"{where} is {len(signature_bytes):,} bytes, not a signature: the engine is refused")
    try:
        doc = json.loads(signature_bytes)
        if (doc["format_version"], doc["algorithm"]) != (SIGNATURE_FORMAT_VERSION, SIGNATURE_ALGORITHM):
            raise ValueError(f"format {doc['format_version']!r} / algorithm {doc['algorithm']!r}")
        signer, signature = str(doc["key_id"]), base64.b64decode(doc["signature"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise EngineError(f"{where} is not a kilnlm Ed25519 signature ({exc!r}): the engine is refused") from None
    if signer not in trusted.keys:
        raise EngineError(f"{where}: the engine is signed by key {signer[:16]}..., which is not among the trusted keys "
                          f"({trusted.source}): the engine is refused")
    try:
        trusted.keys[signer].verify(signature, manifest_bytes)
    except InvalidSignature:
        raise EngineError(f"{where} does not match the engine's manifest: the manifest was modified after signing "
                          "(or the signature was copied from another engine); the engine is refused") from None
    return signer


def read_signature(engine_dir: str | os.PathLike) -> bytes | None:
    """The bytes of ``engine_dir/manifest.sig`` (at most :data:`MAX_SIGNATURE_BYTES` + 1 of them, so an
    oversized file is refused unread), or None when there is no such regular file."""
    path = Path(engine_dir) / SIGNATURE_NAME
    if not path.is_file() or path.is_symlink():
        return None
    with open(path, "rb") as f:
        return f.read(MAX_SIGNATURE_BYTES + 1)


__all__ = ["FROM_ENVIRONMENT", "MAX_SIGNATURE_BYTES", "SIGNATURE_NAME", "SigningKeyError", "TRUSTED_KEYS_ENV", "TrustedKeys",
           "check_signature", "key_id", "load_signing_key", "read_signature", "resolve_trusted_keys",
           "sign_engine", "sign_manifest_bytes", "trusted_keys_of"]
