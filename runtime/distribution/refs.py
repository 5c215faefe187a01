"""References into an engine cache: keys, ``name:version`` pointers and full ``<cache URL>/<ref>`` strings.

Grammar (checked before any request is made)::

    key      64 lowercase hex digits (optionally "sha256:"-prefixed), or a unique prefix of 8+ of them
    name     [A-Za-z0-9][A-Za-z0-9._-]{0,127}         version: the same characters; "latest" is kilnlm's
    ref      key | name:version | name  (= name:latest)
    full     <cache URL>/<ref>, e.g. s3://bucket/prefix/smollm2:3 or /srv/cache/<key>
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kilnlm.runtime.errors import CacheError

LATEST = "latest"
KEY_RE = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX_RE = re.compile(r"^[0-9a-f]{8,63}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Ref:
    """A parsed reference inside a cache: a key (or key prefix), or a name and version."""

    key: str | None = None
    name: str | None = None
    version: str | None = None


def check_name(name: str, what: str = "name") -> None:
    """Raise :class:`CacheError` unless ``name`` is a valid name or version (``what`` names it)."""
    if not _NAME.match(name or ""):
        raise CacheError(f"engine {what} {name!r} is not valid: use letters, digits, '.', '_' and '-' "
                         "(starting with a letter or digit, at most 128 characters)")


def parse_ref(ref: str) -> Ref:
    """``<key>`` | ``sha256:<key>`` | ``<key prefix of 8+ hex digits>`` | ``name:version`` | ``name``."""
    ref = ref.strip()
    if ref.startswith("sha256:") and KEY_RE.match(ref[7:]):
        return Ref(key=ref[7:])
    if KEY_RE.match(ref):
        return Ref(key=ref)
    if ":" in ref:
        name, version = ref.split(":", 1)
        check_name(name)
        check_name(version, "version")
        return Ref(name=name, version=version)
    check_name(ref, "reference")
    return Ref(name=ref, version=LATEST)


def check_tag_version(name: str, version: str) -> None:
    """Raise :class:`CacheError` unless ``version`` is a valid version a user may tag ``name`` with (not
    the reserved ``latest``, which kilnlm maintains)."""
    check_name(version, "version")
    if version == LATEST:
        raise CacheError(f"{name}:latest is maintained by kilnlm (it follows the last tag): give a version, e.g. {name}:1")


def split_name_version(text: str) -> tuple[str, str | None]:
    """``'NAME'`` -> ``('NAME', None)``; ``'NAME:VERSION'`` -> ``('NAME', 'VERSION')``. Raises
    :class:`CacheError` for invalid characters or the reserved version ``latest``."""
    name, sep, version = text.strip().partition(":")
    check_name(name)
    if not sep:
        return name, None
    check_tag_version(name, version)
    return name, version


def split_cache_ref(ref: str) -> tuple[str, str]:
    """Split a full cache reference into (cache URL, reference inside the cache).

    ``'s3://bucket/prefix/smollm2:3'`` -> ``('s3://bucket/prefix', 'smollm2:3')``;
    ``'/dir/cache/<key>'`` -> ``('/dir/cache', '<key>')``. Raises :class:`CacheError` for a reference
    without a cache part or whose last part is not a key, ``name`` or ``name:version``."""
    text = str(ref).strip().rstrip("/")
    cache, sep, inner = text.rpartition("/")
    if not sep or not inner or not cache or cache.endswith(":/") or cache.endswith(":"):
        raise CacheError(f"cache reference {ref!r} is not <cache>/<name>[:<version>] or <cache>/<key>: "
                         "write e.g. s3://bucket/prefix/smollm2:3 or /path/to/cache/smollm2")
    parse_ref(inner)
    return cache, inner


def version_order(version: str) -> tuple:
    """Sort key of versions: integers numerically, then other versions by text."""
    return (0, int(version), "") if version.isdigit() else (1, 0, version)
