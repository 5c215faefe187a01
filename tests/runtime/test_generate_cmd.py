"""``kilnlm generate`` end to end through the CLI dispatcher, on the tiny eager engine (the engine loader
is replaced by one returning it; the compiled engines are exercised where the builder's fixtures exist)."""

from __future__ import annotations

import pytest

from kilnlm.cli.main import main
from kilnlm.runtime.executor import Executor
from kilnlm.runtime.tokenizer import Tokenizer


@pytest.fixture
def eager_engine_dir(monkeypatch, make_eager_engine, rt_tokenizer_dir, tmp_path):
    engine = make_eager_engine()
    tokenizer = Tokenizer.from_dir(rt_tokenizer_dir)

    def from_engine_dir(cls, engine_dir, config=None, trusted_keys=None):
        assert str(engine_dir) == str(tmp_path) and trusted_keys is None  # no --trusted-keys, none in the environment
        return cls(engine, tokenizer, config)

    monkeypatch.setattr(Executor, "from_engine_dir", classmethod(from_engine_dir))
    return tmp_path


def test_generate_streams_greedy_completion(eager_engine_dir, tiny_hf_model, hf_tokenizer, capsys):
    import torch

    prompt = "The kiln was hot and"
    ids = hf_tokenizer(prompt).input_ids
    with torch.no_grad():
        out = tiny_hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    expected = hf_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    status = main(["generate", "--engine", str(eager_engine_dir), "--max-tokens", "12", "--ignore-eos", "--stats", prompt])
    captured = capsys.readouterr()
    assert status == 0
    assert captured.out == expected + "\n"
    assert "generated 12" in captured.err and "TTFT" in captured.err


def test_generate_chat_and_errors(eager_engine_dir, capsys):
    assert main(["generate", "--engine", str(eager_engine_dir), "--chat", "--max-tokens", "3", "hello"]) == 0
    capsys.readouterr()
    assert main(["generate", "--engine", str(eager_engine_dir), "--temperature", "-1", "hello"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_generate_structured_output(eager_engine_dir, tmp_path, capsys):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'kilnlm[guided]')")
    import json
    import re

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    engine = ["generate", "--engine", str(eager_engine_dir), "--max-tokens", "40"]
    assert main([*engine, "--json-schema", str(schema), "--temperature", "1", "--seed", "3", "hi"]) == 0
    assert json.loads(capsys.readouterr().out) in ({"ok": True}, {"ok": False})
    assert main([*engine, "--regex", "[0-9]{3}-[0-9]{4}", "hi"]) == 0
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}\n", capsys.readouterr().out)
    assert main([*engine, "--regex", "[0-9", "hi"]) == 2
    assert "guided_decoding's regex guide does not compile" in capsys.readouterr().err
    assert main([*engine, "--grammar", str(tmp_path / "missing.ebnf"), "hi"]) == 2
    assert "--grammar" in capsys.readouterr().err


def test_the_engine_verification_starts_before_the_parsers_import_torch(monkeypatch):
    """``generate``, ``serve`` and ``eval`` start the SHA-256 checks of the engine their ``--engine`` names
    (and of a draft engine their ``--speculative-config`` names) before building the parsers (whose
    construction imports torch); other subcommands start none."""
    import kilnlm.cli.main as cli_main
    import kilnlm.runtime.manifest as manifest

    calls = []
    monkeypatch.setattr(manifest, "prehash_engine_files", lambda engine_dir: calls.append(f"prehash {engine_dir}"))
    make_parser = cli_main.make_parser
    monkeypatch.setattr(cli_main, "make_parser", lambda: calls.append("parser") or make_parser())
    draft = '{"method": "draft", "model": "D1", "num_speculative_tokens": 4}'
    for argv in (["generate", "--engine", "E1", "--help"], ["serve", "--engine=E2", "--help"],
                 ["eval", "--max-tokens", "3", "--engine", "E3", "--help"], ["build", "--help"],
                 ["generate", "--help"], ["generate", "--speculative-config", draft, "--engine", "E4", "--help"],
                 ["serve", "--engine", "E5", "--speculative-config", "{not json", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert calls == ["prehash E1", "parser", "prehash E2", "parser", "prehash E3", "parser", "parser", "parser",
                     "prehash E4", "prehash D1", "parser", "prehash E5", "parser"]
