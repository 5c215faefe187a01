"""Benchmark the executor on a built engine: N concurrent requests, in-flight batched.

Prints generated-token throughput, TTFT and ITL (mean / p90), and the runtime's own share of each iteration
(schedule + prepare + sample + update) against the limit, the engine forward time::

    .venv/bin/python scripts/bench_executor.py --engine ENGINE_DIR --num-requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.memory import wait_until_populated
from kilnlm.runtime.request import SamplingParams


class TimedEngine:
    """Wraps an engine and accumulates the wall time of its forward calls."""

    def __init__(self, engine):
        self._engine = engine
        self.forward_s = 0.0
        self.num_forwards = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def forward(self, inputs, kv_cache):
        start_s = time.perf_counter()
        logits = self._engine.forward(inputs, kv_cache)
        self.forward_s += time.perf_counter() - start_s
        self.num_forwards += 1
        return logits


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))] if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="engine directory")
    parser.add_argument("--num-requests", type=int, default=16, help="concurrent requests (default: 16)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default: 128)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="executor batch limit (default: engine's)")
    parser.add_argument("--max-num-tokens", type=int, default=None, help="executor token budget (default: engine's)")
    args = parser.parse_args()

    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.tokenizer import Tokenizer

    engine = TimedEngine(Engine.load(args.engine))
    config = ExecutorConfig(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens)
    executor = Executor(engine, Tokenizer.from_dir(engine.tokenizer_dir), config)
    wait_until_populated()  # the KV pool faulted in first: its thread would take a core from the forwards
    vocab = executor.vocab_size
    ttft_s: list[float] = []
    itl_s: list[float] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        # Distinct prompts (no prefix sharing), deterministic content.
        prompt = [(1000 + 7919 * (i * args.prompt_tokens + j)) % (vocab - 1000) + 1000 for j in range(args.prompt_tokens)]
        start_s = time.perf_counter()
        last_s = None
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for response in executor.stream(executor.submit(prompt, params)):
            now_s = time.perf_counter()
            with lock:
                if last_s is None:
                    ttft_s.append(now_s - start_s)
                else:
                    itl_s.append(now_s - last_s)
            last_s = now_s

    start_s = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.num_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total_s = time.perf_counter() - start_s
    stats = executor.stats()
    executor.shutdown()

    num_generated = args.num_requests * args.max_tokens
    overhead_s = total_s - engine.forward_s
    print(f"{args.num_requests} requests x ({args.prompt_tokens} prompt + {args.max_tokens} generated) tokens in {total_s:.2f} s")
    print(f"throughput: {num_generated / total_s:.1f} generated tokens/s "
          f"({(num_generated + args.num_requests * args.prompt_tokens) / total_s:.1f} tokens/s incl. context)")
    print(f"TTFT: mean {1e3 * statistics.mean(ttft_s):.1f} ms, p90 {1e3 * p90(ttft_s):.1f} ms")
    print(f"ITL:  mean {1e3 * statistics.mean(itl_s):.1f} ms, p90 {1e3 * p90(itl_s):.1f} ms")
    print(f"iterations: {engine.num_forwards}, engine forward {engine.forward_s:.2f} s; runtime overhead "
          f"(wall - forward) {overhead_s:.2f} s = {1e3 * overhead_s / max(engine.num_forwards, 1):.2f} ms/iteration, "
          f"{100 * overhead_s / total_s:.1f}% of wall time (the limit is 0%); preemptions {stats.num_preemptions}")


if __name__ == "__main__":
    main()
