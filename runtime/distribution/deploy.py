"""`kilnlm deploy`: write (or update) a Triton model repository whose model versions are engine versions.

Layout written for ``kilnlm deploy REF --model-repository DIR`` (TensorRT-LLM's ``inflight_batcher_llm``
model set, names fixed so that TensorRT-LLM's clients work)::

    DIR/
      tensorrt_llm/
        config.pbtxt          the template's, engine_dir "" (each version names its engine)
        1/  model.py          the template's tensorrt_llm/1/model.py (a copy per version, as Triton wants)
            engine/           a local engine directory, hard-linked (copied across file systems), or
            engine.json       a pointer to a cache reference, resolved when the model loads
            speculative_config.json   with --speculative-config: the version's speculative decoding, over
            draft/            the model's parameter; a draft method's engine is copied here (always a copy)
        2/  ...               the next deploy: Triton serves the highest, and a rollback is removing it
      preprocessing/          the template's, written once, with tokenizer/ (the first engine's tokenizer
      postprocessing/           files; a later engine with another tokenizer is refused)
      ensemble/, tensorrt_llm_bls/   the template's, written once

Every version directory also holds a small *file* named ``__pycache__``: the Python backend's stub ignores
PYTHONDONTWRITEBYTECODE and would write ``<version>/__pycache__/model.*.pyc`` when it imports model.py,
which a server polling the repository (``--model-control-mode=poll``) takes for a changed model and
loads a second time; Python skips writing bytecode where that directory cannot be created.

REF is a local engine directory, or a cache reference (``s3://bucket/prefix/name:version``,
``/local/cache/name:latest``, ``<cache url>/<key>``; ``name:version`` alone with ``--cache URL``). A cache
reference becomes a pointer (``engine.json``: the reference and the key it resolved to, so the version
keeps serving that exact engine even when the name is tagged again) unless ``copy_engine`` is set; see
:mod:`kilnlm.runtime.distribution.engine_source` for how the served model resolves it. Either way the
engine is verified (:func:`kilnlm.runtime.engine.verify_engine`; a cache reference is fetched into a
temporary directory for it) before anything is written to the repository.

Writes are atomic: a new model, or a new version of a model, is assembled in a staging directory beside
the repository and renamed into it, so that the rename is the only change a polling Triton sees. When
beside the repository is another file system, a new model is assembled in the repository as
``.kilnlm-staging-*`` (Triton would report that directory as a broken model only if it scanned the
repository during those seconds) and a new version in the model directory (Triton ignores non-numeric
version directories, but may load the new version a second time when the staging directory's removal
changes the model directory). A failed deploy leaves the repository as it was.

The repository template (the ``model_repository/`` of kilnlm) is found by :func:`locate_template`.
Never imports kilnlm.builder or transformers.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from kilnlm.runtime.distribution.engine_source import (DRAFT_SUBDIR, ENGINE_SUBDIR, POINTER_NAME,
                                                       SPECULATIVE_CONFIG_NAME, EnginePointer)
from kilnlm.runtime.errors import EngineError, KilnError
from kilnlm.runtime.manifest import Manifest
from kilnlm.runtime.signing import TrustedKeys

TEMPLATE_ENV = "KILNLM_MODEL_REPOSITORY_TEMPLATE"
TEMPLATE_MODEL = "tensorrt_llm"  # the LLM model (decoupled, hosts the executor): one version per engine
TOKENIZER_MODELS = ("preprocessing", "postprocessing")  # written once, each with the engine's tokenizer/
TEXT_MODELS = ("ensemble", "tensorrt_llm_bls")  # written once, as in the template
TOKENIZER_SUBDIR = "tokenizer"
MODEL_FILE = "model.py"
PYCACHE_BLOCKER = "__pycache__"
PYCACHE_BLOCKER_TEXT = ("Written by `kilnlm deploy`: a file, not a directory, so that Python writes no bytecode "
                        "here (a Triton server polling the repository would take it for a changed model).\n")
CONFIG_FILE = "config.pbtxt"
STAGING_PREFIX = ".kilnlm-staging-"


class DeployError(KilnError):
    """A deploy that cannot be done; the message says what to change. Nothing was written."""


@dataclasses.dataclass
class DeployConfig:
    """What to deploy, and where.

    Attributes:
        ref: a local engine directory or a cache reference (see the module docstring).
        model_repository: the Triton model repository to write (created if absent).
        version: the version number to write; None = highest existing version + 1 (1 for a new model).
        cache_url: the cache a bare ``name:version`` / key ``ref`` is looked up in (None: ``ref`` must be
            a local engine directory or a full cache reference).
        copy_engine: store a cache reference's engine files in the version directory instead of a pointer.
        template: the model repository template; None = :func:`locate_template`.
        trusted_keys: a :class:`~kilnlm.runtime.signing.TrustedKeys` the engine's signature must match
            (None: not checked). The served model checks it again when it loads the engine, against its
            own ``trusted_keys`` parameter or ``$KILNLM_TRUSTED_KEYS``.
        speculative_config: vLLM's ``speculative_config`` JSON (:mod:`kilnlm.runtime.speculative`) the
            version serves with, over the model's parameter; a ``draft`` method's ``model`` is a local
            engine directory or a cache reference, verified as ``ref`` is (the same trusted keys), checked
            to share the engine's tokenizer, and copied into the version as ``draft/``. None: the version
            has none.
    """

    ref: str
    model_repository: Path
    version: int | None = None
    cache_url: str | None = None
    copy_engine: bool = False
    template: Path | None = None
    trusted_keys: TrustedKeys | None = None
    speculative_config: str | None = None


@dataclasses.dataclass(frozen=True)
class DeployResult:
    """What a deploy wrote.

    Attributes: ``model_dir`` (DIR/tensorrt_llm); ``version`` and ``version_dir``; ``mode`` ("copy" or
    "pointer"); ``engine_ref`` (the cache reference, None for a local directory); ``cache_key`` (the key
    the engine is stored under, when known); ``created_model`` (True when the model set was new);
    ``companion_dirs`` (the other models written with it, empty when they existed already);
    ``speculative_config`` (the JSON written into the version, its draft ``model`` the version's
    ``draft``; None without one)."""

    model_dir: Path
    version: int
    version_dir: Path
    mode: str
    engine_ref: str | None
    cache_key: str | None
    created_model: bool
    companion_dirs: tuple[Path, ...] = ()
    speculative_config: str | None = None


# ------------------------------------------------------------------------------------------- template
def locate_template(explicit: str | os.PathLike | None = None) -> Path:
    """Return the model repository template (a directory holding ``tensorrt_llm/`` and its companions).

    Looked for, in order: ``explicit``; ``$KILNLM_MODEL_REPOSITORY_TEMPLATE``; the installed package data
    ``kilnlm.model_repository`` (wheels ship the repository there); the ``model_repository/`` beside the
    ``runtime/`` directory this module's package lives in (a source checkout).

    Raises:
        DeployError: none of them holds ``tensorrt_llm/config.pbtxt`` and ``tensorrt_llm/1/model.py``.
    """
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(Path(explicit))
    elif os.environ.get(TEMPLATE_ENV):
        candidates.append(Path(os.environ[TEMPLATE_ENV]))
    else:
        try:
            spec = importlib.util.find_spec("kilnlm.model_repository")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            candidates.extend(Path(p) for p in spec.submodule_search_locations)
        candidates.append(Path(__file__).resolve().parents[2] / "model_repository")
    for candidate in candidates:
        if (candidate / TEMPLATE_MODEL / CONFIG_FILE).is_file() and \
                (candidate / TEMPLATE_MODEL / "1" / MODEL_FILE).is_file():
            return candidate
    raise DeployError(
        f"no kilnlm model repository template found (looked in {', '.join(map(str, candidates))}): "
        f"reinstall kilnlm, or point {TEMPLATE_ENV} at a copy of kilnlm's model_repository/")


def _replace_once(text: str, pattern: str, replacement: str, what: str, source: Path) -> str:
    new_text, count = re.subn(pattern, lambda m: m.group(1) + replacement, text, count=1, flags=re.M)
    if count != 1:
        raise DeployError(f"{source} has no {what} to set: is it kilnlm's template? "
                          f"(set {TEMPLATE_ENV} to kilnlm's model_repository/)")
    return new_text


def _parameter_pattern(key: str) -> str:
    return r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*)"[^"]*"'


def render_model_config(template: Path) -> str:
    """The deployed ``config.pbtxt`` of ``tensorrt_llm``: the template's, with the version policy made
    explicit (serve the highest version only) and ``engine_dir`` emptied (each version names its engine)."""
    source = template / TEMPLATE_MODEL / CONFIG_FILE
    text = _replace_once(source.read_text(), _parameter_pattern("engine_dir"), '""', "engine_dir parameter", source)
    if "version_policy" not in text:
        text = text.rstrip("\n") + ("\n\n# Written by `kilnlm deploy`: each numbered directory is one engine "
                                    "version; the highest is served,\n# and removing it rolls back.\n"
                                    "version_policy: { latest: { num_versions: 1 } }\n")
    return text


def _write_companions(template: Path, engine_dir: Path, staging: Path) -> list[str]:
    """Stage the models written once (``TOKENIZER_MODELS`` with the engine's tokenizer files, ``TEXT_MODELS``)
    as the template has them. Returns their names."""
    for name in (*TOKENIZER_MODELS, *TEXT_MODELS):
        shutil.copytree(template / name, staging / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (staging / name / "1" / PYCACHE_BLOCKER).write_text(PYCACHE_BLOCKER_TEXT)
    for name in TOKENIZER_MODELS:
        shutil.copytree(engine_dir / TOKENIZER_SUBDIR, staging / name / TOKENIZER_SUBDIR)
    return [*TOKENIZER_MODELS, *TEXT_MODELS]


def _check_same_tokenizer(repository: Path, engine_dir: Path) -> None:
    """Refuse an engine whose tokenizer differs from the one the repository's preprocessing holds."""
    deployed = repository / TOKENIZER_MODELS[0] / TOKENIZER_SUBDIR / "tokenizer.json"
    new = engine_dir / TOKENIZER_SUBDIR / "tokenizer.json"
    if deployed.is_file() and new.is_file() and deployed.read_bytes() != new.read_bytes():
        raise DeployError(f"the engine's tokenizer differs from the one {repository} serves ({deployed}): "
                          "deploy an engine of another model into its own --model-repository")


# -------------------------------------------------------------------------------------------- engines
def _link_or_copy(src: str, dst: str) -> str:
    """Hard-link ``src`` to ``dst`` (an engine's files are never modified in place), copying when the
    two are on different file systems or links are not allowed."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def is_cache_ref(ref: str) -> bool:
    """True when ``ref`` is not an existing local directory (then it must be a cache reference)."""
    return not Path(ref).expanduser().is_dir()


def _full_ref(config: DeployConfig) -> str:
    """``config.ref`` as a full cache reference (``<cache url>/<ref>`` when ``--cache`` is given and the
    reference has no cache part)."""
    ref = config.ref
    if config.cache_url and "/" not in ref:
        return config.cache_url.rstrip("/") + "/" + ref
    return ref


@dataclasses.dataclass
class _VerifiedEngine:
    """An engine that passed verification: ``path`` (the local directory, or its fetched copy), its
    ``manifest``, and, for a cache reference, the full reference and the key it resolved to."""

    path: Path
    engine_ref: str | None
    cache_key: str | None
    manifest: Manifest


def _verify_engine_ref(config: DeployConfig, scratch: Path) -> _VerifiedEngine:
    """Verify the engine ``config.ref`` names, fetching a cache reference into ``scratch`` for it.
    Raises :class:`DeployError` (refused engine, unresolvable or unfetchable reference)."""
    from kilnlm.runtime.engine import verify_engine

    if not is_cache_ref(config.ref):
        source = Path(config.ref).expanduser()
        try:
            manifest = verify_engine(source, config.trusted_keys)
        except EngineError as exc:
            raise DeployError(f"refusing to deploy {source}: {exc}") from None
        return _VerifiedEngine(source, None, manifest.cache_key, manifest)

    from kilnlm.runtime.distribution.cache import EngineCache, split_cache_ref

    ref = _full_ref(config)
    try:
        cache_url, name_ref = split_cache_ref(ref)
        cache = EngineCache(cache_url)
        key = cache.resolve(name_ref)
        fetched = scratch / "engine"
        cache.fetch(key, fetched)
        manifest = verify_engine(fetched, config.trusted_keys)
    except KilnError as exc:
        if "://" in ref:
            raise DeployError(f"refusing to deploy {ref}: {exc}") from None
        raise DeployError(f"refusing to deploy {config.ref}: no engine directory {config.ref} exists, and as "
                          f"cache reference {ref}: {exc}") from None
    return _VerifiedEngine(fetched, ref, key, manifest)


def _parse_speculative_config(text: str | None):
    """``text`` as a :class:`~kilnlm.runtime.speculative.SpeculativeConfig` (None for None). Raises
    :class:`DeployError` for an invalid one."""
    if text is None:
        return None
    from kilnlm.runtime.speculative import parse_speculative_config

    try:
        return parse_speculative_config(text)
    except KilnError as exc:
        raise DeployError(f"--speculative-config: {exc}") from None


def _verify_draft(config: DeployConfig, draft_model: str, engine: _VerifiedEngine, scratch: Path) -> _VerifiedEngine:
    """Verify the draft engine ``draft_model`` names (as :func:`_verify_engine_ref` does ``config.ref``) and
    check that it shares ``engine``'s tokenizer and vocabulary. Raises :class:`DeployError`."""
    scratch.mkdir()
    try:
        draft = _verify_engine_ref(dataclasses.replace(config, ref=draft_model), scratch)
    except DeployError as exc:
        raise DeployError(f"speculative_config's draft model: {exc}") from None
    tokenizer = Path(TOKENIZER_SUBDIR) / "tokenizer.json"
    if (draft.path / tokenizer).read_bytes() != (engine.path / tokenizer).read_bytes() or \
            draft.manifest.model.vocab_size != engine.manifest.model.vocab_size:
        raise DeployError(f"speculative_config's draft model {draft_model} has another tokenizer than the engine "
                          f"{config.ref}: a draft model must share the target's tokenizer (e.g. the int4_awq engine "
                          "of the same checkpoint)")
    return draft


def _speculative_json(text: str, draft: _VerifiedEngine | None) -> str:
    """What the version's ``speculative_config.json`` holds: ``text``'s fields, a draft's ``model`` the
    version's ``draft/`` (relative, so that the version directory can move)."""
    fields = json.loads(text)
    if draft is not None:
        fields["model"] = DRAFT_SUBDIR
    return json.dumps(fields, indent=2, sort_keys=True) + "\n"


def _write_version(engine: _VerifiedEngine, copy_engine: bool, template: Path, version_dir: Path,
                   speculative_json: str | None, draft: _VerifiedEngine | None) -> str:
    """Fill ``version_dir`` with the template's model.py, the engine (hard-linked or copied) or its
    pointer, and the speculative configuration with its draft engine (hard-linked or copied). Returns the
    mode, "copy" or "pointer"."""
    version_dir.mkdir()
    shutil.copy2(template / TEMPLATE_MODEL / "1" / MODEL_FILE, version_dir / MODEL_FILE)
    (version_dir / PYCACHE_BLOCKER).write_text(PYCACHE_BLOCKER_TEXT)
    if draft is not None:
        shutil.copytree(draft.path, version_dir / DRAFT_SUBDIR, copy_function=_link_or_copy)
    if speculative_json is not None:
        (version_dir / SPECULATIVE_CONFIG_NAME).write_text(speculative_json)
    if engine.engine_ref is not None and not copy_engine:
        pointer = EnginePointer(engine_ref=engine.engine_ref, cache_key=engine.cache_key)
        (version_dir / POINTER_NAME).write_text(pointer.to_json())
        return "pointer"
    shutil.copytree(engine.path, version_dir / ENGINE_SUBDIR, copy_function=_link_or_copy)
    return "copy"


# --------------------------------------------------------------------------------------- repository
def existing_versions(model_dir: Path) -> list[int]:
    """The version numbers Triton sees in ``model_dir`` (numeric directory names not starting with 0)."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir()
                  if p.is_dir() and p.name.isdigit() and not p.name.startswith("0"))


def _check_existing_model(model_dir: Path) -> None:
    config = model_dir / CONFIG_FILE
    if not config.is_file() or not re.search(r'backend:\s*"python"', config.read_text()):
        raise DeployError(f"{model_dir} exists but is not a kilnlm model (no python-backend {CONFIG_FILE}): "
                          "pick another --model-repository")


def _staging_root(repository: Path, fallback: Path) -> Path:
    """A fresh directory on ``repository``'s file system, outside it when possible, else in ``fallback``
    (the repository for a new model, the model's directory for a new version). Triton treats every
    directory in a repository as a model, hidden ones included, and a polling Triton reloads a model whose
    directory changed: staging a new version in the model's directory made removing the staging directory,
    after the version's rename, a second change that could load the new version twice."""
    parent = repository.resolve().parent
    if os.access(parent, os.W_OK) and parent.stat().st_dev == repository.stat().st_dev:
        return Path(tempfile.mkdtemp(prefix=f".{repository.name}{STAGING_PREFIX}", dir=parent))
    return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=fallback))


def _rename_new(src: Path, dst: Path, what: str) -> None:
    """Rename ``src`` to ``dst``, refusing (not merging) when ``dst`` appeared meanwhile."""
    if dst.exists():
        raise DeployError(f"{dst} exists already ({what}): another deploy wrote it; run the deploy again")
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise DeployError(f"{dst} exists already ({what}): another deploy wrote it; run the deploy "
                              "again") from None
        raise


def deploy(config: DeployConfig) -> DeployResult:
    """Write one engine version into ``config.model_repository`` (layout in the module docstring).

    Raises:
        DeployError: an invalid version, a version that exists, an engine refused by verification (or whose
            tokenizer differs from the deployed one), a cache reference that cannot be resolved or fetched,
            an invalid speculative configuration or a draft engine refused as the engine would be (or
            whose tokenizer differs from the engine's), or a directory in the way. The repository is
            unchanged when it is raised.
    """
    if config.version is not None and config.version < 1:
        raise DeployError(f"--version {config.version}: Triton versions are integers >= 1")
    speculative = _parse_speculative_config(config.speculative_config)
    template = locate_template(config.template)
    repository = Path(config.model_repository).expanduser()
    model_dir = repository / TEMPLATE_MODEL
    created_model = not model_dir.exists()
    if not created_model:
        _check_existing_model(model_dir)
    version = config.version or (max(existing_versions(model_dir), default=0) + 1)
    if (model_dir / str(version)).exists():
        raise DeployError(f"{model_dir / str(version)} exists: pass another --version (or omit it for "
                          f"{max(existing_versions(model_dir), default=0) + 1}), or remove that version first")

    # Verify (a cache reference: fetched into scratch space) before the repository is touched.
    with tempfile.TemporaryDirectory(prefix="kilnlm-deploy-") as scratch_dir:
        engine = _verify_engine_ref(config, Path(scratch_dir))
        _check_same_tokenizer(repository, engine.path)
        draft = None if speculative is None or speculative.method != "draft" else \
            _verify_draft(config, speculative.model, engine, Path(scratch_dir) / DRAFT_SUBDIR)
        speculative_json = None if speculative is None else _speculative_json(config.speculative_config, draft)
        companions = [] if created_model is False else \
            [n for n in (*TOKENIZER_MODELS, *TEXT_MODELS) if not (repository / n).exists()]
        created_repository = not repository.exists()
        repository.mkdir(parents=True, exist_ok=True)
        staging = _staging_root(repository, repository if created_model else model_dir)
        deployed = False
        try:
            staged_model = staging / TEMPLATE_MODEL
            if created_model:
                staged_model.mkdir()
                (staged_model / CONFIG_FILE).write_text(render_model_config(template))
                mode = _write_version(engine, config.copy_engine, template, staged_model / str(version),
                                      speculative_json, draft)
                _write_companions(template, engine.path, staging)
            else:
                mode = _write_version(engine, config.copy_engine, template, staging / str(version),
                                      speculative_json, draft)
            # The renames: the LLM model (or its new version) first, then the models that call it.
            if created_model:
                _rename_new(staged_model, model_dir, "the model")
            else:
                _rename_new(staging / str(version), model_dir / str(version), f"version {version}")
            deployed = True
            for name in companions:
                if not (repository / name).exists():  # (a concurrent deploy may have written it)
                    _rename_new(staging / name, repository / name, f"the {name} model")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if created_repository and not deployed and not any(repository.iterdir()):
                repository.rmdir()  # leave no empty repository behind a failed deploy
    return DeployResult(model_dir=model_dir, version=version, version_dir=model_dir / str(version),
                        mode=mode, engine_ref=engine.engine_ref, cache_key=engine.cache_key,
                        created_model=created_model, companion_dirs=tuple(repository / n for n in companions),
                        speculative_config=speculative_json)
