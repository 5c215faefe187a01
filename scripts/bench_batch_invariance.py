"""What KILNLM_BATCH_INVARIANT=1 costs: each engine's context phase, batch-1 decode and a 16-request batch,
with the switch off and on, side by side in one process (the kernels read the switch at every call, so it
flips between runs; the two settings alternate within each round, and each figure is the best of the
rounds)::

    .venv/bin/python scripts/bench_batch_invariance.py --engine ENGINE_DIR [--engine ENGINE_DIR ...]

Scenarios, each on a fresh executor (no prefix cache carried over), greedy, EOS ignored:
  context   one 512-token prompt, 1 output token: time to first token (the context phase's GEMMs)
  decode    one 16-token prompt, 64 output tokens: generated tokens/s after the first
  batch     16 distinct 128-token prompts submitted together, 32 output tokens each: generated tokens/s
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from kilnlm.runtime.engine import Engine
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.request import SamplingParams
from kilnlm.runtime.tokenizer import Tokenizer

SWITCH = "KILNLM_BATCH_INVARIANT"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def prompt(vocab_size: int, seed: int, length: int) -> list[int]:
    """Deterministic distinct token ids (no shared prefixes between seeds)."""
    return [(1000 + 7919 * (seed * length + j)) % (vocab_size - 1000) + 1000 for j in range(length)]


def run(engine, tokenizer, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token of the first request, generated tokens/s after the first tokens)."""
    executor = Executor(engine, tokenizer, ExecutorConfig())
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        start_s = time.perf_counter()
        ids = [executor.submit(p, params) for p in prompts]
        first_s = None
        for i in ids:
            for _ in executor.stream(i, timeout_s=600):
                first_s = first_s or time.perf_counter()
        end_s = time.perf_counter()
    finally:
        executor.shutdown()
    decoded = len(prompts) * (max_tokens - 1)
    return first_s - start_s, decoded / (end_s - first_s) if decoded else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", required=True, help="engine directory (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of off / on per scenario (default: 3)")
    args = parser.parse_args()

    print(f"{cpu_model()}, {torch.get_num_threads()} threads; best of {args.rounds} rounds, switch off and on alternating")
    print(f"{'engine':24s} {'scenario':10s} {'off':>12s} {'on':>12s} {'on/off time':>12s}")
    for engine_dir in args.engine:
        engine = Engine.load(engine_dir)
        tokenizer = Tokenizer.from_dir(engine.tokenizer_dir)
        vocab = engine.manifest.model.vocab_size
        scenarios = {  # name -> (prompts, max_tokens, metric index in run()'s result, unit)
            "context": ([prompt(vocab, 0, 512)], 1, 0, "ms TTFT"),
            "decode": ([prompt(vocab, 1, 16)], 64, 1, "tok/s"),
            "batch": ([prompt(vocab, 2 + i, 128) for i in range(16)], 32, 1, "tok/s"),
        }
        for name, (prompts, max_tokens, index, unit) in scenarios.items():
            best: dict[bool, float] = {}
            for _ in range(args.rounds):
                for switch in (False, True):
                    if switch:
                        os.environ[SWITCH] = "1"
                    else:
                        os.environ.pop(SWITCH, None)
                    value = run(engine, tokenizer, prompts, max_tokens)[index]
                    keep = min if index == 0 else max  # the fastest: least time, most tokens/s
                    best[switch] = keep(best.get(switch, value), value)
            os.environ.pop(SWITCH, None)
            off, on = best[False], best[True]
            scale = 1e3 if index == 0 else 1.0
            time_ratio = on / off if index == 0 else off / on
            print(f"{Path(engine_dir).name:24s} {name:10s} {off * scale:8.1f} {unit.split()[0]:>3s} "
                  f"{on * scale:8.1f} {unit.split()[0]:>3s} {time_ratio:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
