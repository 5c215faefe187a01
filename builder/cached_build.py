"""``kilnlm build --cache URL [--name NAME[:VERSION]]``: build only what the engine cache lacks.

::

    opts = resolve(options)                  validated once, before any work
    key = compute_cache_key(opts)            hashes the checkpoint's files; loads nothing
    hit:  cache.fetch(key) -> opts.output    downloaded, sizes + SHA-256 checked, renamed into place
    miss: build_engine(opts) -> opts.output  then cache.publish(opts.output) (files first, manifest last)
    --sign-key: the engine at opts.output is signed (built signed, or signed after the fetch) and the
                signature stored with the entry
    NAME given: NAME:VERSION -> key          (VERSION None: NAME's version of key if any, else the next integer)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kilnlm.builder.build import build_engine
from kilnlm.builder.cache_key import compute_cache_key
from kilnlm.builder.config import BuildOptions, ResolvedBuildOptions, resolve
from kilnlm.runtime.distribution.cache import CacheEntry, EngineCache, split_name_version
from kilnlm.runtime.manifest import MANIFEST_NAME, Manifest
from kilnlm.runtime.signing import load_signing_key, sign_engine


@dataclass
class CachedBuild:
    """What :func:`build_with_cache` did. ``hit``: fetched instead of built; ``name``: the
    ``name:version`` that points at ``key`` (None without ``--name``); ``elapsed_s``: wall time."""

    manifest: Manifest
    key: str
    hit: bool
    entry: CacheEntry
    name: str | None
    elapsed_s: float


def build_with_cache(options: BuildOptions | ResolvedBuildOptions, cache_url: str, name: str | None = None,
                     say: Callable[[str], None] = print) -> CachedBuild:
    """Place the engine of ``options`` at ``options.output``, from the cache at ``cache_url`` when it holds the
    build's key, else by building and publishing it. ``name``: ``NAME`` or ``NAME:VERSION`` to tag.
    ``say`` receives one-line progress messages ("cache hit <key>", ...). Raises :class:`BuildError`
    for bad build options and :class:`CacheError` for cache problems (checked before any work)."""
    t_start = time.perf_counter()
    tag_name, tag_version = split_name_version(name) if name else (None, None)
    cache = EngineCache(cache_url)
    opts = options if isinstance(options, ResolvedBuildOptions) else resolve(options)
    key = compute_cache_key(opts)
    # --export-checkpoint writes ModelOpt's quantized checkpoint, which only a build produces: skip the lookup.
    entry = cache.lookup(key.key) if opts.export_checkpoint is None else None
    hit = entry is not None
    if opts.export_checkpoint is not None:
        say(f"--export-checkpoint needs the quantization itself: building {key.key} without a cache lookup")
    if hit:
        manifest = cache.fetch(key.key, opts.output, overwrite=opts.overwrite)
        say(f"cache hit {key.key}: fetched into {opts.output}")
        if opts.sign_key is not None:  # the fetched files were checked: only the signature goes up
            say(f"signed {opts.output} with key {sign_engine(opts.output, load_signing_key(opts.sign_key))}")
            cache.store_signature(opts.output, key.key, (opts.output / MANIFEST_NAME).read_bytes())
    else:
        say(f"cache miss {key.key}: building")
        manifest = build_engine(opts, cache_key=key)
        entry = cache.publish(opts.output)
        say(f"published {key.key} to {cache.url}")
    tagged = None
    if tag_name is not None:
        tagged = f"{tag_name}:{cache.tag(key.key, tag_name, tag_version)}"
        say(f"tagged {tagged} -> {key.key}")
        entry = cache.lookup(key.key) or entry
    return CachedBuild(manifest=manifest, key=key.key, hit=hit, entry=entry, name=tagged,
                       elapsed_s=time.perf_counter() - t_start)
