#!/usr/bin/env python3
"""docs/quantization.md's quality tables, measured on this machine: SmolLM2-135M-Instruct perplexity of each
engine relative to the fp32 engine on the held-out texts, and the factual probes' log-probabilities.

    python scripts/quality_table.py [--formats fp32,fp8,int8_sq+lm_head,int8_sq:per_token=false,...]
        [--work-dir .work/quality]

Every engine is built with the CLI's default limits and calibration (``--formats`` specs as
``scripts/benchmark.py`` takes them: ``+lm_head`` for ``--quantize-lm-head``, ``:field=value,...`` for any
other build option), once, into ``--work-dir``, and reused while its options match. The texts, the windows
(``kilnlm eval --max-tokens 3072 --context-len 512 --stride 384``), the bounds and the probes are
tests/builder/test_quality.py's, which holds the engines to them. A row with ``kv_cache_dtype`` is measured
over the same engine with a 16-bit KV cache (built too), every other row over fp32. Prints both tables as
markdown, with the CPU they were measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from benchmark import LM_HEAD_SUFFIX, prepare_engine, prepare_hf_dir, split_spec

from kilnlm.runtime.manifest import MANIFEST_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "builder"))
from test_quality import EVAL, FACT_PROBES, FORMAT_BOUNDS, HELD_OUT_TEXTS, KV_CACHE_BOUND, answer_log_probs  # noqa: E402

DEFAULT_FORMATS = ("fp32,bf16,fp8,fp8+lm_head,fp8_rowwise,fp8_rowwise:calib_size=8,fp8_rowwise:calib_size=64,"
                   "fp8_rowwise:auto_quantize_bits=8,int8_wo,int8_wo+lm_head,int8_sq,int8_sq+lm_head,"
                   "int8_sq:per_token=false,int4_awq,int4_awq+lm_head,int4_wo,fp8:kv_cache_dtype=fp8,"
                   "fp8:kv_cache_dtype=int8")


def build_flags(spec: str) -> str:
    """A format spec as ``kilnlm build`` options: ``"int8_sq:per_token=false"`` -> ``"int8_sq --no-per-token"``."""
    qformat, options = split_spec(spec)
    flags = [qformat]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}")
    return " ".join(flags)


def base_spec(spec: str) -> str:
    """The spec a row is measured over: the same engine with a 16-bit KV cache for an 8-bit KV row, else fp32."""
    qformat, options = split_spec(spec)
    if "kv_cache_dtype" not in options:
        return "fp32"
    rest = {k: v for k, v in options.items() if k not in ("kv_cache_dtype", "quantize_lm_head")}
    lm_head = LM_HEAD_SUFFIX if options.get("quantize_lm_head") else ""
    return qformat + lm_head + (":" + ",".join(f"{k}={v}".lower() for k, v in rest.items()) if rest else "")


def bound(spec: str) -> float | None:
    """The bound tests/builder/test_quality.py holds the row to on every text, or None for a variant."""
    qformat, options = split_spec(spec)
    if set(options) == {"kv_cache_dtype"}:
        return KV_CACHE_BOUND
    return None if options else FORMAT_BOUNDS.get(qformat)


def measure(engine_dir: Path) -> tuple[dict[str, float], dict[str, float], int]:
    """(text name -> perplexity, probe answer -> log-probability, linears kept 16-bit) of one engine."""
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.perplexity import evaluate_perplexity
    from kilnlm.runtime.tokenizer import Tokenizer

    engine = Engine.load(engine_dir)
    tokenizer = Tokenizer.from_dir(engine.tokenizer_dir)
    perplexities = {name: evaluate_perplexity(engine, tokenizer.encode(path.read_text(encoding="utf-8")), EVAL).perplexity
                    for name, path in HELD_OUT_TEXTS.items()}
    kept = json.loads((engine_dir / MANIFEST_NAME).read_text())["build"].get("exclude_modules") or []
    return perplexities, answer_log_probs(engine), len(kept)


def cpu_description() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        fields = dict(line.split(":", 1) for line in cpuinfo.read().split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags)
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}: {isa})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated format specs (scripts/benchmark.py's)")
    parser.add_argument("--work-dir", type=Path, default=Path(".work/quality"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the builds' progress and choices
    missing = [str(path) for path in HELD_OUT_TEXTS.values() if not path.is_file()]
    if missing:
        sys.exit(f"held-out texts missing: {', '.join(missing)} (Debian's base-files and vim-runtime ship them)")

    specs = args.formats.split(",")
    wanted = list(dict.fromkeys([base_spec(s) for s in specs] + specs))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare_hf_dir(args.work_dir)
    results = {}
    for spec in wanted:
        started = time.perf_counter()
        results[spec] = measure(prepare_engine(args.work_dir, hf_dir, spec, limits={}))
        print(f"[quality] {build_flags(spec)}: " + ", ".join(f"{n} {p:.4f}" for n, p in results[spec][0].items())
              + " | " + " ".join(f"{a} {lp:.2f}" for a, lp in results[spec][1].items())
              + f" ({time.perf_counter() - started:.0f} s)", flush=True)

    print(f"\nMeasured on {cpu_description()}; {EVAL}\n")
    print("| engine | " + " | ".join(HELD_OUT_TEXTS) + " | bound |\n|---|" + "---:|" * len(HELD_OUT_TEXTS) + "---|")
    print("| fp32 (perplexity) | " + " | ".join(f"{p:.4f}" for p in results["fp32"][0].values()) + " | |")
    for spec in specs:
        if spec == "fp32":
            continue
        base, limit = results[base_spec(spec)][0], bound(spec)
        cells = []
        for name, p in results[spec][0].items():
            cell = f"{100 * (p / base[name] - 1):+.2f}%"
            cells.append(f"**{cell}**" if limit is not None and p / base[name] > limit else cell)
        over = f", over {build_flags(base_spec(spec))}" if base_spec(spec) != "fp32" else ""
        kept = f" ({results[spec][2]} linears kept bfloat16)" if results[spec][2] else ""
        print(f"| `{build_flags(spec)}`{kept}{over} | " + " | ".join(cells)
              + f" | {'' if limit is None else f'{100 * (limit - 1):+.0f}%'} |")
    print("\n| engine | " + " | ".join(a.strip() for _, _, a in FACT_PROBES) + " |\n|---|" + "---:|" * len(FACT_PROBES))
    for spec in wanted:
        print(f"| `{build_flags(spec)}` | " + " | ".join(f"{lp:.2f}" for lp in results[spec][1].values()) + " |")


if __name__ == "__main__":
    main()
