"""The object layer under the engine cache: a flat namespace of objects below one root URL (fsspec).

Objects are addressed by ``/``-separated paths relative to the root. Two primitives carry the cache's
atomicity and are implemented per backend:

- :meth:`ObjectStore.upload_file` / :meth:`ObjectStore.write_bytes` make an object appear whole or not at
  all: an S3 PUT (or a completed multipart upload) is atomic; locally the bytes go to a temporary file
  beside the target that is renamed over it.
- ``write_bytes(..., exclusive=True)`` creates an object only if it does not exist: S3 conditional PUT
  (``If-None-Match: *``, honoured by AWS S3, MinIO and moto); locally ``os.link`` of the temporary file,
  which fails if the target exists.

Backends: a local directory (``/path`` or ``file:///path``) and ``s3://bucket/prefix`` (s3fs, imported
only for s3 URLs; endpoint and credentials from the standard AWS environment variables and config files,
e.g. ``AWS_ENDPOINT_URL`` for MinIO / Ceph). Backend errors become :class:`CacheError` with one line that
says what to change.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from kilnlm.runtime.errors import CacheError

# Retries of one S3 request (s3fs's own loop x botocore's): enough for throttling, few enough that an
# unreachable endpoint fails within seconds.
S3_RETRIES = 3
S3_CONNECT_TIMEOUT_S = 5
# Packages whose exceptions are storage failures (translated into CacheError); OSError always is.
_BACKEND_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3")


@dataclass
class ObjectInfo:
    """An object's path relative to the store root, size in bytes and last-modified time (UTC)."""

    path: str
    size_bytes: int
    modified: datetime


def _ssl_import_problem() -> str:
    """Why Python's ``ssl`` module cannot be imported ("" when it can): urllib3 swallows that error and
    s3fs then fails with an unrelated-looking ImportError, so the real cause is added to the message."""
    try:
        import ssl  # noqa: F401
    except ImportError as exc:
        return f"; Python's ssl module cannot be imported: {exc}"
    return ""


class ObjectStore:
    """Objects below ``url`` (a local directory, ``file://`` URL or ``s3://bucket/prefix``)."""

    def __init__(self, url: str | os.PathLike):
        self.url = str(url).rstrip("/") or "/"
        parsed = urlparse(self.url)
        if parsed.scheme in ("", "file"):
            from fsspec.implementations.local import LocalFileSystem

            path = parsed.path if parsed.scheme == "file" else self.url
            if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
                raise CacheError(f"cache URL {self.url!r} names host {parsed.netloc!r}: file:// URLs are local, write file:///abs/path")
            self.local = True
            self.root = str(Path(path).expanduser().absolute())
            self.fs = LocalFileSystem()
        elif parsed.scheme == "s3":
            if not parsed.netloc:
                raise CacheError(f"cache URL {str(url)!r} names no bucket: write s3://bucket/prefix")
            try:
                import s3fs
            except ImportError as exc:
                raise CacheError(f"s3:// caches need s3fs ({exc}{_ssl_import_problem()}): pip install 's3fs' "
                                 "(or kilnlm[s3])") from None
            self.local = False
            self.root = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
            self.fs = s3fs.S3FileSystem(
                skip_instance_cache=True, use_listings_cache=False,
                config_kwargs={"connect_timeout": S3_CONNECT_TIMEOUT_S, "retries": {"max_attempts": 2}},
            )
            self.fs.retries = S3_RETRIES
        else:
            raise CacheError(f"cache URL {self.url!r}: scheme {parsed.scheme!r} is not supported: use a local directory, "
                             "file:///abs/path or s3://bucket/prefix")

    # -- naming -----------------------------------------------------------------------------------------
    def _full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def describe(self, rel: str) -> str:
        """The object's full URL, for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    # -- reads ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail early with a clear :class:`CacheError` if the bucket is missing, the endpoint unreachable or
        the credentials refused. A local cache directory need not exist yet (it is created on write)."""
        if self.local:
            if os.path.exists(self.root) and not os.path.isdir(self.root):
                raise CacheError(f"cache {self.url} is a file: pass a directory (or s3://bucket/prefix) as the cache")
            return
        bucket = self.root.split("/", 1)[0]
        with self._errors(""):
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                raise CacheError(f"cache {self.url}: bucket {bucket!r} does not exist: create it first "
                                 f"(e.g. aws s3 mb s3://{bucket}) or fix the cache URL") from None

    def read_bytes(self, rel: str) -> bytes | None:
        """The object's content, or None if it does not exist."""
        with self._errors(rel):
            try:
                return self.fs.cat_file(self._full(rel))
            except FileNotFoundError:
                return None
            except IsADirectoryError:
                return None

    def stream(self, rel: str, sink: Callable[[bytes], None], chunk_bytes: int = 8 << 20) -> None:
        """Read the object from start to end (one GET on S3, not ranged reads) and hand each chunk of at
        most ``chunk_bytes`` to ``sink``. Raises :class:`CacheError` if the object is missing."""
        missing = CacheError(f"cache object {self.describe(rel)} is missing: the entry is incomplete; push the "
                             "engine again (or remove the entry)")
        with self._errors(rel):
            try:
                if self.local:
                    with open(self._full(rel), "rb") as f:
                        while chunk := f.read(chunk_bytes):
                            sink(chunk)
                else:
                    from fsspec.asyn import sync

                    bucket, key = self._full(rel).split("/", 1)
                    sync(self.fs.loop, self._s3_stream, bucket, key, sink, chunk_bytes)
            except FileNotFoundError:
                raise missing from None

    async def _s3_stream(self, bucket: str, key: str, sink: Callable[[bytes], None], chunk_bytes: int) -> None:
        # One streaming GET: s3fs's file objects read in ranged blocks, ~10x slower here for large objects.
        response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = response["Body"]
        try:
            while chunk := await body.read(chunk_bytes):
                sink(chunk)
        finally:
            body.close()

    def info(self, rel: str) -> ObjectInfo | None:
        """Size and modification time of an object, or None if it does not exist."""
        with self._errors(rel):
            try:
                raw = self.fs.info(self._full(rel))
            except FileNotFoundError:
                return None
        if raw.get("type") != "file":
            return None
        return ObjectInfo(rel, int(raw["size"]), _modified(raw))

    def list_files(self, prefix: str) -> list[ObjectInfo]:
        """Every object below ``prefix`` (recursively), sorted by path."""
        with self._errors(prefix):
            try:
                found = self.fs.find(self._full(prefix), detail=True)
            except FileNotFoundError:
                return []
        strip = len(self.root) + 1
        out = [ObjectInfo(name[strip:], int(raw["size"]), _modified(raw))
               for name, raw in found.items() if raw.get("type", "file") == "file" and name.startswith(self.root + "/")]
        return sorted(out, key=lambda o: o.path)

    def list_children(self, prefix: str) -> list[str]:
        """Names of the objects and "directories" immediately below ``prefix``."""
        with self._errors(prefix):
            try:
                names = self.fs.ls(self._full(prefix), detail=False)
            except FileNotFoundError:
                return []
        base = self._full(prefix).rstrip("/") + "/"
        return sorted(n[len(base):].strip("/") for n in names if n.startswith(base) and n[len(base):].strip("/"))

    # -- writes -----------------------------------------------------------------------------------------
    def upload_file(self, local_path: Path, rel: str) -> None:
        """Copy ``local_path`` to the object ``rel`` atomically (whole or not at all)."""
        with self._errors(rel):
            if self.local:
                target = Path(self._full(rel))
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
                try:
                    shutil.copyfile(local_path, tmp)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                self.fs.put_file(str(local_path), self._full(rel))

    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> bool:
        """Write a small object atomically. With ``exclusive``, create it only if it does not exist yet and
        return False (writing nothing) if it does."""
        with self._errors(rel):
            if not self.local:
                try:
                    self.fs.pipe_file(self._full(rel), data, mode="create" if exclusive else "overwrite")
                except FileExistsError:
                    return False
                return True
            target = Path(self._full(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if not exclusive:
                    os.replace(tmp, target)
                    return True
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    return False
                return True
            finally:
                tmp.unlink(missing_ok=True)

    def remove(self, rel: str) -> None:
        """Remove one object (no error if it is already gone)."""
        with self._errors(rel):
            try:
                self.fs.rm_file(self._full(rel))
            except FileNotFoundError:
                pass

    def remove_tree(self, prefix: str) -> None:
        """Remove every object below ``prefix``."""
        with self._errors(prefix):
            try:
                self.fs.rm(self._full(prefix), recursive=True)
            except FileNotFoundError:
                pass

    def abort_stale_uploads(self, prefix: str, min_age_s: float, dry_run: bool = False) -> list[str]:
        """S3: abort the multipart uploads below ``prefix`` started more than ``min_age_s`` seconds ago (a
        publish killed mid-upload leaves one; its parts are stored, and billed, until it is aborted).
        Returns their object paths. A local store has none."""
        if self.local:
            return []
        bucket, _, root_key = self.root.partition("/")
        full_prefix = f"{root_key}/{prefix}" if root_key else prefix
        now, stale, markers = datetime.now(timezone.utc), [], {}
        with self._errors(prefix):
            while True:
                page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=full_prefix, **markers)
                for upload in page.get("Uploads", []):
                    if (now - upload["Initiated"]).total_seconds() < min_age_s:
                        continue
                    stale.append(upload["Key"][len(root_key) + 1:] if root_key else upload["Key"])
                    if not dry_run:
                        self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                if not page.get("IsTruncated"):
                    return stale
                markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    # -- errors -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _errors(self, rel: str) -> Iterator[None]:
        """Translate backend errors (botocore / OS) into one-line :class:`CacheError` messages."""
        try:
            yield
        except CacheError:
            raise
        except (FileNotFoundError, FileExistsError, IsADirectoryError):
            raise
        except Exception as exc:
            if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] not in _BACKEND_MODULES:
                raise  # a bug, not a storage failure
            raise CacheError(self._explain(exc, rel)) from exc

    def _explain(self, exc: Exception, rel: str) -> str:
        name = type(exc).__name__
        where = self.describe(rel)
        text = str(exc).splitlines()[0] if str(exc) else name
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return (f"cache {self.url}: no usable AWS credentials ({text}): set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials")
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the AWS default"
            return (f"cache {self.url}: cannot reach the S3 endpoint ({text}); endpoint is {endpoint}: "
                    "check AWS_ENDPOINT_URL and that the server is running")
        if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text or "InvalidAccessKeyId" in text \
                or "SignatureDoesNotMatch" in text:
            return (f"cache {where}: access denied ({text}): check the AWS credentials and the bucket policy "
                    "(kilnlm needs s3:GetObject, s3:PutObject, s3:ListBucket, s3:DeleteObject)")
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            return f"cache {self.url}: the bucket does not exist: create it first (e.g. aws s3 mb s3://<bucket>)"
        if isinstance(exc, (NotADirectoryError,)):
            return f"cache {where}: a file is in the way ({text}): pass a directory as the cache"
        return f"cache {where}: {name}: {text}"


def _modified(raw: dict) -> datetime:
    """Last-modified time of an fsspec info dict (s3fs: ``LastModified``; local: ``mtime``), UTC."""
    value = raw.get("LastModified") or raw.get("mtime") or raw.get("created")
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    return datetime.now(timezone.utc)
