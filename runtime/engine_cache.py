"""The versioned engine cache: built engines stored by cache key in a directory or an S3 bucket.

A cache is a URL -- a local directory (``/path``, ``file:///path``) or ``s3://bucket/prefix`` (s3fs;
endpoint and credentials from the standard AWS environment variables and config files, so MinIO, Ceph and
other S3-compatible stores work). Layout under the URL::

    engines/<key>/blobs/<sha256>      one object per engine file, named by its content's SHA-256
    engines/<key>/manifest.json       the engine's manifest (rel path -> size, sha256), written LAST
    names/<name>/<version>.json       {"key", "created", "manifest_sha256"}: a pointer to a key
    names/<name>/latest.json          the most recently tagged version of <name> (plus "version")

``<key>`` is the build's cache key (64 hex digits, :mod:`kilnlm.builder.cache_key`), recorded in the
manifest. Publishing is atomic: each object PUT is atomic (S3; a temp file + rename locally), the blobs
go first and the manifest last, created only if absent, so

- a reader trusts only an entry whose manifest exists, and every file it fetches is checked against the
  manifest's size and SHA-256 before the engine directory is renamed into place;
- a publish killed at any point leaves only blobs without a manifest: invisible, removed by :meth:`gc`;
- two publishers of one key (even with engines that differ byte-wise, e.g. non-deterministic compiles)
  write disjoint blobs; the first manifest wins and names only blobs its publisher uploaded.

Never imports kilnlm.builder or transformers (serving-only installs resolve cached engines at load time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kilnlm.runtime.errors import CacheError
from kilnlm.runtime.manifest import Manifest


@dataclass
class CacheEntry:
    """One complete (manifest-bearing) engine in a cache.

    ``names``: the ``name:version`` pointers that reference ``key`` (``latest`` excluded);
    ``size_bytes``: total size of the engine's files; ``created``: when the manifest was stored
    (ISO 8601, UTC); ``qformat`` / ``target``: from the manifest's build config."""

    key: str
    names: list[str]
    size_bytes: int
    created: str
    qformat: str
    target: str
    manifest: Manifest


def split_cache_ref(ref: str) -> tuple[str, str]:
    """Split a full cache reference into (cache URL, reference inside the cache).

    ``'s3://bucket/prefix/smollm2:3'`` -> ``('s3://bucket/prefix', 'smollm2:3')``;
    ``'/dir/cache/<key>'`` -> ``('/dir/cache', '<key>')``. Raises :class:`CacheError` for a reference
    without a cache part or whose last part is not a key, ``name`` or ``name:version``."""
    raise NotImplementedError


class EngineCache:
    """An engine cache at ``url`` (local directory, ``file://`` URL or ``s3://bucket/prefix``).

    References (``ref``) are a key (64 hex digits, or a unique prefix of at least 8), ``name:version``,
    or ``name`` (= ``name:latest``). Every method raises :class:`CacheError` with a one-line message for
    unknown references, unreachable endpoints and refused credentials."""

    def __init__(self, url: str | os.PathLike):
        raise NotImplementedError

    def resolve(self, ref: str) -> str:
        """The key ``ref`` names. Raises :class:`CacheError` if no complete entry matches."""
        raise NotImplementedError

    def lookup(self, key: str) -> CacheEntry | None:
        """The complete entry stored under ``key``, or None (absent, or a publish that never finished)."""
        raise NotImplementedError

    def fetch(self, ref: str, output: Path, overwrite: bool = False) -> Manifest:
        """Download the engine ``ref`` names into the directory ``output``: every file is written to a
        temporary directory beside ``output`` while its size and SHA-256 are checked against the
        manifest, then the directory is renamed into place. Returns the manifest. Raises
        :class:`CacheError` naming the object that does not match (nothing is left at ``output``), or if
        ``output`` exists, is not empty and ``overwrite`` is False."""
        raise NotImplementedError

    def publish(self, engine_dir: Path, name: str | None = None, version: str | None = None) -> CacheEntry:
        """Store the engine directory ``engine_dir`` (checked against its manifest first) under its
        manifest's ``cache_key`` (or, for engines without one, the SHA-256 of its manifest), then tag
        ``name:version`` if ``name`` is given (``version`` None = the next integer version). If the key
        is already stored, nothing is uploaded. Returns the stored entry."""
        raise NotImplementedError

    def tag(self, key: str, name: str, version: str | None = None) -> str:
        """Point ``name:version`` (None = next integer version) and ``name:latest`` at ``key``; returns
        the version. Raises :class:`CacheError` if ``key`` is not a complete entry."""
        raise NotImplementedError

    def entries(self) -> list[CacheEntry]:
        """Every complete entry, newest first."""
        raise NotImplementedError

    def verify(self, ref: str) -> CacheEntry:
        """Re-read every stored object of ``ref`` and check its size and SHA-256 against the manifest.
        Returns the entry; raises :class:`CacheError` naming the first object that does not match."""
        raise NotImplementedError

    def remove(self, ref: str) -> None:
        """Remove ``ref``: a ``name:version`` removes that pointer (``name:latest`` moves to the newest
        remaining version); a key removes the entry and every name that points to it."""
        raise NotImplementedError

    def gc(self, dry_run: bool = False, min_age_s: float = 3600.0) -> list[str]:
        """Remove entries that no name points to, and leftovers of unfinished publishes, older than
        ``min_age_s`` seconds (so a publish in progress is never collected). Returns the removed keys
        (with ``dry_run``: the keys that would be removed)."""
        raise NotImplementedError
