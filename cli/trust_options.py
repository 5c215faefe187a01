"""The signing options the commands share: ``--sign-key`` (build, cache push) and ``--trusted-keys``
(commands that load or deploy engines). :mod:`kilnlm.runtime.signing` has the formats."""

from __future__ import annotations

import argparse
from pathlib import Path

from kilnlm.runtime.signing import TRUSTED_KEYS_ENV


def add_sign_key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sign-key", type=Path, default=None, metavar="KEY",
                   help="sign the engine's manifest with this Ed25519 private key (PEM PKCS#8 or OpenSSH, unencrypted; "
                        "`openssl genpkey -algorithm ed25519 -out key.pem`), written as manifest.sig (default: unsigned)")


def add_trusted_keys_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trusted-keys", type=Path, default=None, metavar="PATH",
                   help="Ed25519 public keys (a file of PEM blocks / ssh-ed25519 lines, or a directory of such files): "
                        "refuse an engine unless its manifest.sig is signed by one of them, before loading anything "
                        f"from it (default: ${TRUSTED_KEYS_ENV}; unset: signatures not checked)")


def trusted_keys(args: argparse.Namespace):
    """The :class:`~kilnlm.runtime.signing.TrustedKeys` of ``--trusted-keys`` (else ``$KILNLM_TRUSTED_KEYS``),
    or None."""
    from kilnlm.runtime.signing import resolve_trusted_keys

    return resolve_trusted_keys(args.trusted_keys)
