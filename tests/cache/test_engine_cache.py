"""EngineCache against a local directory and a real S3-protocol server (moto): publish / fetch / names /
verify / rm / gc, tampered objects, interrupted and concurrent publishes."""

from __future__ import annotations

import json
import threading

import pytest

from kilnlm.runtime.distribution.object_store import ObjectStore
from kilnlm.runtime.distribution.cache import EngineCache, split_cache_ref, split_name_version
from kilnlm.runtime.errors import CacheError
from kilnlm.runtime.manifest import read_manifest, sha256_file, verify_files

KEY_A = "a" * 64
KEY_B = "b" * 64


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_publish_then_fetch_round_trip(cache_url, fake_engine, tmp_path):
    engine = fake_engine("e", KEY_A)
    cache = EngineCache(cache_url)
    entry = cache.publish(engine, "tiny")
    assert (entry.key, entry.names, entry.qformat, entry.target) == (KEY_A, ["tiny:1"], "fp32", "cpu")
    assert entry.size_bytes == sum(p.stat().st_size for p in engine.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert entry.created.endswith("Z")
    for ref in (KEY_A, KEY_A[:8], f"sha256:{KEY_A}", "tiny", "tiny:1", "tiny:latest"):
        assert cache.resolve(ref) == KEY_A

    out = tmp_path / "pulled"
    manifest = cache.fetch("tiny:1", out)
    verify_files(out, read_manifest(out))
    assert manifest.cache_key == KEY_A
    for rel in manifest.files:
        assert sha256_file(out / rel) == sha256_file(engine / rel)
    assert (out / "manifest.json").read_bytes() == (engine / "manifest.json").read_bytes()
    assert _leftovers(tmp_path) == []
    with pytest.raises(CacheError, match="not empty"):
        cache.fetch("tiny", out)
    cache.fetch("tiny", out, overwrite=True)


def test_versions_latest_and_rm(cache_url, fake_engine):
    cache = EngineCache(cache_url)
    cache.publish(fake_engine("a", KEY_A, b"a"), "m")
    cache.publish(fake_engine("b", KEY_B, b"b"), "m")
    assert [cache.resolve(r) for r in ("m:1", "m:2", "m")] == [KEY_A, KEY_B, KEY_B]
    assert cache.tag(KEY_A, "m", "prod") == "prod"
    assert cache.resolve("m:latest") == KEY_A
    assert sorted(cache.lookup(KEY_A).names) == ["m:1", "m:prod"]
    assert [e.key for e in cache.entries()] and {e.key for e in cache.entries()} == {KEY_A, KEY_B}

    cache.remove("m:latest")  # removes m:prod; latest moves to the newest remaining tag
    with pytest.raises(CacheError, match="m:prod is not in cache"):
        cache.resolve("m:prod")
    assert cache.resolve("m") in (KEY_A, KEY_B)
    with pytest.raises(CacheError, match="ambiguous"):
        cache.remove("m")
    cache.remove(KEY_B)  # the key and m:2 with it
    assert cache.lookup(KEY_B) is None
    assert cache.resolve("m") == KEY_A and cache.lookup(KEY_A).names == ["m:1"]
    with pytest.raises(CacheError, match="latest is maintained by kilnlm"):
        cache.tag(KEY_A, "m", "latest")
    with pytest.raises(CacheError, match="not in cache"):
        cache.resolve("nope:3")
    with pytest.raises(CacheError, match="no engine with key"):
        cache.resolve("c" * 64)


def test_gc_removes_untagged_entries_only(cache_url, fake_engine):
    cache = EngineCache(cache_url)
    cache.publish(fake_engine("a", KEY_A, b"a"), "keep")
    cache.publish(fake_engine("b", KEY_B, b"b"))  # no name
    assert cache.gc(min_age_s=3600) == []  # too young: a publish might still be tagging it
    assert cache.gc(dry_run=True, min_age_s=0) == [KEY_B]
    assert cache.lookup(KEY_B) is not None
    assert cache.gc(min_age_s=0) == [KEY_B]
    assert cache.lookup(KEY_B) is None and cache.lookup(KEY_A) is not None
    assert not [o for o in cache.store.list_files("engines") if o.path.startswith(f"engines/{KEY_B}")]


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_tampered_object_is_refused_and_named(cache_url, fake_engine, tmp_path, damage):
    engine = fake_engine("e", KEY_A)
    cache = EngineCache(cache_url)
    cache.publish(engine, "tiny")
    meta = read_manifest(engine).files["model.pt2"]
    blob = f"engines/{KEY_A}/blobs/{meta['sha256']}"
    data = bytearray(cache.store.read_bytes(blob))
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-100:]
    cache.store.write_bytes(blob, bytes(data))  # what a tamperer with write access to the bucket could do

    out = tmp_path / "pulled"
    expected = "does not match its SHA-256" if damage == "flipped" else "truncated"
    with pytest.raises(CacheError, match=expected) as err:
        cache.fetch("tiny", out)
    assert blob in str(err.value) and "model.pt2" in str(err.value)
    assert not out.exists() and _leftovers(tmp_path) == []
    with pytest.raises(CacheError, match=expected):
        cache.verify("tiny")


def test_modified_manifest_is_refused(cache_url, fake_engine, tmp_path):
    engine = fake_engine("e", KEY_A)
    cache = EngineCache(cache_url)
    cache.publish(engine, "tiny")
    data = json.loads(cache.store.read_bytes(f"engines/{KEY_A}/manifest.json"))
    data["build"]["max_seq_len"] = 99999
    cache.store.write_bytes(f"engines/{KEY_A}/manifest.json", json.dumps(data).encode())
    with pytest.raises(CacheError, match="manifest.json does not match the SHA-256 that tiny recorded"):
        cache.fetch("tiny", tmp_path / "out")
    data["cache_key"] = KEY_B
    cache.store.write_bytes(f"engines/{KEY_A}/manifest.json", json.dumps(data).encode())
    with pytest.raises(CacheError, match=f"records cache key '{KEY_B}'"):
        cache.fetch(KEY_A, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hostile_entries_never_write_outside_the_output(cache_url, fake_engine, tmp_path):
    """A stored manifest listing a path outside the engine directory (or a blob name outside the entry), an
    oversized manifest, or a name pointer whose key is a path: each is refused, naming the object, and
    nothing is written anywhere."""
    from kilnlm.runtime.manifest import MAX_MANIFEST_BYTES

    engine = fake_engine("e", KEY_A)
    cache = EngineCache(cache_url)
    cache.publish(engine, "tiny")
    path = f"engines/{KEY_A}/manifest.json"
    original = cache.store.read_bytes(path)
    data = json.loads(original)
    data["files"]["../../escaped"] = data["files"]["model.pt2"]
    cache.store.write_bytes(path, json.dumps(data).encode())
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CacheError, match=r"manifest\.json is not a valid manifest .*not a relative path inside"):
        cache.fetch(KEY_A, tmp_path / "out" / "engine")
    data = json.loads(original)
    data["files"]["model.pt2"]["sha256"] = "../" * 3 + "names/tiny/1.json"
    cache.store.write_bytes(path, json.dumps(data).encode())
    with pytest.raises(CacheError, match="64 hex digits"):
        cache.verify(KEY_A)
    cache.store.write_bytes(path, original + b" " * MAX_MANIFEST_BYTES)
    with pytest.raises(CacheError, match="not a kilnlm manifest"):
        cache.fetch(KEY_A, tmp_path / "out" / "engine")
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not (tmp_path / "out" / "engine").exists()
    assert not list(tmp_path.parent.glob("escaped*"))

    cache.store.write_bytes(path, original)
    cache.store.write_bytes("names/tiny/2.json", json.dumps({"key": "../../etc"}).encode())
    with pytest.raises(CacheError, match=r"tiny:2 points to key '\.\./\.\./etc'"):
        cache.resolve("tiny:2")


def test_publish_failing_midway_is_invisible(cache_url, fake_engine, tmp_path, monkeypatch):
    """An upload that dies after the first file: no manifest, so readers see nothing; gc cleans it; the
    next publish succeeds."""
    engine = fake_engine("e", KEY_A)
    real_upload = ObjectStore.upload_file
    calls = []

    def failing_upload(self, local_path, rel):
        calls.append(rel)
        if len(calls) == 2:
            raise CacheError("injected: connection lost")
        real_upload(self, local_path, rel)

    monkeypatch.setattr(ObjectStore, "upload_file", failing_upload)
    cache = EngineCache(cache_url)
    with pytest.raises(CacheError, match="injected"):
        cache.publish(engine, "tiny")
    assert cache.store.list_files(f"engines/{KEY_A}")  # the first blob did land
    assert cache.lookup(KEY_A) is None and cache.entries() == []
    with pytest.raises(CacheError):
        cache.resolve("tiny")
    with pytest.raises(CacheError):
        cache.fetch(KEY_A, tmp_path / "out")
    assert cache.gc(min_age_s=0) == [KEY_A]
    assert cache.store.list_files("engines") == []
    monkeypatch.setattr(ObjectStore, "upload_file", real_upload)
    assert cache.publish(engine, "tiny").names == ["tiny:1"]


def test_concurrent_publishers_of_one_key_end_with_one_valid_entry(cache_url, fake_engine, tmp_path, monkeypatch):
    """Two builders publish the same key with engines that differ byte-wise (a non-deterministic
    compile); both pass the 'already stored?' check before either writes its manifest."""
    engines = [fake_engine("one", KEY_A, b"one", 1 << 18), fake_engine("two", KEY_A, b"two", 1 << 18)]
    both_checked = threading.Barrier(2, timeout=60)
    real_upload = ObjectStore.upload_file

    def synchronized_upload(self, local_path, rel):
        if local_path.name == "model.pt2":
            both_checked.wait()  # both publishers are uploading before either manifest exists
        real_upload(self, local_path, rel)

    monkeypatch.setattr(ObjectStore, "upload_file", synchronized_upload)
    results, errors = [None, None], []

    def publish(i):
        try:
            results[i] = EngineCache(cache_url).publish(engines[i], "race")
        except Exception as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    cache = EngineCache(cache_url)
    assert [e.key for e in cache.entries()] == [KEY_A]
    assert results[0].key == results[1].key == KEY_A
    cache.verify(KEY_A)
    out = cache.fetch(KEY_A, tmp_path / "out") and tmp_path / "out"
    winner = [e for e in engines if sha256_file(e / "model.pt2") == sha256_file(out / "model.pt2")]
    assert len(winner) == 1
    assert (out / "manifest.json").read_bytes() == (winner[0] / "manifest.json").read_bytes()
    names = cache.lookup(KEY_A).names
    assert "race:1" in names and set(names) <= {"race:1", "race:2"}  # race:2 only if both tagged at the same instant


KILLED_PUBLISHER = r'''
import functools, sys, time
from pathlib import Path
from fsspec.callbacks import Callback
from kilnlm.runtime.distribution import object_store
from kilnlm.runtime.distribution.cache import EngineCache

class Progress(Callback):  # s3fs calls it after each uploaded part
    def relative_update(self, inc=1):
        super().relative_update(inc)
        print("progress", self.value, flush=True)
        time.sleep(0.5)

def slow_copyfile(src, dst):  # the local backend's copy, in 1 MiB steps
    with open(src, "rb") as s, open(dst, "wb") as d:
        done = 0
        while chunk := s.read(1 << 20):
            d.write(chunk)
            d.flush()
            done += len(chunk)
            print("progress", done, flush=True)
            time.sleep(0.5)

cache = EngineCache(sys.argv[1])
if cache.store.local:
    object_store.shutil.copyfile = slow_copyfile
else:
    put_file = cache.store.fs.put_file
    cache.store.fs.put_file = lambda lpath, rpath: put_file(lpath, rpath, callback=Progress(), chunksize=5 << 20)
cache.publish(Path(sys.argv[2]), "killed")
print("finished", flush=True)
'''


def test_publish_killed_mid_upload_is_invisible(cache_url, fake_engine, tmp_path):
    """SIGKILL a publishing process while it is uploading a 24 MiB engine file (S3: between the parts of
    a multipart upload; local: while copying): readers see nothing, gc removes the leftovers."""
    import signal
    import subprocess
    import sys

    engine = fake_engine("big", KEY_A, b"big", 24 << 20)
    script = tmp_path / "publish.py"
    script.write_text(KILLED_PUBLISHER)
    proc = subprocess.Popen([sys.executable, str(script), cache_url, str(engine)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("progress") and int(line.split()[1]) >= 2 << 20:  # inside the big file
                break
            assert line.strip() != "finished", "the publish finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()

    cache = EngineCache(cache_url)
    assert cache.store.list_files(f"engines/{KEY_A}")  # smaller files were uploaded before the kill
    assert cache.lookup(KEY_A) is None and cache.entries() == []
    with pytest.raises(CacheError):
        cache.resolve("killed")
    with pytest.raises(CacheError):
        cache.fetch(KEY_A, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    if not cache.store.local:  # killed between the parts of the big file's multipart upload
        assert cache.store.abort_stale_uploads("engines", 0, dry_run=True) == [f"engines/{KEY_A}/blobs/{_sha(engine)}"]
    assert cache.gc(min_age_s=0) == [KEY_A]
    assert cache.store.list_files("engines") == [] and cache.store.abort_stale_uploads("engines", 0, dry_run=True) == []
    assert cache.publish(engine, "killed").key == KEY_A  # and the next publish completes
    cache.verify("killed")


def _sha(engine) -> str:
    return read_manifest(engine).files["model.pt2"]["sha256"]


def test_refs_and_names():
    assert split_cache_ref("s3://bucket/prefix/smollm2:3") == ("s3://bucket/prefix", "smollm2:3")
    assert split_cache_ref("s3://bucket/smollm2") == ("s3://bucket", "smollm2")
    assert split_cache_ref(f"/dir/cache/{KEY_A}") == ("/dir/cache", KEY_A)
    assert split_cache_ref("file:///dir/cache/m:latest") == ("file:///dir/cache", "m:latest")
    for bad in ("smollm2:3", "s3://bucket", "s3://bucket/", "/dir/cache/bad name", "/dir/cache/m:"):
        with pytest.raises(CacheError, match="not|valid"):
            split_cache_ref(bad)
    assert split_name_version("m") == ("m", None) and split_name_version("m:v1.2") == ("m", "v1.2")
    with pytest.raises(CacheError, match="latest"):
        split_name_version("m:latest")


RACING_PUBLISHER = r'''
import sys, time
from pathlib import Path
from kilnlm.runtime.distribution import object_store
from kilnlm.runtime.distribution.cache import EngineCache

url, engine, rendezvous, me = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
real_upload = object_store.ObjectStore.upload_file

def upload_file(self, local_path, rel):
    if local_path.name == "model.pt2":  # both processes get here before either writes its manifest
        (rendezvous / me).touch()
        deadline = time.monotonic() + 60
        while len(list(rendezvous.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    real_upload(self, local_path, rel)

object_store.ObjectStore.upload_file = upload_file
print(EngineCache(url).publish(engine, "race").key)
'''


def test_two_publishing_processes_end_with_one_valid_entry(cache_url, fake_engine, tmp_path):
    """The same race as above between two processes (two CI builders)."""
    import subprocess
    import sys

    engines = [fake_engine("one", KEY_A, b"one", 1 << 20), fake_engine("two", KEY_A, b"two", 1 << 20)]
    script, rendezvous = tmp_path / "race.py", tmp_path / "rendezvous"
    script.write_text(RACING_PUBLISHER)
    rendezvous.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), cache_url, str(e), str(rendezvous), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i, e in enumerate(engines)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == [KEY_A, KEY_A]
    assert sorted(p.name for p in rendezvous.iterdir()) == ["0", "1"]
    cache = EngineCache(cache_url)
    assert [e.key for e in cache.entries()] == [KEY_A]
    cache.verify("race")
    out = tmp_path / "out"
    cache.fetch("race", out)
    assert sum(sha256_file(e / "model.pt2") == sha256_file(out / "model.pt2") for e in engines) == 1
