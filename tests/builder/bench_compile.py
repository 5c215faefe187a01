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
from kilnlm.builder.compile import CompileOptions, compile_engine  # noqa: E402
from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf  # noqa: E402
from kilnlm.plugins import load_cpu_kernels  # noqa: E402
from kilnlm.runtime.manifest import BuildConfig  # noqa: E402

CONFIGS = {"freezing": {"freezing": True}, "nofreezing": {"freezing": False}}


def time_step_ms(runner, inputs, kv_cache, num_iters: int) -> float:
    for _ in range(3):
        runner(*inputs.as_args(kv_cache))
    samples = []
    for _ in range(num_iters):
        t0 = time.perf_counter()
        runner(*inputs.as_args(kv_cache))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--configs", default="freezing,nofreezing")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
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
        for name in args.configs.split(","):
            network = LlamaNetwork(cfg, state, dtype)
            package = Path(tmp) / f"{name}.pt2"
            t0 = time.perf_counter()
            compile_engine(network, cfg, build, dtype, package, CompileOptions(dict(CONFIGS[name])))
            compile_s = time.perf_counter() - t0
            runner = torch._inductor.aoti_load_package(str(package))
            small = torch.zeros(cfg.num_layers, 2, 8 * max_blocks, tpb, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
            large = torch.zeros(cfg.num_layers, 2, 64 * max_blocks, tpb, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
            print(f"{name:>11}: compile {compile_s:5.1f} s, package {package.stat().st_size / 1e6:6.1f} MB, "
                  f"decode B=1 {time_step_ms(runner, decode1, small, 30):6.2f} ms, "
                  f"decode B=8 {time_step_ms(runner, decode8, small, 20):6.2f} ms, "
                  f"context T=256 {time_step_ms(runner, context, small, 5):7.1f} ms, "
                  f"decode B=1 with an 8x larger pool ({large.numel() * large.element_size() / 1e9:.2f} GB) "
                  f"{time_step_ms(runner, decode1, large, 30):6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
