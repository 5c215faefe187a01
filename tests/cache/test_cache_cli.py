"""``kilnlm cache`` end to end (in-process CLI) on a local directory and the moto S3 server, and its
one-line errors for missing references, bad URLs, unreachable endpoints and missing credentials."""

from __future__ import annotations

import json
import socket

import pytest

from kilnlm.cli.main import main
from kilnlm.runtime.manifest import read_manifest, verify_files

KEY_A = "a" * 64
KEY_B = "b" * 64


def _run(capsys, *argv) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_ls_push_pull_tag_verify_rm_gc(cache_url, fake_engine, tmp_path, capsys):
    c = ["--cache", cache_url]
    assert "holds no engines" in _run(capsys, "cache", "ls", *c)[1]
    status, out, _ = _run(capsys, "cache", "push", str(fake_engine("a", KEY_A, b"a")), "--name", "tiny", *c)
    assert status == 0 and KEY_A in out and "tiny:1" in out
    assert _run(capsys, "cache", "push", str(fake_engine("b", KEY_B, b"b")), *c)[0] == 0  # untagged

    status, out, _ = _run(capsys, "cache", "ls", *c)
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "VERSION", "KEY", "SIZE", "CREATED", "QFORMAT", "TARGET"]
    cells = sorted(row.split() for row in rows)
    assert [r[:3] for r in cells] == [["-", "-", KEY_B[:16]], ["tiny", "1", KEY_A[:16]]]
    assert all(r[-2:] == ["fp32", "cpu"] and r[4] == "MB" for r in cells)
    listed = json.loads(_run(capsys, "cache", "ls", "--json", *c)[1])
    assert {e["key"]: e["names"] for e in listed} == {KEY_A: ["tiny:1"], KEY_B: []}
    assert all(e["size_bytes"] > 0 and e["created"].endswith("Z") for e in listed)

    status, out, _ = _run(capsys, "cache", "tag", KEY_B[:10], "tiny:prod", "--json", *c)
    assert json.loads(out) == {"key": KEY_B, "name": "tiny:prod"}
    status, out, _ = _run(capsys, "cache", "pull", "tiny", "--output", str(tmp_path / "pulled"), "--json", *c)
    assert status == 0 and json.loads(out)["key"] == KEY_B  # latest follows the last tag
    verify_files(tmp_path / "pulled", read_manifest(tmp_path / "pulled"))
    status, out, _ = _run(capsys, "cache", "verify", "tiny:1", "--json", *c)
    assert status == 0 and json.loads(out)["verified"] is True and json.loads(out)["key"] == KEY_A

    assert _run(capsys, "cache", "rm", "tiny:prod", *c)[0] == 0
    status, out, _ = _run(capsys, "cache", "gc", "--dry-run", "--min-age", "0", "--json", *c)
    assert json.loads(out) == {"dry_run": True, "keys": [KEY_B]}
    status, out, _ = _run(capsys, "cache", "gc", "--min-age", "0", *c)
    assert out.strip() == f"removed {KEY_B}"
    assert [e["key"] for e in json.loads(_run(capsys, "cache", "ls", "--json", *c)[1])] == [KEY_A]
    assert _run(capsys, "cache", "rm", KEY_A, *c)[0] == 0
    assert json.loads(_run(capsys, "cache", "ls", "--json", *c)[1]) == []


def test_default_cache_comes_from_the_environment(fake_engine, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KILNLM_CACHE", str(tmp_path / "env-cache"))
    assert _run(capsys, "cache", "push", str(fake_engine("a", KEY_A)), "--name", "m")[0] == 0
    assert (tmp_path / "env-cache" / "engines" / KEY_A / "manifest.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["pull", "missing:3", "--output", "OUT"], "missing:3 is not in cache"),
    (["verify", "c" * 64], "no engine with key"),
    (["tag", KEY_A, "bad name"], "is not valid"),
    (["rm", "tiny"], "ambiguous"),
])
def test_errors_are_one_line(cache_url, fake_engine, tmp_path, capsys, argv, message):
    _run(capsys, "cache", "push", str(fake_engine("a", KEY_A)), "--name", "tiny", "--cache", cache_url)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    status, _, err = _run(capsys, "cache", *argv, "--cache", cache_url)
    assert status == 2 and message in err and err.count("\n") == 1 and err.startswith("kilnlm cache: error:")


def test_bad_url_and_missing_bucket(s3_server, capsys):
    status, _, err = _run(capsys, "cache", "ls", "--cache", "gs://bucket/x")
    assert status == 2 and "scheme 'gs' is not supported" in err
    status, _, err = _run(capsys, "cache", "ls", "--cache", "s3://no-such-bucket/x")
    assert status == 2 and "bucket 'no-such-bucket' does not exist" in err


def test_unreachable_endpoint(s3_server, capsys, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    status, _, err = _run(capsys, "cache", "ls", "--cache", "s3://bucket/x")
    assert status == 2 and "cannot reach the S3 endpoint" in err and f"127.0.0.1:{port}" in err


def test_missing_credentials(s3_server, tmp_path, capsys, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    status, _, err = _run(capsys, "cache", "ls", "--cache", s3_server.make_bucket())
    assert status == 2 and "no usable AWS credentials" in err
