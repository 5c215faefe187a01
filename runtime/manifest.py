"""The engine artifact's manifest: the contract between builder and runtime.

An engine is a directory::

    engine/
      manifest.json          this file's format (written last by the builder)
      model.pt2              CPU target: the AOTInductor package (TensorRT target: rank0.engine)
      rank0.pt2, rank1.pt2   instead, a --tp-size N engine: rank r's shard (engine_files lists them in rank order)
      tokenizer/             tokenizer.json, tokenizer_config.json, chat template, ...

``manifest.json`` holds the format version, the model and build configuration, the plugins (with
versions) the engine calls, toolchain versions, the source checkpoint's digest, generation defaults and
the size and SHA-256 of every other file. :func:`verify_engine` checks all of it *before* anything in the
directory is loaded: loading a compiled engine is executing native code. Nothing here is pickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import uuid
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kilnlm.runtime.errors import EngineError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"  # an Ed25519 signature of manifest.json (kilnlm.runtime.signing), not listed in it
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KB (SmolLM2: ~4 KB); anything larger is refused unread
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
SUPPORTED_FORMAT_VERSIONS = (1,)


@dataclass
class ModelConfig:
    """The network's shape. ``head_dim`` is per attention head; RoPE ``inv_freq`` is derived by the builder
    from ``rope_theta`` and ``rope_scaling`` (Hugging Face's meaning)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None


@dataclass
class BuildConfig:
    """How the engine was built (TensorRT-LLM's meanings for the limits)."""

    qformat: str  # a --qformat name (kilnlm.builder.formats.FORMATS)
    dtype: str  # activation / KV-cache dtype: "float32" | "bfloat16"
    kv_cache_dtype: str  # "float32" | "bfloat16" (= dtype), or "fp8" | "int8" (8-bit pool, per-layer scales in the engine)
    max_batch_size: int  # sequences per forward
    max_num_tokens: int  # packed tokens per forward (context chunks + generation tokens)
    max_seq_len: int  # prompt + generated tokens of one sequence
    tokens_per_block: int  # tokens per paged-KV block
    target: str  # a --target name; selects the runtime backend (kilnlm.runtime.backends.ENGINE_BACKENDS)
    # HF names of the decoder linears left in `dtype` by --auto-quantize-bits (TensorRT-LLM's
    # quantization.exclude_modules); empty when every linear is in the format
    exclude_modules: list[str] = field(default_factory=list)
    tp_size: int = 1  # tensor-parallel ranks (TensorRT-LLM's mapping.tp_size): one compiled engine per rank

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)


def rank_model_config(model: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape one tensor-parallel rank computes with: ``num_heads``, ``num_kv_heads`` and
    ``intermediate_size`` divided by ``tp_size`` (the rank's attention and paged KV pool); hidden size and
    vocabulary unchanged (every rank returns the full logits). ``model`` itself for tp_size 1."""
    if tp_size == 1:
        return model
    return dataclasses.replace(model, num_heads=model.num_heads // tp_size, num_kv_heads=model.num_kv_heads // tp_size,
                               intermediate_size=model.intermediate_size // tp_size)


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None


@dataclass
class Manifest:
    model: ModelConfig
    build: BuildConfig
    generation: GenerationDefaults
    plugins: dict[str, int]  # plugin name -> version the engine was compiled against
    toolchain: dict[str, str]  # kilnlm, torch, target compiler, cpu_isa, ...
    source_checkpoint_digest: str  # "sha256:<hex>" over the checkpoint's config and tensor files
    engine_file: str = "model.pt2"  # relative path of the compiled engine (of rank 0 in a tensor-parallel engine)
    engine_files: list[str] = field(default_factory=list)  # tp_size > 1: rank r's compiled engine at [r]
    format_version: int = FORMAT_VERSION
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # rel path -> {"size", "sha256"}
    # The engine cache's key (64 hex digits, builder/cache_key.py) and the inputs it digests; None in
    # engines built before the cache existed (they still parse).
    cache_key: str | None = None
    cache_key_inputs: dict[str, Any] | None = None

    def rank_engine_file(self, rank: int) -> str:
        """The compiled engine of tensor-parallel rank ``rank`` (``engine_file`` in a one-rank engine).
        Raises :class:`EngineError` when the manifest does not list one engine per rank."""
        files = self.engine_files or [self.engine_file]
        if len(files) != self.build.tp_size or not 0 <= rank < len(files):
            raise EngineError(f"manifest lists {len(files)} rank engine(s) ({', '.join(files)}) for build.tp_size "
                              f"{self.build.tp_size}: the engine is malformed, rebuild it")
        return files[rank]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        """The manifest in ``data`` (parsed JSON). Raises KeyError / TypeError / ValueError for missing or
        malformed fields, among them a file path that is not a plain relative path inside the engine
        directory (:func:`check_engine_path`) and a size or SHA-256 that is not one."""
        files = dict(data.get("files", {}))
        for rel, meta in files.items():
            check_engine_path(rel)
            if (not isinstance(meta, dict) or type(meta.get("size")) is not int or meta["size"] < 0
                    or not isinstance(meta.get("sha256"), str) or not _SHA256_RE.fullmatch(meta["sha256"])):
                raise ValueError(f"files[{rel!r}] is {meta!r}: expected {{'size': bytes, 'sha256': 64 hex digits}}")
        engine_file = data.get("engine_file", "model.pt2")
        engine_files = list(data.get("engine_files", []))
        for rel in [engine_file, *engine_files]:
            check_engine_path(rel)
        return cls(
            model=ModelConfig(**data["model"]),
            build=BuildConfig(**data["build"]),
            generation=GenerationDefaults(**data["generation"]),
            plugins=dict(data["plugins"]),
            toolchain=dict(data["toolchain"]),
            source_checkpoint_digest=data["source_checkpoint_digest"],
            engine_file=engine_file,
            engine_files=engine_files,
            format_version=int(data["format_version"]),
            files=files,
            cache_key=data.get("cache_key"),
            cache_key_inputs=data.get("cache_key_inputs"),
        )


def check_engine_path(rel: Any) -> None:
    """Raise ValueError unless ``rel`` is a plain relative POSIX path inside an engine directory: no
    absolute path, no ``..``, ``.`` or empty component, no backslash or NUL, and not the manifest or its
    signature (what a hostile manifest would use to read or write outside the directory)."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel or rel.startswith("/") or \
            any(part in ("", ".", "..") for part in rel.split("/")) or rel in (MANIFEST_NAME, SIGNATURE_NAME):
        raise ValueError(f"file path {rel!r} is not a relative path inside the engine directory")


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of the file at ``path``: the digest :func:`prehash_engine_files` computed for it, if
    the file is the same one, unchanged since (device, inode, size, modification and change times), else
    computed now. Raises OSError for a file that cannot be read."""
    with _prehashed_lock:
        ahead = _prehashed.pop(os.path.abspath(path), None)
    if ahead is not None:
        identity, digest = ahead
        if digest.result() is not None and file_identity(path) == identity:
            return digest.result()
    return _sha256_now(path)


def _sha256_now(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> str:
    # Large chunks: the read and the hash release the GIL, and a thread hashing beside another that holds
    # it (prehash_engine_files beside `import torch`) waits for it once per chunk. Not mmap: a file
    # truncated while mapped would kill the process with SIGBUS.
    digest = hashlib.sha256()
    chunk = memoryview(bytearray(chunk_bytes))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            digest.update(chunk[:n])
    return digest.hexdigest()


def file_identity(path: str | os.PathLike) -> tuple[int, ...]:
    """What changes when the entry at ``path`` (not followed if a link) is replaced or written: its type,
    device, inode, size, and the modification and change times in nanoseconds (the change time also
    moves when the modification time is set back). Raises OSError."""
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


# Digests computed ahead by prehash_engine_files, by absolute path: (the file's identity before it was
# read, a Future of its hex digest or None where it could not be read). sha256_file takes each once.
_prehashed: dict[str, tuple[tuple[int, ...], Future]] = {}
_prehashed_lock = threading.Lock()


def prehash_engine_files(engine_dir: str | os.PathLike) -> None:
    """Start computing the SHA-256 of every file ``engine_dir``'s manifest lists, on a background thread,
    for :func:`verify_files` (and so :func:`kilnlm.runtime.engine.verify_engine` and
    ``Executor.from_engine_dir``) to take instead of reading the files themselves. Call it before
    importing torch, which takes 1.1-2.0 s of a new process on one core (an Intel Xeon with 2 vCPUs),
    leaving the other idle: the digests need no torch, and hashlib releases the GIL while it hashes
    (SmolLM2 bf16's 272 MB, 0.24 s there, overlap the import whole). Verification stays whole: a digest
    stands in only for the same file unchanged since it was read, and only once; nothing is trusted that
    :func:`verify_files` does not compare with the manifest. Never raises: a directory without a readable
    manifest starts nothing, and a file that cannot be read (or is not a regular file) is left for
    :func:`verify_files` to report."""
    root = Path(engine_dir)
    try:
        listed = parse_manifest(read_manifest_bytes(root), root / MANIFEST_NAME).files
    except (EngineError, OSError, ValueError):
        return
    jobs = []
    with _prehashed_lock:
        for rel in sorted(listed):
            path = os.path.abspath(root / rel)  # read and looked up by the same name, whatever the cwd later
            try:
                identity = file_identity(path)
            except OSError:
                continue
            if identity[0] != stat.S_IFREG:  # a link, a FIFO or a device: verify_files refuses it unread
                continue
            digest: Future = Future()
            _prehashed[path] = identity, digest
            jobs.append((path, digest))

    def run() -> None:
        for path, digest in jobs:
            try:
                digest.set_result(_sha256_now(path))
            except OSError:
                digest.set_result(None)

    threading.Thread(target=run, name="kilnlm-prehash", daemon=True).start()


def write_manifest(engine_dir: str | os.PathLike, manifest: Manifest) -> Manifest:
    """Record size and SHA-256 of every file under ``engine_dir`` (except the manifest and its signature) in
    ``manifest.files`` and write ``manifest.json``. Call it last, after every other file is in place."""
    root = Path(engine_dir)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in (MANIFEST_NAME, SIGNATURE_NAME):
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest.files = files
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, root / MANIFEST_NAME)
    return manifest


def read_manifest(engine_dir: str | os.PathLike) -> Manifest:
    """Parse ``manifest.json`` without checking files. Raises :class:`EngineError` if it is missing,
    unparsable or of an unsupported format version."""
    root = Path(engine_dir)
    return parse_manifest(read_manifest_bytes(root), root / MANIFEST_NAME)


def read_manifest_bytes(engine_dir: str | os.PathLike) -> bytes:
    """The bytes of ``engine_dir/manifest.json``. Raises :class:`EngineError` if the directory or the file is
    missing."""
    root = Path(engine_dir)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise EngineError(f"engine directory {root} does not exist: build one with `kilnlm build`")
    if not path.is_file():
        raise EngineError(f"{path} is missing: {root} is not a kilnlm engine (or its build did not finish); rebuild it with `kilnlm build`")
    if path.is_symlink():
        raise EngineError(f"{path} is a symbolic link: an engine holds only regular files; copy the engine instead of linking it")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise EngineError(f"{path} is {size:,} bytes (at most {MAX_MANIFEST_BYTES:,}): not a kilnlm manifest; "
                          "the engine is refused")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise EngineError(f"{path} cannot be read ({exc.strerror}): check the engine directory's permissions") from None


def parse_manifest(raw: bytes, path: Path) -> Manifest:
    """The manifest in ``raw`` (the bytes of ``path``, named in errors). Raises :class:`EngineError` if it is
    unparsable or of an unsupported format version."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path} is not valid JSON ({exc}): the engine is corrupt; rebuild it with `kilnlm build`") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise EngineError(
            f"{path}: engine format version {version!r} is not supported by this kilnlm "
            f"(supports {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}): rebuild the engine with this kilnlm "
            f"or install the kilnlm version that built it ({data.get('toolchain', {}).get('kilnlm', 'unknown') if isinstance(data, dict) else 'unknown'})"
        )
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{path} is malformed ({exc!r}): rebuild the engine with `kilnlm build`") from None


def verify_files(engine_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Check that the directory holds only regular files and directories (no symbolic link, which could
    point outside it), that every file listed in the manifest exists with its recorded size and SHA-256,
    and that no unlisted file sits in the directory. Raises :class:`EngineError` naming the first offending
    file."""
    root = Path(engine_dir)
    listed = set(manifest.files) | {MANIFEST_NAME, SIGNATURE_NAME}
    unlisted = []  # reported after the listed files are checked
    for dirpath, dirnames, filenames in os.walk(root):  # never follows a link
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise EngineError(f"engine file {path} is a symbolic link: an engine holds only regular files; "
                                  "rebuild it or pull it again from the cache")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise EngineError(f"engine file {path} is not a regular file: remove it or rebuild the engine")
            if stat.S_ISREG(mode) and path.relative_to(root).as_posix() not in listed:
                unlisted.append(path)
    for rel, meta in sorted(manifest.files.items()):
        path = root / rel
        if not path.is_file():
            raise EngineError(f"engine file {path} is missing: the engine is incomplete; rebuild it or pull it again from the cache")
        size = path.stat().st_size
        if size != meta["size"]:
            raise EngineError(
                f"engine file {path} is {size:,} bytes but the manifest records {meta['size']:,}: "
                "the engine is truncated or modified; rebuild it or pull it again"
            )
        if sha256_file(path) != meta["sha256"]:
            raise EngineError(
                f"engine file {path} does not match its SHA-256 in the manifest: the engine is corrupt or "
                "was modified; rebuild it or pull it again (never edit an engine in place)"
            )
    if unlisted:
        raise EngineError(
            f"engine file {min(unlisted)} is not listed in the manifest: something was added to the engine "
            "directory; remove it or rebuild the engine"
        )
    if manifest.engine_file not in manifest.files:
        raise EngineError(f"{root / MANIFEST_NAME} lists no compiled engine file {manifest.engine_file!r}: rebuild the engine")


def move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished engine directory ``tmp`` to ``output`` (same file system), replacing an
    existing ``output``: the old one is renamed aside first and removed after, so ``output`` is never a
    half-written directory."""
    if output.exists():
        trash = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(output, trash)
        os.replace(tmp, output)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, output)
