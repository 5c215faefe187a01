"""``kilnlm cache``: list, push, pull, tag, verify, remove and garbage-collect engines in an engine cache.

Every command takes ``--cache URL`` (a local directory, ``file:///path`` or ``s3://bucket/prefix``;
default ``$KILNLM_CACHE`` or ``~/.cache/kilnlm/engines``) and ``--json``. References (REF) are a key (or
a unique prefix of 8+ hex digits), ``name:version`` or ``name`` (= ``name:latest``). Needs only the
runtime (no build toolchain).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from kilnlm.cli.trust_options import add_sign_key_option

CACHE_ENV = "KILNLM_CACHE"


def default_cache_url() -> str:
    """``$KILNLM_CACHE`` if set, else ``~/.cache/kilnlm/engines``."""
    return os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "kilnlm" / "engines")


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", default=None, metavar="URL",
                   help=f"engine cache: a directory, file:///path or s3://bucket/prefix (S3 endpoint and credentials from "
                        f"the AWS environment variables / config) (default: ${CACHE_ENV} or ~/.cache/kilnlm/engines)")


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True,
                           help="ls, push, pull, tag, verify, rm or gc (kilnlm cache ACTION --help for its options)")

    def action(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help_text, description=help_text)
        add_cache_option(q)
        q.add_argument("--json", action="store_true", help="print JSON instead of a table (default: off)")
        q.set_defaults(run=handler)
        return q

    action("ls", "list cached engines: names, versions, keys, sizes, created time, qformat, target", _ls)
    q = action("push", "publish an engine directory to the cache (files first, manifest last)", _push)
    q.add_argument("engine", type=Path, metavar="DIR", help="engine directory written by `kilnlm build`")
    q.add_argument("--name", default=None, metavar="NAME[:VERSION]",
                   help="also tag the engine; without VERSION the next integer version (default: untagged)")
    add_sign_key_option(q)
    q = action("pull", "download an engine from the cache and verify every file before placing it", _pull)
    q.add_argument("ref", metavar="REF", help="key, name:version or name (= name:latest)")
    q.add_argument("--output", required=True, type=Path, help="engine directory to create")
    q.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output (default: off)")
    q = action("tag", "point NAME:VERSION (and NAME:latest) at a cached engine", _tag)
    q.add_argument("key", metavar="KEY", help="the engine's cache key (or a unique prefix of 8+ hex digits)")
    q.add_argument("name", metavar="NAME[:VERSION]", help="name to tag; without VERSION the next integer version")
    q = action("verify", "re-hash every stored object of an engine against its manifest", _verify)
    q.add_argument("ref", metavar="REF", help="key, name:version or name (= name:latest)")
    q = action("rm", "remove a name:version pointer, or a key with every name pointing to it", _rm)
    q.add_argument("ref", metavar="REF", help="name:version, name:latest, or a key")
    q = action("gc", "remove engines no name points to and leftovers of interrupted publishes", _gc)
    q.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing (default: off)")
    q.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                   help="only collect objects older than this, so publishes in progress are safe (default: 3600)")
    return p


def _open(args: argparse.Namespace):
    from kilnlm.runtime.distribution.cache import EngineCache

    return EngineCache(args.cache or default_cache_url())


def _print_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _mb(size_bytes: int) -> str:
    return f"{size_bytes / 1e6:,.1f} MB"


def _ls(args: argparse.Namespace) -> int:
    cache = _open(args)
    entries = cache.entries()
    if args.json:
        _print_json([e.to_dict() for e in entries])
        return 0
    rows = []
    for e in entries:
        for ref in e.names or ["-"]:
            name, _, version = ref.partition(":")
            rows.append([name, version or "-", e.key[:16], _mb(e.size_bytes), e.created, e.qformat, e.target])
    if not rows:
        print(f"cache {cache.url} holds no engines")
        return 0
    print(_table(rows, ["NAME", "VERSION", "KEY", "SIZE", "CREATED", "QFORMAT", "TARGET"]))
    return 0


def _push(args: argparse.Namespace) -> int:
    from kilnlm.runtime.distribution.cache import split_name_version
    from kilnlm.runtime.signing import load_signing_key

    name, version = split_name_version(args.name) if args.name else (None, None)
    signing_key = None if args.sign_key is None else load_signing_key(args.sign_key)
    cache = _open(args)
    entry = cache.publish(args.engine, name, version, signing_key=signing_key)
    if args.json:
        _print_json(entry.to_dict())
    else:
        print(f"pushed {args.engine} as {entry.key} ({_mb(entry.size_bytes)}) to {cache.url}"
              + (f"; names: {', '.join(entry.names)}" if entry.names else ""))
    return 0


def _pull(args: argparse.Namespace) -> int:
    cache = _open(args)
    key = cache.resolve(args.ref)
    manifest = cache.fetch(args.ref, args.output, overwrite=args.overwrite)
    size_bytes = sum(int(f["size"]) for f in manifest.files.values())
    if args.json:
        _print_json({"key": key, "output": str(args.output), "size_bytes": size_bytes, "verified": True})
    else:
        print(f"pulled {args.ref} ({key}, {_mb(size_bytes)}) into {args.output}: every file verified")
    return 0


def _tag(args: argparse.Namespace) -> int:
    from kilnlm.runtime.distribution.cache import split_name_version

    name, version = split_name_version(args.name)
    cache = _open(args)
    key = cache.resolve(args.key)
    version = cache.tag(key, name, version)
    if args.json:
        _print_json({"key": key, "name": f"{name}:{version}"})
    else:
        print(f"tagged {name}:{version} (and {name}:latest) -> {key}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    entry = _open(args).verify(args.ref)
    if args.json:
        _print_json({**entry.to_dict(), "verified": True})
    else:
        print(f"{args.ref} ({entry.key}): {len(entry.manifest.files)} files, {_mb(entry.size_bytes)}: every object "
              "matches its manifest")
    return 0


def _rm(args: argparse.Namespace) -> int:
    _open(args).remove(args.ref)
    if args.json:
        _print_json({"removed": args.ref})
    else:
        print(f"removed {args.ref}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    removed = _open(args).gc(dry_run=args.dry_run, min_age_s=args.min_age)
    if args.json:
        _print_json({"dry_run": args.dry_run, "keys": removed})
    elif not removed:
        print("nothing to collect")
    else:
        verb = "would remove" if args.dry_run else "removed"
        print("\n".join(f"{verb} {key}" for key in removed))
    return 0
