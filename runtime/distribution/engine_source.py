"""Where a served model's engine comes from: a local engine directory, or a cache reference resolved at
load time.

A Triton model (``model_repository/kilnlm/1/model.py``) calls :func:`resolve_served_engine` from its
``initialize`` with its model directory, its version and its ``config.pbtxt`` parameters. The first of
these that exists decides (``<model dir>`` is ``args["model_repository"]``, e.g. ``/models/kilnlm``)::

    <model dir>/<version>/engine/          an engine directory copied there by `kilnlm deploy`
    <model dir>/<version>/engine.json      a pointer written by `kilnlm deploy`:
                                             {"engine_ref": "s3://bucket/prefix/smollm2:3",
                                              "cache_key": "<key the ref resolved to at deploy time>"}
    parameter engine_ref                   a cache reference (s3://bucket/prefix/name:version, name:latest,
                                           /local/cache/<key>), resolved when the model loads
    parameter engine_dir                   a local engine directory (absolute, or relative to <model dir>)

A version directory may also hold ``speculative_config.json`` (vLLM's ``speculative_config`` JSON, written by
``kilnlm deploy --speculative-config``) and, for the ``draft`` method, the draft engine's copy in ``draft/``:
the version then serves with that configuration, over the model's ``speculative_config`` parameter
(:func:`version_speculative_config`).

The engine is refused before it is loaded unless its manifest is signed by one of the trusted keys, when
there are any (:func:`served_trusted_keys`: parameter ``trusted_keys``, else ``$KILNLM_TRUSTED_KEYS``).

A cache reference is materialised in a local engine cache directory (parameter ``engine_cache_dir``, else
``$KILNLM_ENGINE_CACHE_DIR``, else ``~/.cache/kilnlm/served-engines``) as ``<engine cache dir>/<key>/``:
downloaded once through :class:`kilnlm.runtime.distribution.cache.EngineCache` (which verifies sizes and
SHA-256 while fetching), verified again with :func:`kilnlm.runtime.engine.verify_engine`, and reused on the next
load without contacting the store when the copy still verifies. A pointer with a ``cache_key`` is pinned:
it serves that key even if the name it came from has since been tagged to another engine, and needs no
store at all while the verified copy is present. A copy that no longer verifies is moved aside and
fetched again.

Never imports kilnlm.builder or transformers (serving-only installs run this).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from kilnlm.runtime.errors import EngineError, KilnError

ENGINE_SUBDIR = "engine"  # a version directory's engine copy
POINTER_NAME = "engine.json"  # a version directory's pointer to a cache reference
DRAFT_SUBDIR = "draft"  # a version directory's draft engine copy (speculative decoding)
SPECULATIVE_CONFIG_NAME = "speculative_config.json"  # the speculative_config a version directory serves with
POINTER_FORMAT_VERSION = 1
ENGINE_CACHE_DIR_ENV = "KILNLM_ENGINE_CACHE_DIR"
DEFAULT_ENGINE_CACHE_DIR = Path("~/.cache/kilnlm/served-engines")


@dataclasses.dataclass(frozen=True)
class EnginePointer:
    """The content of a version directory's ``engine.json``.

    Attributes:
        engine_ref: the cache reference as given to `kilnlm deploy` (``s3://bucket/prefix/name:version``,
            ``/local/cache/name:latest``, ...): its cache URL is where the engine is fetched from.
        cache_key: the key ``engine_ref`` resolved to when it was deployed; None resolves ``engine_ref``
            again at every load (follows a moving name such as ``name:latest``).
    """

    engine_ref: str
    cache_key: str | None = None
    format_version: int = POINTER_FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path) -> "EnginePointer":
        """Parse ``path``. Raises :class:`EngineError` naming the file when it is not a valid pointer."""
        try:
            data = json.loads(Path(path).read_text())
            pointer = cls(engine_ref=str(data["engine_ref"]), cache_key=data.get("cache_key"),
                          format_version=int(data.get("format_version", POINTER_FORMAT_VERSION)))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{path} is not a kilnlm engine pointer ({exc!r}): write it again with "
                              "`kilnlm deploy REF --model-repository ...`") from None
        if pointer.format_version != POINTER_FORMAT_VERSION:
            raise EngineError(f"{path}: pointer format version {pointer.format_version} is not supported "
                              f"(this kilnlm reads {POINTER_FORMAT_VERSION}): deploy the engine again")
        return pointer


@dataclasses.dataclass(frozen=True)
class ServedEngine:
    """What :func:`resolve_served_engine` found.

    Attributes:
        engine_dir: the local engine directory to load (verified when it came from a cache).
        source: a one-line description for the model's log ("version directory", "cache s3://... key ...").
        downloaded: True when the engine was fetched from the store during this call.
    """

    engine_dir: Path
    source: str
    downloaded: bool = False


def default_engine_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """``$KILNLM_ENGINE_CACHE_DIR`` when set, else ``~/.cache/kilnlm/served-engines`` (expanded)."""
    env = os.environ if environ is None else environ
    return Path(env.get(ENGINE_CACHE_DIR_ENV) or DEFAULT_ENGINE_CACHE_DIR).expanduser()


def _resolve_key(engine_ref: str) -> tuple[object, str]:
    """``(EngineCache of the ref's cache URL, key the ref names)``; raises the cache's CacheError."""
    from kilnlm.runtime.distribution.cache import EngineCache, split_cache_ref

    cache_url, name_ref = split_cache_ref(engine_ref)
    cache = EngineCache(cache_url)
    return cache, cache.resolve(name_ref)


def _verified(engine_dir: Path, key: str) -> bool:
    """True when ``engine_dir`` is an engine that passes :func:`verify_engine` and (when its manifest
    records one) carries cache key ``key``."""
    from kilnlm.runtime.engine import verify_engine

    if not (engine_dir / "manifest.json").is_file():
        return False
    try:
        manifest = verify_engine(engine_dir)
    except EngineError:
        return False
    recorded = getattr(manifest, "cache_key", None)
    return recorded is None or recorded == key


def materialize_cached_engine(engine_ref: str, cache_key: str | None, engine_cache_dir: Path,
                              log: Callable[[str], None] = lambda message: None) -> ServedEngine:
    """Return a verified local copy of the engine ``engine_ref`` (pinned to ``cache_key`` when given)
    under ``engine_cache_dir/<key>/``, downloading it only when no verified copy is there.

    Downloads go through ``EngineCache.fetch`` (temporary directory beside the target, sizes and SHA-256
    checked, renamed into place), so a second process fetching the same key at the same time never
    sees a partial copy; a copy that fails verification is renamed aside and removed before fetching.

    Raises:
        EngineError: the reference cannot be resolved or fetched (the message names the reference and
            says what to check: the cache URL, the AWS_* environment of the server, the name:version),
            or the fetched engine does not verify.
    """

    engine_cache_dir = Path(engine_cache_dir).expanduser()
    cache = None
    key = cache_key
    if key is None:
        try:
            cache, key = _resolve_key(engine_ref)
        except KilnError as exc:
            raise EngineError(f"cannot resolve engine reference {engine_ref!r}: {exc}") from None
    local = engine_cache_dir / key
    if _verified(local, key):
        log(f"kilnlm: using the verified local copy {local} of {engine_ref} (key {key})")
        return ServedEngine(local, f"local copy {local} of {engine_ref} (key {key})")
    if local.exists():
        stale = engine_cache_dir / f".stale-{key}-{uuid.uuid4().hex[:8]}"
        log(f"kilnlm: {local} does not verify; fetching {engine_ref} again")
        try:
            os.replace(local, stale)
        except FileNotFoundError:
            pass  # another loader moved the same damaged copy aside first
        shutil.rmtree(stale, ignore_errors=True)
    engine_cache_dir.mkdir(parents=True, exist_ok=True)
    log(f"kilnlm: fetching {engine_ref} (key {key}) into {local}")
    try:
        if cache is None:
            from kilnlm.runtime.distribution.cache import EngineCache, split_cache_ref

            cache = EngineCache(split_cache_ref(engine_ref)[0])
        cache.fetch(key, local)
    except KilnError as exc:
        if not _verified(local, key):  # (a concurrent loader may have placed it meanwhile)
            raise EngineError(f"cannot fetch engine {engine_ref} (key {key}) into {local}: {exc}") from None
    if not _verified(local, key):
        raise EngineError(f"the engine fetched from {engine_ref} into {local} does not verify as key {key}: "
                          "check the cache entry with `kilnlm cache verify`")
    return ServedEngine(local, f"{engine_ref} (key {key}), fetched into {local}", downloaded=True)


def served_trusted_keys(model_dir: str | os.PathLike, params: dict[str, str], environ: dict[str, str] | None = None):
    """The keys a served model's engine must be signed by: the ``trusted_keys`` parameter (a file or
    directory of Ed25519 public keys, absolute or relative to ``model_dir``), else ``$KILNLM_TRUSTED_KEYS``,
    else None (signatures not checked). Raises :class:`~kilnlm.runtime.signing.SigningKeyError` for keys
    that cannot be used."""
    from kilnlm.runtime.signing import resolve_trusted_keys

    path = params.get("trusted_keys") or None
    if path is not None and not Path(path).is_absolute():
        path = Path(model_dir) / path
    return resolve_trusted_keys(path, environ)


def resolve_served_engine(model_dir: str | os.PathLike, version: str | int, params: dict[str, str],
                          log: Callable[[str], None] = lambda message: None,
                          environ: dict[str, str] | None = None) -> ServedEngine:
    """Find the engine a Triton model version serves (order in the module docstring).

    Args:
        model_dir: the model's directory in the repository (Triton's ``args["model_repository"]``).
        version: the model version being loaded (``args["model_version"]``).
        params: the model's ``config.pbtxt`` parameters as strings (``engine_dir``, ``engine_ref``,
            ``engine_cache_dir``; an empty string means "not set").
        log: where progress lines go (the Triton model passes ``pb_utils.Logger.log_info``).
        environ: the environment to read ``KILNLM_ENGINE_CACHE_DIR`` from (default ``os.environ``).

    Raises:
        EngineError: nothing names an engine, a pointer is malformed, or a cache reference cannot be
            resolved / fetched / verified. (A local directory is verified later, when it is loaded.)
    """
    model_dir = Path(model_dir)
    version_dir = model_dir / str(version)
    cache_dir = Path(params["engine_cache_dir"]) if params.get("engine_cache_dir") else \
        default_engine_cache_dir(environ)
    if (version_dir / ENGINE_SUBDIR).is_dir():
        return ServedEngine(version_dir / ENGINE_SUBDIR, f"version directory {version_dir / ENGINE_SUBDIR}")
    if (version_dir / POINTER_NAME).is_file():
        pointer = EnginePointer.read(version_dir / POINTER_NAME)
        return materialize_cached_engine(pointer.engine_ref, pointer.cache_key, cache_dir, log)
    if params.get("engine_ref"):
        return materialize_cached_engine(params["engine_ref"], None, cache_dir, log)
    if params.get("engine_dir"):
        engine_dir = Path(params["engine_dir"])
        if not engine_dir.is_absolute():
            engine_dir = model_dir / engine_dir
        return ServedEngine(engine_dir, f"parameter engine_dir {engine_dir}")
    raise EngineError(
        f"model version {version_dir} names no engine: deploy one with `kilnlm deploy REF --model-repository "
        f"{model_dir.parent}`, or set the engine_dir (local directory) or engine_ref (cache reference) "
        f"parameter in {model_dir / 'config.pbtxt'}")


def version_speculative_config(model_dir: str | os.PathLike, version: str | int) -> str | None:
    """The ``speculative_config`` JSON a deployed version serves with: ``<model dir>/<version>/``
    ``speculative_config.json``, a relative draft ``model`` (``draft``, as `kilnlm deploy` writes it) made
    absolute under the version directory; None when the version has no such file.

    Raises:
        EngineError: the file cannot be read or is not a valid ``speculative_config`` (the message names it).
    """
    from kilnlm.runtime.speculative import resolve_draft_model

    version_dir = Path(model_dir) / str(version)
    path = version_dir / SPECULATIVE_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return resolve_draft_model(path.read_text(), version_dir)
    except (OSError, UnicodeDecodeError, KilnError) as exc:
        raise EngineError(f"{path}: {exc}: deploy the version again with `kilnlm deploy REF --speculative-config "
                          "JSON`, or remove the file to serve without speculation") from None
