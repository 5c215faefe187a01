"""``kilnlm build`` refuses bad input with one line on stderr, a non-zero exit, and no output left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kilnlm.cli.main import main


def run_build(capsys, *args: str) -> tuple[int, str]:
    status = main(["build", *args])
    return status, capsys.readouterr().err


def assert_refused(status: int, err: str, output: Path, *fragments: str) -> None:
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kilnlm build: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not output.exists()
    leftovers = [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]
    assert leftovers == []


def test_missing_checkpoint(tmp_path, capsys):
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(tmp_path / "nope"), "--output", str(out))
    assert_refused(status, err, out, "does not exist", "nope")


def test_unsupported_architecture(tmp_path, capsys):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(ckpt), "--output", str(out))
    assert_refused(status, err, out, "GPT2LMHeadModel", "LlamaForCausalLM")


def test_truncated_safetensors(tiny_llama_dir, tmp_path, capsys):
    ckpt = tmp_path / "truncated"
    shutil.copytree(tiny_llama_dir, ckpt)
    tensors = ckpt / "model.safetensors"
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(ckpt), "--output", str(out))
    assert_refused(status, err, out, "model.safetensors", "truncated or corrupt")


def test_corrupt_safetensors_header(tiny_llama_dir, tmp_path, capsys):
    ckpt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(ckpt), "--output", str(out))
    assert_refused(status, err, out, "model.safetensors", "truncated or corrupt")


def test_max_seq_len_beyond_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(out), "--max-seq-len", "100000")
    assert_refused(status, err, out, "--max-seq-len 100,000", "max_position_embeddings 512")


def test_non_empty_output_needs_overwrite(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(out))
    assert status != 0
    assert len(err.strip().splitlines()) == 1 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "user data"


def test_contradictory_dtype(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(out),
                            "--qformat", "bf16", "--dtype", "float32")
    assert_refused(status, err, out, "--qformat bf16")


def test_help_states_units_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    text = capsys.readouterr().out
    for fragment in ("sequences per forward (default: 32)", "(default: 2048)", "tokens per paged-KV block (default: 32)"):
        assert fragment in " ".join(text.split())
