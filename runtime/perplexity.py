"""Perplexity of a text through the engine's own forward (``kilnlm eval``).

Perplexity is ``exp(mean NLL)``, the mean over every scored token ``t`` of
``-log p(token_t | tokens before t in its window)``, computed from the logits the compiled engine
returns -- the same forward, paged KV cache and kernels that serve requests, so quantization error shows
up exactly as it does in serving. No transformers: a serving-only install can run it.

Windows (the strided sliding-window method of Hugging Face's guide "Perplexity of fixed-length models"):
a model of context ``L`` cannot condition on the whole text, so the text's ``num_tokens`` ids are cut into
windows of at most ``L`` tokens that start every ``S`` (stride) tokens; each window is a fresh sequence
(positions restart at 0) and scores only the tokens no earlier window scored, so every token but the first
is scored exactly once, with at least ``L - S`` tokens of context once past the first window::

    token ids   0 ........................................................ num_tokens-1
    window 0    [begin=0 ............. end=L)          scores tokens 1 .. L-1
    window 1              [begin=S ............... end=S+L)   scores L .. S+L-1 (context S .. L-1)
    window 2                        [begin=2S .............. end=2S+L)  ...
    (the last window ends at num_tokens; windows stop once one reaches it)

``S = L - 1`` is the cheapest (windows overlap by one token, the context of the next window's first
scored token; early tokens of each window see little context); smaller strides cost about ``L / S``
forwards per token and give lower, more faithful perplexity. (``S = L``, disjoint windows, would leave
each window's first token unscored, so it is refused.)

Each window runs as one sequence through the paged KV cache in context chunks of at most
``chunk_tokens`` (<= the engine's ``max_num_tokens``), with ``logits_indices`` listing the chunk's rows
whose next token is scored (the ABI's N logits rows; see :mod:`kilnlm.runtime.abi`)::

    window      | chunk 0 (positions 0..C-1) | chunk 1 (C..2C-1) | ...   KV of earlier chunks stays in the pool
    scored row  r predicts window token r+1; a row is asked for iff that token is scored by this window
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from collections.abc import Iterator
from pathlib import Path

import torch

from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.signing import FROM_ENVIRONMENT

DEFAULT_CONTEXT_LEN = 1024  # tokens per window when --context-len is not given (capped at max_seq_len)
DEFAULT_CHUNK_TOKENS = 512  # tokens (and logits rows) per forward: bounds the logits to chunk x vocab floats


@dataclass(frozen=True)
class PerplexityConfig:
    """How a text is evaluated. ``None`` takes the default named in each field's comment."""

    context_len: int | None = None  # L: tokens per window; default min(1024, the engine's max_seq_len)
    stride: int | None = None  # S: tokens between window starts, 1..L-1; default L // 2
    max_tokens: int | None = None  # evaluate only the text's first N token ids; default all
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # tokens per forward, capped at the engine's max_num_tokens


@dataclass(frozen=True)
class Window:
    """One window: token ids ``[begin, end)`` of the text; tokens ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int


@dataclass
class PerplexityResult:
    """``perplexity`` = exp(``mean_nll``); ``tokens`` scored tokens (nats per token in ``mean_nll``);
    ``seconds`` wall time of the forwards (tokenization and engine loading excluded)."""

    perplexity: float
    tokens: int
    seconds: float
    mean_nll: float
    text_tokens: int
    context_len: int
    stride: int
    num_windows: int
    num_forwards: int
    tokens_per_s: float  # tokens run through the engine (context included) per second

    def as_dict(self) -> dict:
        return asdict(self)


def plan_windows(num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """The windows of the strided method (module docstring) over ``num_tokens`` token ids. Every token
    ``1 .. num_tokens-1`` is scored by exactly one window. Raises :class:`RequestError` for fewer than 2
    tokens, ``context_len`` < 2 or a stride outside ``1 .. context_len - 1``."""
    if num_tokens < 2:
        raise RequestError(f"the text has {num_tokens} token(s): perplexity needs at least 2")
    if context_len < 2:
        raise RequestError(f"--context-len is {context_len}: it must be at least 2")
    if not 1 <= stride < context_len:
        raise RequestError(f"--stride is {stride}: it must be 1..{context_len - 1} (less than --context-len, so that "
                           "the windows overlap and every token is scored with context)")
    windows, prev_end, begin = [], 1, 0
    while True:
        end = min(begin + context_len, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        if end == num_tokens:
            return windows
        prev_end, begin = end, begin + stride


def resolve_config(config: PerplexityConfig, max_seq_len: int, max_num_tokens: int) -> tuple[int, int, int]:
    """``(context_len, stride, chunk_tokens)`` for an engine with these limits. Raises
    :class:`RequestError` for a context longer than ``max_seq_len`` or a non-positive chunk."""
    context_len = config.context_len if config.context_len is not None else min(DEFAULT_CONTEXT_LEN, max_seq_len)
    if context_len > max_seq_len:
        raise RequestError(f"--context-len {context_len:,} exceeds the engine's max_seq_len {max_seq_len:,}: "
                           "lower --context-len or rebuild with a larger --max-seq-len")
    stride = config.stride if config.stride is not None else max(context_len // 2, 1)
    if config.chunk_tokens < 1:
        raise RequestError(f"chunk_tokens is {config.chunk_tokens}: it must be at least 1")
    return context_len, stride, min(config.chunk_tokens, max_num_tokens)


def _window_inputs(token_ids: torch.Tensor, chunk_begin: int, chunk_end: int, scored_rows: torch.Tensor,
                   tokens_per_block: int, max_blocks_per_seq: int) -> EngineInputs:
    """One context chunk (window positions ``chunk_begin .. chunk_end-1``) of one sequence that owns
    blocks ``0, 1, 2, ...`` of the pool in order (so slot = position)."""
    num_new = chunk_end - chunk_begin
    positions = torch.arange(chunk_begin, chunk_end, dtype=torch.int64)
    return EngineInputs(
        input_ids=token_ids[chunk_begin:chunk_end],
        positions=positions,
        cu_seqlens_q=torch.tensor([0, num_new], dtype=torch.int32),
        seq_lens_kv=torch.tensor([chunk_end], dtype=torch.int32),
        block_tables=torch.arange(max_blocks_per_seq, dtype=torch.int32).unsqueeze(0),
        slot_mapping=positions.clone(),
        logits_indices=scored_rows,
    )


def token_nlls(engine, token_ids: list[int], config: PerplexityConfig = PerplexityConfig()) -> tuple[torch.Tensor, dict]:
    """Per-token negative log-likelihood (nats) of ``token_ids[1:]`` through ``engine``
    (a :class:`kilnlm.runtime.engine.Engine`), by the strided windows of the module docstring.

    Returns ``(nlls, info)``: ``nlls [num_scored] float64`` CPU, ``nlls[i]`` for token ``i + 1`` (after
    ``config.max_tokens`` truncation), and ``info`` with ``context_len``, ``stride``, ``num_windows``,
    ``num_forwards``, ``num_forward_tokens``, ``seconds``. Raises :class:`RequestError` for settings the
    engine cannot run (see :func:`resolve_config`, :func:`plan_windows`)."""
    build = engine.manifest.build
    context_len, stride, chunk_tokens = resolve_config(config, build.max_seq_len, build.max_num_tokens)
    ids = torch.tensor(token_ids[: config.max_tokens] if config.max_tokens else token_ids, dtype=torch.int64)
    windows = plan_windows(len(ids), context_len, stride)
    kv_cache = engine.allocate_kv_cache(-(-context_len // build.tokens_per_block))
    nlls = torch.empty(len(ids) - 1, dtype=torch.float64)
    num_forwards = num_forward_tokens = 0
    start_s = time.perf_counter()
    with torch.inference_mode():
        for w in windows:
            window_ids = ids[w.begin:w.end]
            for chunk_begin in range(0, len(window_ids), chunk_tokens):
                chunk_end = min(chunk_begin + chunk_tokens, len(window_ids))
                # window row r predicts window token r + 1 = text token w.begin + r + 1
                # scored rows [first_row, last_row) of the window; the window's last token predicts nothing
                first_row = max(chunk_begin, w.score_from - w.begin - 1)
                last_row = min(chunk_end, len(window_ids) - 1)
                if first_row < last_row:
                    rows = torch.arange(first_row - chunk_begin, last_row - chunk_begin, dtype=torch.int64)
                else:  # a context-only chunk: the ABI returns at least one row, which is discarded
                    rows = torch.tensor([chunk_end - chunk_begin - 1], dtype=torch.int64)
                inputs = _window_inputs(window_ids, chunk_begin, chunk_end, rows,
                                        build.tokens_per_block, build.max_blocks_per_seq)
                logits = engine.forward(inputs, kv_cache)  # [num_scored_rows, vocab] float32
                num_forwards += 1
                num_forward_tokens += chunk_end - chunk_begin
                if first_row >= last_row:
                    continue
                targets = window_ids[first_row + 1:last_row + 1]
                nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets.unsqueeze(1)).squeeze(1)
                # text token w.begin + r + 1 sits at nlls[w.begin + r]
                nlls[w.begin + first_row:w.begin + last_row] = nll.double()
    seconds = time.perf_counter() - start_s
    info = dict(context_len=context_len, stride=stride, num_windows=len(windows), num_forwards=num_forwards,
                num_forward_tokens=num_forward_tokens, seconds=seconds)
    return nlls, info


def evaluate_perplexity(engine, token_ids: list[int], config: PerplexityConfig = PerplexityConfig()) -> PerplexityResult:
    """Perplexity of ``token_ids`` through ``engine`` (see :func:`token_nlls`)."""
    nlls, info = token_nlls(engine, token_ids, config)
    mean_nll = float(nlls.mean())
    return PerplexityResult(
        perplexity=math.exp(mean_nll), tokens=len(nlls), seconds=info["seconds"], mean_nll=mean_nll,
        text_tokens=len(nlls) + 1, context_len=info["context_len"], stride=info["stride"],
        num_windows=info["num_windows"], num_forwards=info["num_forwards"],
        tokens_per_s=info["num_forward_tokens"] / info["seconds"] if info["seconds"] > 0 else float("nan"))


def evaluate_text_files(engine_dir: str | os.PathLike, text_paths: list[str | os.PathLike],
                        config: PerplexityConfig = PerplexityConfig(),
                        trusted_keys=FROM_ENVIRONMENT) -> Iterator[tuple[Path, PerplexityResult]]:
    """Load (and verify, ``trusted_keys`` as :func:`kilnlm.runtime.engine.verify_engine` takes them) the
    engine in ``engine_dir`` once, read every file of ``text_paths`` (UTF-8; all of
    them before the first is evaluated, so a bad path fails at once), tokenize each with the engine's
    tokenizer (its default special tokens, as transformers' ``tokenizer(text)``) and yield ``(path,
    result)`` per text, in the order given. Raises :class:`RequestError` for a missing or unreadable text
    file, :class:`EngineError` for an engine that cannot be loaded."""
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.tokenizer import Tokenizer

    texts = {}
    for path in map(Path, text_paths):
        try:
            texts[path] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"cannot read --text {path} ({exc}): pass a UTF-8 text file") from None
    engine = Engine.load(engine_dir, trusted_keys)
    tokenizer = Tokenizer.from_dir(engine.tokenizer_dir)
    for path, text in texts.items():
        yield path, evaluate_perplexity(engine, tokenizer.encode(text), config)
