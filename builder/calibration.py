"""Calibration data for the calibrated formats (fp8, int4_awq, int8_sq).

Text comes from ``--calib-data PATH`` -- plain UTF-8 text, or JSONL (``.jsonl`` / ``.json``: one JSON object
per line with a ``"text"`` field) -- or, by default, two sources, never a network:

- ``data/general_en.txt``, general-knowledge English prose and question-and-answer text written for
  kilnlm (everyday life, science, history, geography, the arts; no text from elsewhere);
- the Python standard library's ``pydoc_data.topics`` (~465 KB of the language reference, topics in
  sorted order).

Half the default samples come from each. The language reference alone is technical prose that never asks
a model to recall a fact, and activations that only factual recall produces then fall outside the
calibrated ranges: SmolLM2's int8_sq calibrated on it alone answered 5 of 7 one-line factual questions
that fp32 gets right wrongly ("The capital of France is France."); with the general text added its engine
keeps every answer of test_quality's factual probes (docs/quantization.md).

Sampling is deterministic: each text is tokenized once and windows of ``seq_len`` tokens are taken at
evenly spaced offsets, so the same inputs always give the same calibration batches (and the same engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError

JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class CalibrationConfig:
    """What to calibrate on (made from the resolved build options,
    :attr:`kilnlm.builder.config.ResolvedBuildOptions.calibration`, which hold the defaults). ``data_path``
    None = the default sources (:func:`default_calibration_texts`)."""

    num_samples: int  # calibration sequences (--calib-size)
    seq_len: int  # tokens per sequence (--calib-max-seq-len)
    data_path: Path | None = None  # --calib-data: plain text, or JSONL with a "text" field

    def describe(self) -> str:
        return str(self.data_path) if self.data_path is not None else f"{GENERAL_TEXT_PATH.name} + pydoc_data.topics"


GENERAL_TEXT_PATH = Path(__file__).parent / "data" / "general_en.txt"


def general_text() -> str:
    """kilnlm's general-knowledge English text (``data/general_en.txt``, shipped with the package)."""
    return GENERAL_TEXT_PATH.read_text(encoding="utf-8")


def reference_text() -> str:
    """The Python language reference shipped with the standard library (~465 KB of English), topics in
    sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def default_calibration_texts() -> tuple[str, str]:
    """The default calibration sources, in sampling order: (:func:`general_text`, :func:`reference_text`)."""
    return general_text(), reference_text()


def read_calibration_text(path: Path) -> str:
    """The calibration text of ``--calib-data``.

    A ``.jsonl`` / ``.json`` file is read as one JSON object per line (blank lines skipped); the ``"text"``
    fields are joined with blank lines in file order. Any other file is plain UTF-8 text. Raises
    :class:`BuildError` for a missing, unreadable or empty file, a JSONL line that is not an object with a
    string ``"text"``, or a file with no text at all."""
    path = Path(path)
    if not path.is_file():
        raise BuildError(f"--calib-data {path} does not exist: pass a plain-text file or a JSONL file with a \"text\" "
                         "field per line (or drop --calib-data to calibrate on the default text)")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"--calib-data {path} cannot be read as UTF-8 text ({exc}): pass a UTF-8 text or JSONL file") from None
    if path.suffix.lower() in JSONL_SUFFIXES:
        texts = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BuildError(f"--calib-data {path} line {number} is not JSON ({exc.msg}): each line of a JSONL file "
                                 "must be an object with a \"text\" field (or rename the file to .txt for plain text)") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise BuildError(f"--calib-data {path} line {number} has no string \"text\" field: each JSONL line must "
                                 "look like {\"text\": \"...\"}")
            texts.append(record["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise BuildError(f"--calib-data {path} holds no text: pass a file with at least a few thousand words of "
                         "representative text")
    return raw


def _windows(ids: list[int], num_samples: int, seq_len: int, validation: bool) -> list[torch.Tensor]:
    """Up to ``num_samples`` windows ``[1, seq_len]`` at evenly spaced offsets of ``ids`` (see
    :func:`calibration_batches`)."""
    num_chunks = len(ids) // seq_len
    stride = max(1, num_chunks // num_samples)
    shift = stride // 2 if validation else 0
    starts = [(i * stride + shift) * seq_len for i in range(min(num_samples, num_chunks - shift))]
    return [torch.tensor([ids[s: s + seq_len]], dtype=torch.int64) for s in starts]


def calibration_batches(tokenizer, cfg: CalibrationConfig, validation: bool = False) -> list[torch.Tensor]:
    """``cfg.num_samples`` token sequences ``[1, seq_len] int64`` (CPU), at evenly spaced offsets of the
    tokenized calibration text (fewer when the text holds fewer windows). With the default sources, the
    first ``ceil(num_samples / 2)`` come from the general text (as many as it holds) and the rest from the
    language reference, interleaved. ``validation``: the windows half a spacing further on instead,
    disjoint from the calibration ones wherever a text holds at least two windows per sample (a held-out
    part of the calibration text, for choosing between calibrations).

    Raises :class:`BuildError` for non-positive sizes or a text shorter than one ``seq_len`` window."""
    if cfg.num_samples < 1 or cfg.seq_len < 1:
        raise BuildError(f"--calib-size {cfg.num_samples} / --calib-max-seq-len {cfg.seq_len}: both must be at least 1")
    if cfg.data_path is not None:
        texts = [read_calibration_text(cfg.data_path)]
    else:
        texts = list(default_calibration_texts())
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if len(ids[-1]) < cfg.seq_len:
        raise BuildError(f"calibration text {cfg.describe()} has {len(ids[-1]):,} tokens, fewer than one sample of "
                         f"--calib-max-seq-len {cfg.seq_len}: lower --calib-max-seq-len or pass a longer --calib-data")
    if len(ids) == 1:
        return _windows(ids[0], cfg.num_samples, cfg.seq_len, validation)
    general = _windows(ids[0], -(-cfg.num_samples // 2), cfg.seq_len, validation)
    remaining = cfg.num_samples - len(general)
    reference = _windows(ids[1], remaining, cfg.seq_len, validation) if remaining > 0 else []
    interleaved = [w for pair in zip(general, reference) for w in pair]
    shorter = min(len(general), len(reference))
    return interleaved + general[shorter:] + reference[shorter:]


def forward_loop(batches: list[torch.Tensor], desc: str, show_progress: bool, group_size: int = 8):
    """A ModelOpt ``forward_loop(model)`` running ``batches`` in groups of ``group_size`` samples (one
    ``[group, seq_len]`` forward each: larger GEMMs, same statistics), under ``torch.no_grad``."""
    from tqdm.auto import tqdm

    def run(model) -> None:
        groups = range(0, len(batches), group_size)
        with torch.no_grad():
            for i in tqdm(groups, desc=desc, unit="batch", disable=not show_progress):
                model(torch.cat(batches[i:i + group_size]))

    return run
