"""The versioned engine cache: built engines stored by cache key in a directory or an S3 bucket.

A cache is a URL -- a local directory (``/path``, ``file:///path``) or ``s3://bucket/prefix`` (s3fs;
endpoint and credentials from the standard AWS environment variables and config files, so MinIO, Ceph and
other S3-compatible stores work). Layout under the URL::

    engines/<key>/blobs/<sha256>      one object per engine file, named by its content's SHA-256
    engines/<key>/manifest.json       the engine's manifest (rel path -> size, sha256), written LAST
    engines/<key>/manifest.sig        optional: an Ed25519 signature of that manifest (kilnlm.runtime.signing)
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

References (keys, ``name:version``, ``<cache URL>/<ref>``) are parsed by
:mod:`kilnlm.runtime.distribution.refs`; the object layer is :mod:`kilnlm.runtime.distribution.object_store`.
Never imports kilnlm.builder or transformers (serving-only installs resolve cached engines at load time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from kilnlm.runtime.distribution.object_store import ObjectInfo, ObjectStore
from kilnlm.runtime.distribution.refs import (KEY_PREFIX_RE, KEY_RE, LATEST, check_name, check_tag_version,
                                              parse_ref, split_cache_ref, split_name_version, version_order)
from kilnlm.runtime.errors import CacheError
from kilnlm.runtime.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, SIGNATURE_NAME, SUPPORTED_FORMAT_VERSIONS, Manifest,
                                     move_into_place, read_manifest, verify_files)
from kilnlm.runtime.signing import MAX_SIGNATURE_BYTES, key_id, read_signature, sign_manifest_bytes

log = logging.getLogger(__name__)

ENGINES = "engines"
NAMES = "names"
CHUNK_BYTES = 8 << 20  # streaming read size when hashing objects


@dataclass
class CacheEntry:
    """One complete (manifest-bearing) engine in a cache.

    ``names``: the ``name:version`` pointers that reference ``key`` (``latest`` excluded), sorted;
    ``size_bytes``: total size of the engine's files; ``created``: when the manifest was stored
    (ISO 8601, UTC, e.g. ``2026-11-22T08:00:00Z``); ``qformat`` / ``target``: from the manifest's build
    config."""

    key: str
    names: list[str]
    size_bytes: int
    created: str
    qformat: str
    target: str
    manifest: Manifest

    def to_dict(self) -> dict:
        """JSON-ready summary (without the manifest's file list)."""
        return {"key": self.key, "names": self.names, "size_bytes": self.size_bytes, "created": self.created,
                "qformat": self.qformat, "target": self.target,
                "source_checkpoint_digest": self.manifest.source_checkpoint_digest}


def _utc_iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EngineCache:
    """An engine cache at ``url`` (local directory, ``file://`` URL or ``s3://bucket/prefix``).

    References (``ref``) are a key (64 hex digits, optionally ``sha256:``-prefixed, or a unique prefix of
    at least 8), ``name:version``, or ``name`` (= ``name:latest``). Every method raises
    :class:`CacheError` with a one-line message for unknown references, unreachable endpoints and refused
    credentials. Construction checks that the bucket is reachable (one request)."""

    def __init__(self, url: str | os.PathLike):
        self.store = ObjectStore(url)
        self.url = self.store.url
        self.store.check()

    # -- object names -----------------------------------------------------------------------------------
    @staticmethod
    def _manifest_path(key: str) -> str:
        return f"{ENGINES}/{key}/{MANIFEST_NAME}"

    @staticmethod
    def _signature_path(key: str) -> str:
        return f"{ENGINES}/{key}/{SIGNATURE_NAME}"

    @staticmethod
    def _blob_path(key: str, sha256: str) -> str:
        return f"{ENGINES}/{key}/blobs/{sha256}"

    @staticmethod
    def _pointer_path(name: str, version: str) -> str:
        return f"{NAMES}/{name}/{version}.json"

    # -- reading entries --------------------------------------------------------------------------------
    def _read_manifest(self, key: str) -> tuple[Manifest, bytes, ObjectInfo] | None:
        """The stored manifest of ``key`` (parsed, raw bytes, object info), or None if there is none."""
        path = self._manifest_path(key)
        info = self.store.info(path)
        if info is None:
            return None
        where = self.store.describe(path)
        if info.size_bytes > MAX_MANIFEST_BYTES:
            raise CacheError(f"{where} is {info.size_bytes:,} bytes (at most {MAX_MANIFEST_BYTES:,}): not a kilnlm manifest; "
                             f"remove the entry (kilnlm cache rm {key})")
        raw = self.store.read_bytes(path)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            if data.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
                raise CacheError(f"{where}: engine format version {data.get('format_version')!r} is not supported by "
                                 f"this kilnlm: upgrade kilnlm or remove the entry (kilnlm cache rm {key})")
            manifest = Manifest.from_dict(data)
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"{where} is not a valid manifest ({type(exc).__name__}: {exc}): the entry is corrupt; "
                             f"remove it (kilnlm cache rm {key}) and push the engine again") from None
        if key not in (manifest.cache_key, _sha256(raw)):
            raise CacheError(f"{where} records cache key {manifest.cache_key!r}, not {key}: the entry was modified; "
                             f"remove it (kilnlm cache rm {key}) and push the engine again")
        return manifest, raw, info

    def _pointers(self) -> list[tuple[str, str, dict]]:
        """Every (name, version, pointer) in the cache, ``latest`` included."""
        out = []
        for obj in self.store.list_files(NAMES):
            parts = obj.path.split("/")
            if len(parts) != 3 or not parts[2].endswith(".json") or parts[2].startswith("."):
                continue
            raw = self.store.read_bytes(obj.path)
            try:
                pointer = json.loads(raw) if raw is not None else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                log.warning("ignoring unreadable name pointer %s", self.store.describe(obj.path))
                continue
            if isinstance(pointer, dict) and isinstance(pointer.get("key"), str):
                out.append((parts[1], parts[2][: -len(".json")], pointer))
        return out

    def _entry(self, key: str, stored: tuple[Manifest, bytes, ObjectInfo], names: list[str]) -> CacheEntry:
        manifest, _, info = stored
        return CacheEntry(key=key, names=sorted(names), size_bytes=sum(int(f["size"]) for f in manifest.files.values()),
                          created=_utc_iso(info.modified) if info else "", qformat=manifest.build.qformat,
                          target=manifest.build.target, manifest=manifest)

    def _names_of(self, key: str, pointers: list[tuple[str, str, dict]]) -> list[str]:
        return [f"{name}:{version}" for name, version, p in pointers if p["key"] == key and version != LATEST]

    def _resolve(self, ref: str) -> tuple[str, str | None]:
        """(key, the manifest SHA-256 a name pointer recorded or None)."""
        parsed = parse_ref(ref)
        if parsed.key:
            if self.store.info(self._manifest_path(parsed.key)) is None:
                raise CacheError(f"no engine with key {parsed.key} in cache {self.url}: "
                                 f"`kilnlm cache ls --cache {self.url}` lists what it holds")
            return parsed.key, None
        if KEY_PREFIX_RE.match(ref.strip()):
            matches = [k for k in self.store.list_children(ENGINES)
                       if k.startswith(ref.strip()) and self.store.info(self._manifest_path(k)) is not None]
            if len(matches) > 1:
                raise CacheError(f"key prefix {ref!r} matches {len(matches)} engines in cache {self.url}: give more digits")
            if matches:
                return matches[0], None
        raw = self.store.read_bytes(self._pointer_path(parsed.name, parsed.version))
        if raw is None:
            raise CacheError(f"{parsed.name}:{parsed.version} is not in cache {self.url}: "
                             f"`kilnlm cache ls --cache {self.url}` lists what it holds")
        try:
            pointer = json.loads(raw)
            key = pointer["key"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise CacheError(f"{self.store.describe(self._pointer_path(parsed.name, parsed.version))} is not a valid "
                             f"name pointer: tag the version again (kilnlm cache tag KEY {parsed.name}:{parsed.version})") from None
        if not isinstance(key, str) or not KEY_RE.match(key) or self.store.info(self._manifest_path(key)) is None:
            raise CacheError(f"{parsed.name}:{parsed.version} points to key {key!r}, which is not (or no longer) in cache "
                             f"{self.url}: tag another key or push the engine again")
        return key, pointer.get("manifest_sha256")

    def resolve(self, ref: str) -> str:
        """The key ``ref`` names. Raises :class:`CacheError` if no complete entry matches."""
        return self._resolve(ref)[0]

    def lookup(self, key: str) -> CacheEntry | None:
        """The complete entry stored under ``key``, or None (absent, or a publish that never finished)."""
        if not KEY_RE.match(key):
            raise CacheError(f"{key!r} is not a cache key (64 hex digits)")
        stored = self._read_manifest(key)
        if stored is None:
            return None
        return self._entry(key, stored, self._names_of(key, self._pointers()))

    def entries(self) -> list[CacheEntry]:
        """Every complete entry, newest first. An entry whose manifest this kilnlm cannot read is skipped
        with a logged warning."""
        pointers = self._pointers()
        out = []
        for key in self.store.list_children(ENGINES):
            if not KEY_RE.match(key):
                continue
            try:
                stored = self._read_manifest(key)
            except CacheError as exc:
                log.warning("skipping %s", exc)
                continue
            if stored is not None:
                out.append(self._entry(key, stored, self._names_of(key, pointers)))
        return sorted(out, key=lambda e: (e.created, e.key), reverse=True)

    # -- fetch / verify ---------------------------------------------------------------------------------
    def _stored_manifest(self, ref: str) -> tuple[str, Manifest, bytes, ObjectInfo]:
        key, expected_sha = self._resolve(ref)
        stored = self._read_manifest(key)
        if stored is None:
            raise CacheError(f"the entry of {ref} (key {key}) disappeared from cache {self.url} while reading it: retry")
        manifest, raw, info = stored
        if expected_sha and _sha256(raw) != expected_sha:
            raise CacheError(f"{self.store.describe(self._manifest_path(key))} does not match the SHA-256 that {ref} "
                             "recorded: the manifest was modified; it was not used (push the engine again)")
        for rel in manifest.files:
            pure = PurePosixPath(rel)
            if pure.is_absolute() or ".." in pure.parts or rel == MANIFEST_NAME:
                raise CacheError(f"{self.store.describe(self._manifest_path(key))} lists file {rel!r} outside the engine "
                                 "directory: the entry is corrupt; remove it")
        return key, manifest, raw, info

    def _copy_object(self, key: str, rel: str, meta: dict, dest) -> None:
        """Stream one blob (into ``dest``, a binary file, or nowhere when None) and check its size and
        SHA-256 against ``meta``; raises :class:`CacheError` naming the object."""
        path = self._blob_path(key, meta["sha256"])
        digest, size = hashlib.sha256(), 0

        def sink(chunk: bytes) -> None:
            nonlocal size
            digest.update(chunk)
            size += len(chunk)
            if dest is not None:
                dest.write(chunk)

        self.store.stream(path, sink, CHUNK_BYTES)
        where = f"cache object {self.store.describe(path)} (engine file {rel})"
        if size != int(meta["size"]):
            raise CacheError(f"{where} is {size:,} bytes but the manifest records {int(meta['size']):,}: it is truncated "
                             "or was modified and was not used; push the engine again or remove the entry")
        if digest.hexdigest() != meta["sha256"]:
            raise CacheError(f"{where} does not match its SHA-256 in the manifest: it was modified or corrupted and was "
                             "not used; push the engine again or remove the entry")

    def fetch(self, ref: str, output: Path, overwrite: bool = False) -> Manifest:
        """Download the engine ``ref`` names into the directory ``output``: every file is written to a
        temporary directory beside ``output`` while its size and SHA-256 are checked against the
        manifest (whose own SHA-256 is checked first against the name pointer, when ``ref`` is a name),
        then the directory is renamed into place. Returns the manifest. Raises :class:`CacheError` naming
        the object that does not match (nothing is left at ``output``), or if ``output`` exists, is not
        empty and ``overwrite`` is False."""
        output = Path(output)
        if output.exists() and not output.is_dir():
            raise CacheError(f"--output {output} is a file: pass a directory path")
        if output.is_dir() and any(output.iterdir()) and not overwrite:
            raise CacheError(f"--output {output} exists and is not empty: pass --overwrite or choose another directory")
        key, manifest, raw, _ = self._stored_manifest(ref)
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.parent / f".{output.name}.fetch-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            for rel, meta in sorted(manifest.files.items()):
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(dest, "wb") as f:
                    self._copy_object(key, rel, meta, f)
            (tmp / MANIFEST_NAME).write_bytes(raw)
            signature = self.store.read_bytes(self._signature_path(key))
            if signature is not None:  # checked, against the loader's trusted keys, when the engine is loaded
                if len(signature) > MAX_SIGNATURE_BYTES:
                    raise CacheError(f"{self.store.describe(self._signature_path(key))} is {len(signature):,} bytes, "
                                     f"not a signature: sign the entry again (kilnlm cache push --sign-key)")
                (tmp / SIGNATURE_NAME).write_bytes(signature)
            read_manifest(tmp)  # format version and structure, as the runtime will read it
            move_into_place(tmp, output)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("fetched %s (key %s) into %s", ref, key, output)
        return manifest

    def verify(self, ref: str) -> CacheEntry:
        """Re-read every stored object of ``ref`` and check its size and SHA-256 against the manifest.
        Returns the entry; raises :class:`CacheError` naming the first object that does not match."""
        key, manifest, raw, info = self._stored_manifest(ref)
        for rel, meta in sorted(manifest.files.items()):
            self._copy_object(key, rel, meta, None)
        return self._entry(key, (manifest, raw, info), self._names_of(key, self._pointers()))

    # -- writing ----------------------------------------------------------------------------------------
    def publish(self, engine_dir: Path, name: str | None = None, version: str | None = None,
                signing_key=None) -> CacheEntry:
        """Store the engine directory ``engine_dir`` (checked against its manifest first) under its
        manifest's ``cache_key`` (or, for engines without one, the SHA-256 of its manifest), then tag
        ``name:version`` if ``name`` is given (see :meth:`tag` for ``version`` None). If the key is
        already stored, nothing is uploaded. Returns the stored entry.

        Signature: with ``signing_key`` (an Ed25519 private key, :func:`kilnlm.runtime.signing.load_signing_key`)
        the stored manifest is signed; else the engine's own ``manifest.sig``, if it has one, is stored with
        it. Either replaces an earlier signature of the entry, and only when the stored manifest is
        byte-for-byte the engine's (a :class:`CacheError` with ``signing_key`` otherwise: the cache holds
        another build of the key, which this engine does not vouch for).

        Order: every file as a content-addressed blob, then the manifest, created only if absent. A
        publish killed before the manifest leaves blobs no reader looks at (:meth:`gc` removes them);
        of two concurrent publishers of one key, the first manifest stored wins and the other
        publisher's blobs become orphans."""
        engine_dir = Path(engine_dir)
        if name is not None:
            check_name(name)
        if version is not None:
            check_name(version, "version")
        manifest = read_manifest(engine_dir)
        verify_files(engine_dir, manifest)
        raw = (engine_dir / MANIFEST_NAME).read_bytes()
        key = manifest.cache_key or _sha256(raw)
        if not KEY_RE.match(key):
            raise CacheError(f"{engine_dir / MANIFEST_NAME}: cache_key {key!r} is not 64 hex digits: rebuild the engine")
        if self.store.info(self._manifest_path(key)) is None:
            for rel, meta in sorted(manifest.files.items(), key=lambda item: (item[1]["size"], item[0])):
                blob = self._blob_path(key, meta["sha256"])
                existing = self.store.info(blob)
                if existing is None or existing.size_bytes != int(meta["size"]):
                    self.store.upload_file(engine_dir / rel, blob)
            if self.store.write_bytes(self._manifest_path(key), raw, exclusive=True):
                log.info("published %s as %s in %s", engine_dir, key, self.url)
            else:
                log.info("key %s was published concurrently by another builder; keeping that entry", key)
        else:
            log.info("key %s is already in %s; nothing uploaded", key, self.url)
        self.store_signature(engine_dir, key, raw, signing_key)
        if name is not None:
            self.tag(key, name, version)
        entry = self.lookup(key)
        if entry is None:
            raise CacheError(f"key {key} vanished from cache {self.url} right after publishing (removed concurrently?): publish again")
        return entry

    def store_signature(self, engine_dir: Path, key: str, raw: bytes, signing_key=None) -> None:
        """:meth:`publish`'s signature step, without re-checking the files: sign the entry ``key``, whose
        manifest ``engine_dir`` holds as ``raw`` (already stored), with ``signing_key``, or store
        ``engine_dir``'s own ``manifest.sig`` (nothing without either). Raises :class:`CacheError` as
        :meth:`publish` does."""
        signature = sign_manifest_bytes(raw, signing_key) if signing_key is not None else read_signature(engine_dir)
        if signature is None:
            return
        if self.store.read_bytes(self._manifest_path(key)) != raw:
            if signing_key is not None:
                raise CacheError(f"key {key} in {self.url} holds another build of this engine (its manifest differs from "
                                 f"{engine_dir / MANIFEST_NAME}): pull that entry, check it, and sign it instead")
            log.warning("key %s in %s holds another build of %s: its signature was not stored", key, self.url, engine_dir)
            return
        self.store.write_bytes(self._signature_path(key), signature)
        if signing_key is not None:
            log.info("signed %s with key %s", key, key_id(signing_key.public_key()))

    def tag(self, key: str, name: str, version: str | None = None) -> str:
        """Point ``name:version`` and ``name:latest`` at ``key`` (a key or unique key prefix); returns the
        version. ``version`` None: the version of ``name`` that already points to ``key`` if there is one
        (tagging is idempotent: rebuilding or re-pushing an engine does not mint versions), else the next
        integer version. Raises :class:`CacheError` if ``key`` is not a complete entry or ``version`` is
        ``latest``."""
        check_name(name)
        if version is not None:
            check_tag_version(name, version)
        parsed = parse_ref(key)
        if parsed.key is None and not KEY_PREFIX_RE.match(key.strip()):
            raise CacheError(f"{key!r} is not a cache key: `kilnlm cache ls` shows the keys")
        key = self.resolve(key)
        stored = self._read_manifest(key)
        if stored is None:
            raise CacheError(f"no engine with key {key} in cache {self.url}")
        pointer = {"key": key, "created": _utc_iso(datetime.now(timezone.utc)), "manifest_sha256": _sha256(stored[1])}
        if version is not None:
            self.store.write_bytes(self._pointer_path(name, version), _json(pointer))
        else:
            same = [v for n, v, p in self._pointers() if n == name and v != LATEST and p["key"] == key]
            version = max(same, key=version_order) if same else self._create_next_version(name, pointer)
        self.store.write_bytes(self._pointer_path(name, LATEST), _json({**pointer, "version": version}))
        return version

    def _create_next_version(self, name: str, pointer: dict) -> str:
        """Create ``names/<name>/<n>.json`` for the next free integer n (exclusive create, so concurrent
        taggers get distinct versions)."""
        numbers = [int(child[:-5]) for child in self.store.list_children(f"{NAMES}/{name}")
                   if child.endswith(".json") and child[:-5].isdigit()]
        number = max(numbers, default=0) + 1
        for _ in range(1000):
            if self.store.write_bytes(self._pointer_path(name, str(number)), _json(pointer), exclusive=True):
                return str(number)
            number += 1
        raise CacheError(f"could not find a free version for {name} in cache {self.url}: give one explicitly (NAME:VERSION)")

    def remove(self, ref: str) -> None:
        """Remove ``ref``: ``name:version`` removes that pointer (``name:latest`` removes the version it
        points to; latest then moves to the newest remaining version); a key removes the entry and every
        name that points to it. A bare ``name`` is refused (say which version, or use the key)."""
        parsed = parse_ref(ref)
        if parsed.key is None and not KEY_PREFIX_RE.match(ref.strip()) and ":" not in ref:
            raise CacheError(f"`rm {ref}` is ambiguous: remove one version ({ref}:<version>, {ref}:latest) or the key")
        if parsed.name is not None and ":" in ref:
            raw = self.store.read_bytes(self._pointer_path(parsed.name, parsed.version))
            if raw is None:
                raise CacheError(f"{parsed.name}:{parsed.version} is not in cache {self.url}")
            version = parsed.version
            if version == LATEST:
                version = json.loads(raw).get("version") or LATEST
            self.store.remove(self._pointer_path(parsed.name, version))
            self._repair_latest(parsed.name)
            return
        key = self.resolve(ref)
        touched = set()
        for name, version, pointer in self._pointers():
            if pointer["key"] == key:
                self.store.remove(self._pointer_path(name, version))
                touched.add(name)
        for name in touched:
            self._repair_latest(name)
        self.store.remove(self._manifest_path(key))  # first: readers stop trusting the entry
        self.store.remove_tree(f"{ENGINES}/{key}")

    def _repair_latest(self, name: str) -> None:
        """Point ``name:latest`` at the most recently tagged remaining version, or remove it."""
        versions = [(p.get("created", ""), version, p) for n, version, p in self._pointers() if n == name and version != LATEST]
        latest = self.store.read_bytes(self._pointer_path(name, LATEST))
        current = json.loads(latest).get("version") if latest else None
        if not versions:
            self.store.remove(self._pointer_path(name, LATEST))
        elif current not in {v for _, v, _ in versions}:
            _, version, pointer = max(versions, key=lambda item: (item[0], version_order(item[1])))
            self.store.write_bytes(self._pointer_path(name, LATEST), _json({**pointer, "version": version}))

    def gc(self, dry_run: bool = False, min_age_s: float = 3600.0) -> list[str]:
        """Remove entries that no name points to, leftovers of unfinished publishes (blobs without a
        manifest, blobs a manifest does not list, S3 multipart uploads never completed) and pointers to
        missing keys -- each only if older than ``min_age_s`` seconds, so a publish in progress is never
        collected. Returns the keys removed
        (with ``dry_run``: that would be removed), entries and leftovers alike."""
        now = datetime.now(timezone.utc)
        pointers = self._pointers()
        pointed = {p["key"] for _, _, p in pointers}
        by_key: dict[str, list[ObjectInfo]] = {}
        for obj in self.store.list_files(ENGINES):
            by_key.setdefault(obj.path.split("/")[1], []).append(obj)
        removed, gone = [], set()  # keys touched; keys removed entirely
        for key, objects in sorted(by_key.items()):
            if any((now - o.modified).total_seconds() < min_age_s for o in objects):
                continue
            try:
                stored = self._read_manifest(key) if KEY_RE.match(key) else None
            except CacheError as exc:
                log.warning("gc: leaving %s alone: %s", key, exc)
                continue
            if stored is None or key not in pointed:
                removed.append(key)
                gone.add(key)
                if not dry_run:
                    self.store.remove(self._manifest_path(key))
                    self.store.remove_tree(f"{ENGINES}/{key}")
                continue
            listed = {self._blob_path(key, meta["sha256"]) for meta in stored[0].files.values()}
            kept = {self._manifest_path(key), self._signature_path(key)}
            orphans = [o for o in objects if o.path not in listed and o.path not in kept]
            if orphans:
                removed.append(key)
                for o in orphans if not dry_run else ():
                    self.store.remove(o.path)
        for path in self.store.abort_stale_uploads(ENGINES, min_age_s, dry_run):  # S3 uploads killed midway
            key = path.split("/")[1]
            if key not in removed:
                removed.append(key)
        live = set(by_key) - gone
        for name, version, pointer in pointers:  # pointers to keys that are gone (removed by hand)
            if pointer["key"] not in live and not dry_run:
                self.store.remove(self._pointer_path(name, version))
        return removed


def _json(data: dict) -> bytes:
    return (json.dumps(data, sort_keys=True) + "\n").encode()


__all__ = ["CacheEntry", "CacheError", "EngineCache", "split_cache_ref", "split_name_version"]
