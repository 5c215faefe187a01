"""Calibration data for the calibrated formats (fp8, int4_awq, int8_sq).

Text comes from ``--calib-data PATH`` -- plain UTF-8 text, or JSONL (``.jsonl`` / ``.json``: one JSON object
per line with a ``"text"`` field) -- or, by default, the Python standard library's ``pydoc_data.topics``
(~465 KB of the language reference, topics in sorted order): never a network. Sampling is deterministic:
the text is tokenized once and ``num_samples`` windows of ``seq_len`` tokens are taken at evenly spaced
offsets, so the same inputs always give the same calibration batches (and the same engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError

JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass
class CalibrationConfig:
    """What to calibrate on. ``data_path`` None = ``pydoc_data.topics``."""

    num_samples: int = 24  # calibration sequences (--calib-size)
    seq_len: int = 256  # tokens per sequence (--calib-max-seq-len)
    data_path: Path | None = None  # --calib-data: plain text, or JSONL with a "text" field

    def describe(self) -> str:
        return str(self.data_path) if self.data_path is not None else "pydoc_data.topics"


def default_calibration_text() -> str:
    """The Python language reference shipped with the standard library (~465 KB of English), topics in
    sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


# The name the FP8 path and its tests use.
calibration_text = default_calibration_text


def read_calibration_text(path: Path | None) -> str:
    """The calibration text of ``--calib-data`` (None: :func:`default_calibration_text`).

    A ``.jsonl`` / ``.json`` file is read as one JSON object per line (blank lines skipped); the ``"text"``
    fields are joined with blank lines in file order. Any other file is plain UTF-8 text. Raises
    :class:`BuildError` for a missing, unreadable or empty file, a JSONL line that is not an object with a
    string ``"text"``, or a file with no text at all."""
    if path is None:
        return default_calibration_text()
    path = Path(path)
    if not path.is_file():
        raise BuildError(f"--calib-data {path} does not exist: pass a plain-text file or a JSONL file with a \"text\" "
                         "field per line (or drop --calib-data to calibrate on pydoc_data.topics)")
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


def calibration_batches(tokenizer, cfg: CalibrationConfig, validation: bool = False) -> list[torch.Tensor]:
    """``cfg.num_samples`` token sequences ``[1, seq_len] int64`` (CPU), at evenly spaced offsets of the
    tokenized calibration text (fewer when the text holds fewer windows). ``validation``: the windows half
    a spacing further on instead, disjoint from the calibration ones wherever the text holds at least two
    windows per sample (a held-out part of the calibration text, for choosing between calibrations).

    Raises :class:`BuildError` for non-positive sizes or a text shorter than one ``seq_len`` window."""
    if cfg.num_samples < 1 or cfg.seq_len < 1:
        raise BuildError(f"--calib-size {cfg.num_samples} / --calib-max-seq-len {cfg.seq_len}: both must be at least 1")
    ids = tokenizer(read_calibration_text(cfg.data_path), add_special_tokens=False)["input_ids"]
    num_chunks = len(ids) // cfg.seq_len
    if num_chunks < 1:
        raise BuildError(f"calibration text {cfg.describe()} has {len(ids):,} tokens, fewer than one sample of "
                         f"--calib-max-seq-len {cfg.seq_len}: lower --calib-max-seq-len or pass a longer --calib-data")
    stride = max(1, num_chunks // cfg.num_samples)
    shift = stride // 2 if validation else 0
    starts = [(i * stride + shift) * cfg.seq_len for i in range(min(cfg.num_samples, num_chunks - shift))]
    return [torch.tensor([ids[s: s + cfg.seq_len]], dtype=torch.int64) for s in starts]


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
