"""Measure AOTInductor settings for the CPU target on a SmolLM2-shaped network (first N layers of the
real checkpoint): compile time, package size, and step time of a generation step (B=1 and B=8, one token
each) and a context step (256 tokens), plus the KV-pool-size independence of the step time (in-place
KV write, no pool copy). Usage::

    python tests/builder/bench_compile.py HF_DIR [--num-layers 6] [--configs freezing,nofreezing]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/factories.py

from factories import make_engine_inputs  # noqa: E402

from kilnlm.builder.checkpoint import load_checkpoint  # noqa: E402
from kilnlm.builder.targets.cpu import CompileOptions, compile_engine  # noqa: E402
from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf  # noqa: E402
from kilnlm.plugins import load_cpu_kernels  # noqa: E402
from kilnlm.runtime.manifest import BuildConfig  # noqa: E402

CONFIGS = {
    "freezing": {"freezing": True},
    "nofreezing": {"freezing": False},
    "freezing_noprepack": {"freezing": True, "cpp.weight_prepack": False},
}


def time_step_ms(runner, inputs, kv_cache, num_iters: int) -> float:
    """Minimum over ``num_iters`` timed calls (the machine is shared: the minimum is the least disturbed)."""
    runner(*inputs.as_args(kv_cache))
    samples = []
    for _ in range(num_iters):
        t0 = time.perf_counter()
        runner(*inputs.as_args(kv_cache))
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--configs", default="nofreezing,freezing_noprepack,freezing")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    ck = load_checkpoint(args.hf_dir)
    ck.config.num_hidden_layers = args.num_layers
    state = {k: v for k, v in ck.state_dict.items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < args.num_layers}
    cfg = model_config_from_hf(ck.config)
    build = BuildConfig("fp32" if dtype == torch.float32 else "bf16", args.dtype, args.dtype, 32, 2048, 2048, 32, "cpu")
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq
    decode1 = make_engine_inputs([([42], 100)], tpb, max_blocks)
    decode8 = make_engine_inputs([([42], 100)] * 8, tpb, max_blocks)
    context = make_engine_inputs([(list(range(1000, 1256)), 0)], tpb, max_blocks)
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for name in args.configs.split(","):
            network = LlamaNetwork(cfg, state, dtype)
            package = Path(tmp) / f"{name}.pt2"
            t0 = time.perf_counter()
            compile_engine(network, cfg, build, dtype, package, CompileOptions(dict(CONFIGS[name])))
            print(f"{name:>18}: compile {time.perf_counter() - t0:5.1f} s, package {package.stat().st_size / 1e6:6.1f} MB",
                  flush=True)
            runners[name] = torch._inductor.aoti_load_package(str(package))
        small = torch.zeros(cfg.num_layers, 2, 8 * max_blocks, tpb, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        large = torch.zeros(cfg.num_layers, 2, 64 * max_blocks, tpb, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        results = {name: {} for name in runners}
        # Interleave the configurations round by round so that load from other processes hits all alike.
        for _ in range(args.rounds):
            for name, runner in runners.items():
                r = results[name]
                for key, inputs, pool, iters in (("decode B=1", decode1, small, 10), ("decode B=8", decode8, small, 5),
                                                  ("context T=256", context, small, 2),
                                                  ("decode B=1, 8x pool", decode1, large, 10)):
                    r[key] = min(r.get(key, float("inf")), time_step_ms(runner, inputs, pool, iters))
        print(f"min step times over {args.rounds} interleaved rounds (pool: {small.numel() * small.element_size() / 1e6:.0f} MB, "
              f"8x pool {large.numel() * large.element_size() / 1e6:.0f} MB):")
        for name, r in results.items():
            print(f"{name:>18}: " + ", ".join(f"{k} {v:7.2f} ms" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
