"""Perplexity through the compiled engine (``kilnlm eval``) against Hugging Face transformers on the same
tokens and windows, the window plan, and the ABI's own ``num_logits`` dimension (N logits rows, N > B).

Held-out text: Debian's GPL-3 licence text (``/usr/share/common-licenses/GPL-3``), never the calibration
text (kilnlm's general English text and ``pydoc_data.topics``); tests that need it skip where the file is missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.perplexity import PerplexityConfig, plan_windows, token_nlls

HELD_OUT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def held_out_text() -> str:
    if not HELD_OUT_TEXT.is_file():
        pytest.skip(f"held-out evaluation text {HELD_OUT_TEXT} is missing (Debian's base-files ships it)")
    return HELD_OUT_TEXT.read_text(encoding="utf-8")


def hf_token_nlls(model, token_ids: list[int], context_len: int, stride: int) -> torch.Tensor:
    """The reference: transformers' logits for each window as one forward (positions from 0), NLL of every
    token the window scores. ``[len(token_ids) - 1] float64``; NaN where no window scored a token."""
    ids = torch.tensor(token_ids)
    nlls = torch.full((len(ids) - 1,), float("nan"), dtype=torch.float64)
    for w in plan_windows(len(ids), context_len, stride):
        with torch.no_grad():
            log_probs = torch.log_softmax(model(ids[w.begin:w.end].unsqueeze(0)).logits[0].float(), dim=-1)
        targets = ids[w.score_from:w.end]
        rows = torch.arange(w.score_from - 1, w.end - 1) - w.begin
        nlls[w.score_from - 1:w.end - 1] = -log_probs[rows, targets].double()
    return nlls


# ------------------------------------------------------------------------------------------ window plan
@pytest.mark.parametrize("num_tokens,context_len,stride", [(2, 2, 1), (10, 4, 3), (10, 4, 1), (1000, 256, 100),
                                                           (255, 256, 128), (513, 256, 255)])
def test_windows_score_every_token_once(num_tokens, context_len, stride):
    windows = plan_windows(num_tokens, context_len, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert scored == list(range(1, num_tokens))
    for i, w in enumerate(windows):
        assert w.end - w.begin <= context_len and w.begin == i * stride
        if i > 0:  # past the first window every scored token sees at least context_len - stride tokens
            assert w.score_from - w.begin >= context_len - stride
    assert windows[-1].end == num_tokens


@pytest.mark.parametrize("num_tokens,context_len,stride", [(1, 4, 2), (10, 1, 1), (10, 4, 0), (10, 4, 4)])
def test_windows_refuse_bad_settings(num_tokens, context_len, stride):
    with pytest.raises(RequestError):
        plan_windows(num_tokens, context_len, stride)


# ------------------------------------------------------------------------------- ABI: N logits rows > B
def test_engine_returns_logits_for_more_rows_than_sequences(tiny_engine_dir):
    """Two sequences in one forward, logits for every packed row (N = T > B): each row equals the logits
    the same engine returns for that row alone (one sequence, one row asked)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from factories import make_engine_inputs

    from kilnlm.runtime.engine import Engine

    engine = Engine.load(tiny_engine_dir)
    build = engine.manifest.build
    seqs = [([5, 17, 300, 42, 9], 0), ([1000, 7, 88], 0)]
    inputs = make_engine_inputs(seqs, build.tokens_per_block, build.max_blocks_per_seq)
    num_tokens = inputs.num_tokens
    inputs.logits_indices = torch.arange(num_tokens - 1, -1, -1)  # every row, reversed order
    kv_cache = engine.allocate_kv_cache(len(seqs) * build.max_blocks_per_seq)
    all_rows = engine.forward(inputs, kv_cache)
    assert all_rows.shape == (num_tokens, engine.manifest.model.vocab_size) and num_tokens > inputs.num_seqs

    for b, (ids, _) in enumerate(seqs):
        for i in range(len(ids)):  # the prefix ids[:i+1] alone; its last row
            single = make_engine_inputs([(ids[: i + 1], 0)], build.tokens_per_block, build.max_blocks_per_seq)
            expected = engine.forward(single, engine.allocate_kv_cache(build.max_blocks_per_seq))[0]
            packed_row = int(inputs.cu_seqlens_q[b]) + i
            torch.testing.assert_close(all_rows[num_tokens - 1 - packed_row], expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- perplexity vs transformers
@pytest.fixture(scope="module")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("context_len,stride,chunk_tokens", [(200, 120, 64), (256, 255, 256), (100, 30, 512)])
def test_perplexity_matches_transformers(tiny_engine_dir, tiny_hf, context_len, stride, chunk_tokens):
    """fp32 engine vs transformers on the same held-out tokens and windows: per-token NLL within 1e-4
    nats, perplexity within 1e-4 relative. Chunks smaller than a window exercise the paged KV cache."""
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.tokenizer import Tokenizer

    engine = Engine.load(tiny_engine_dir)
    token_ids = Tokenizer.from_dir(engine.tokenizer_dir).encode(held_out_text())[:600]
    nlls, info = token_nlls(engine, token_ids, PerplexityConfig(context_len=context_len, stride=stride,
                                                                chunk_tokens=chunk_tokens))
    expected = hf_token_nlls(tiny_hf, token_ids, context_len, stride)
    assert not torch.isnan(expected).any()
    torch.testing.assert_close(nlls, expected, rtol=0, atol=1e-4)
    assert math.isclose(math.exp(nlls.mean()), math.exp(expected.mean()), rel_tol=1e-4)
    assert info["num_windows"] == len(plan_windows(len(token_ids), context_len, stride))


def test_eval_cli_prints_one_json_record_per_text(tiny_engine_dir, tiny_hf, tmp_path, capsys):
    """``kilnlm eval`` end to end with two ``--text`` files: one JSON line per text, in the order given, each
    perplexity transformers' on the same windows of that text."""
    from transformers import AutoTokenizer

    from kilnlm.cli.main import main

    texts = [tmp_path / "held_out_a.txt", tmp_path / "held_out_b.txt"]
    texts[0].write_text(held_out_text()[:4000], encoding="utf-8")
    texts[1].write_text(held_out_text()[4000:8000], encoding="utf-8")
    status = main(["eval", "--engine", str(tiny_engine_dir), "--text", str(texts[0]), "--text", str(texts[1]),
                   "--max-tokens", "300", "--context-len", "128", "--stride", "64"])
    assert status == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in records] == [str(t) for t in texts]
    tokenizer = AutoTokenizer.from_pretrained(tiny_engine_dir / "tokenizer")
    for record, text in zip(records, texts):
        assert record["tokens"] == 299 and record["seconds"] > 0 and record["context_len"] == 128
        token_ids = tokenizer(text.read_text()).input_ids[:300]
        expected = math.exp(hf_token_nlls(tiny_hf, token_ids, 128, 64).mean())
        assert math.isclose(record["perplexity"], expected, rel_tol=1e-4)
    assert records[0]["perplexity"] != records[1]["perplexity"]


def test_eval_cli_errors(tiny_engine_dir, tmp_path, capsys):
    from kilnlm.cli.main import main

    assert main(["eval", "--engine", str(tiny_engine_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    text_path = tmp_path / "t.txt"
    text_path.write_text("hello world, this is a short text", encoding="utf-8")
    # a bad second text fails before the first is evaluated: nothing on stdout
    assert main(["eval", "--engine", str(tiny_engine_dir), "--text", str(text_path), "--text",
                 str(tmp_path / "missing.txt")]) == 2
    captured = capsys.readouterr()
    assert "missing.txt" in captured.err and captured.out == ""
    assert main(["eval", "--engine", str(tiny_engine_dir), "--text", str(text_path), "--context-len", "100000"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
