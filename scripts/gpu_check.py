#!/usr/bin/env python
"""Checks kilnlm's Triton paged-attention kernels (kilnlm.plugins.gpu) on a CUDA GPU against the plain-torch
reference, then times them.

Needs torch with CUDA and triton (no TensorRT); kilnlm importable (``pip install --no-deps .`` from the
repository root). Run::

    python scripts/gpu_check.py                # on the GPU machine; writes $OUT/gpu_check.json if OUT is set
    python scripts/gpu_check.py --interpret    # anywhere: TRITON_INTERPRET=1 on CPU tensors, tiny sizes

Checks, for each (activations, pool) in float32 / bfloat16 x (16/32-bit, fp8, int8) -- one packed batch of
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 32-token blocks): 8 context chunks of
200-500 new tokens (half of them after cached KV) and 32 generation tokens after ~1,000 cached ones, blocks
scattered over the pool, layer 1 of 2. The op runs through ``torch.ops.kilnlm.paged_attention`` (the CUDA
registration), and again as the TensorRT plugins' two kernels with TensorRT's launch ABI
(``paged_attention_tensorrt_abi``, the ``trt-abi`` cases); the reference runs on CPU copies.

- Output: max |out - ref| within atol / rtol 2e-5 (float32 activations: float32 arithmetic in another order,
  approximate exp2 / division) or 1e-2 (bfloat16: the kernels' tensor-core dots round the rotated q and the
  probabilities to bfloat16 over a bfloat16 pool, as FlashAttention does, and to float16 over an 8-bit
  pool; measured on an H200: max |err| 0.016 at |ref| up to ~2.7, ||err|| / ||ref|| 2.7e-3 over a bfloat16
  pool and 8.9e-4 over an 8-bit one). ||out - ref|| / ||ref|| is printed too.
- Pool: RoPE's cos / sin come from torch on the GPU here and on the CPU in the reference, and differ by an
  ulp in a few percent of entries. Bfloat16 / FP8 / int8 pools: equal except where that ulp falls right at
  a rounding boundary: one code off, at most 0.5% of the written elements. Float32 pools (no rounding step
  hides the ulps): within atol 1e-5, rtol 1e-6. The count of differing bytes is printed. Under --interpret
  both use the same torch CPU cos / sin: the pool must be bit-exact.
- Sweeps at position 0 (cos 1, sin 0, identical everywhere): every FP8 value, the midpoints between
  neighbours and the floats either side, out-of-range and subnormal values (int8 likewise), written and
  read back. Pool and output must be bit-exact.

Timing (bfloat16 activations, bfloat16 and fp8 pools; decode and prefill batches): one op call (RoPE
tables + KV write + attention) captured in a CUDA graph and replayed under ``triton.testing.do_bench``
(median), printed as µs, GB/s of KV read (every cached K/V byte read once) against the device-to-device
copy bandwidth measured here, and TFLOP/s; beside it the eager call (``do_bench`` of the op itself) and
the host time per eager call (back-to-back calls), which bound a batch that is not graph-captured. Exits 1
on any mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

# (name, activations, pool) of the checked cases.
FORMATS = [("f32/f32", "float32", "float32"), ("bf16/bf16", "bfloat16", "bfloat16"), ("f32/fp8", "float32", "fp8"),
           ("bf16/fp8", "bfloat16", "fp8"), ("f32/int8", "float32", "int8"), ("bf16/int8", "bfloat16", "int8")]
OUT_TOLERANCE = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}  # (atol, rtol)
POOL_MAX_DIFFERING = 0.005  # fraction of written elements allowed one step off (GPU cos / sin vs CPU)
POOL_F32_TOLERANCE = dict(atol=1e-5, rtol=1e-6)  # float32 pools: cos / sin ulps times |k| (no rounding step hides them)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run under TRITON_INTERPRET=1 on CPU tensors at tiny sizes (no GPU, no timing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-bench", action="store_true", help="checks only")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's @jit runs (kilnlm.plugins.gpu imports it)
    import torch

    from kilnlm.plugins import gpu
    from kilnlm.plugins.reference import KV_CACHE_QMAX, fitting_kv_scale, paged_attention_reference, quantize_kv_pool_reference

    device = "cpu" if args.interpret else "cuda"
    if not args.interpret and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or with --interpret", file=sys.stderr)
        return 2
    if args.interpret:
        op = gpu.paged_attention_triton
    else:
        gpu.register_cuda_kernels()
        op = torch.ops.kilnlm.paged_attention
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}

    import triton

    report = {"device": "interpreter (CPU)" if args.interpret else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "checks": [], "bench": []}
    print(f"device: {report['device']}  torch {torch.__version__}  triton {triton.__version__}")
    gen = torch.Generator().manual_seed(args.seed)

    if args.interpret:
        shape = dict(num_heads=6, num_kv_heads=2, head_dim=32, tokens_per_block=8)
        seqs = [(0, 13), (7, 9), (20, 1), (15, 1), (8, 1)]
    else:
        shape = dict(num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=32)
        new = torch.randint(200, 501, (8,), generator=gen).tolist()
        cached = [0] * 4 + torch.randint(1, 300, (4,), generator=gen).tolist()
        seqs = list(zip(cached, new)) + [(c, 1) for c in torch.randint(990, 1031, (32,), generator=gen).tolist()]

    def make_batch(seqs, act, kv, num_layers=2, layer_idx=1, spare_blocks=4):
        """A packed batch on CPU: (args without kv_scale, kv_scale or None). Blocks drawn at random from the pool."""
        tpb, num_kv_heads, head_dim = shape["tokens_per_block"], shape["num_kv_heads"], shape["head_dim"]
        blocks_per_seq = [-(-(c + n) // tpb) for c, n in seqs]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)
        start = 0
        for b, nblk in enumerate(blocks_per_seq):
            block_tables[b, :nblk] = perm[start:start + nblk]
            start += nblk
        num_new = torch.tensor([n for _, n in seqs])
        positions = torch.cat([torch.arange(c, c + n) for c, n in seqs])
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), num_new)
        slot_mapping = block_tables[seq_of_token, positions // tpb].to(torch.int64) * tpb + positions % tpb
        num_tokens = positions.numel()
        pool = torch.randn(num_layers, 2, num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
        q = torch.randn(num_tokens, shape["num_heads"], head_dim, generator=gen)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        kv_scale = None
        if dtypes[kv] in KV_CACHE_QMAX:
            kv_scale = fitting_kv_scale(k, v, dtypes[kv])
            pool = quantize_kv_pool_reference(pool, kv_scale, dtypes[kv])
        else:
            pool = pool.to(dtypes[kv])
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        cu_seqlens_q = torch.cat([torch.zeros(1, dtype=torch.int64), num_new.cumsum(0)]).to(torch.int32)
        seq_lens_kv = torch.tensor([c + n for c, n in seqs], dtype=torch.int32)
        act_dtype = dtypes[act]
        return [q.to(act_dtype), k.to(act_dtype), v.to(act_dtype), pool, layer_idx, positions, inv_freq, cu_seqlens_q,
                seq_lens_kv, block_tables, slot_mapping, head_dim ** -0.5], kv_scale

    def to_device(batch_args, kv_scale):
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in batch_args]
        return moved, None if kv_scale is None else kv_scale.to(device)

    def pool_steps(pool_a, pool_b):
        """Per-element distance between two pools of one dtype in representable steps (codes); float32: 1
        where the two differ by more than POOL_F32_TOLERANCE, else 0."""
        if pool_a.dtype == torch.float32:
            return (~torch.isclose(pool_a, pool_b, **POOL_F32_TOLERANCE, equal_nan=True)).int()
        if pool_a.dtype == torch.bfloat16:
            return (pool_a.view(torch.int16).int() - pool_b.view(torch.int16).int()).abs()
        if pool_a.dtype == torch.float8_e4m3fn:
            return (pool_a.view(torch.uint8).int() - pool_b.view(torch.uint8).int()).abs()
        return (pool_a.int() - pool_b.int()).abs()

    def check(name, act, batch_args, kv_scale, exact, kernel=None):
        record = {"case": name, "num_tokens": int(batch_args[0].shape[0]), "num_seqs": int(batch_args[8].shape[0])}
        try:
            dev_args, dev_scale = to_device(batch_args, kv_scale)
            t0 = time.perf_counter()
            out = (kernel or op)(*dev_args, dev_scale)
            if device == "cuda":
                torch.cuda.synchronize()
            record["first_call_s"] = round(time.perf_counter() - t0, 3)  # includes Triton's JIT compile
            out, pool_kernel = out.cpu(), dev_args[3].cpu()
            pool_ref = batch_args[3].clone()
            expected = paged_attention_reference(*batch_args[:3], pool_ref, *batch_args[4:], kv_scale)
            diff = out.float() - expected.float()
            err = diff.abs()
            atol, rtol = (0.0, 0.0) if exact else OUT_TOLERANCE[act]
            excess = err - (atol + rtol * expected.float().abs())
            steps = pool_steps(pool_kernel, pool_ref)
            num_written = 2 * int(batch_args[1].numel())
            differing = int((steps != 0).sum())
            record["pool_bytes_differing"] = int((pool_kernel.view(torch.uint8) != pool_ref.view(torch.uint8)).sum())
            record.update(out_max_abs_err=float(err.max()),
                          out_rel_l2=float(diff.norm() / expected.float().norm().clamp_min(1e-30)),
                          out_ok=bool(torch.isfinite(out.float()).all() and (excess <= 0).all()),
                          pool_differing=differing, pool_max_steps=float(steps.max()), pool_written=num_written)
            if exact or args.interpret:
                record["pool_ok"] = record["pool_bytes_differing"] == 0
            elif pool_kernel.dtype == torch.float32:
                record["pool_ok"] = differing == 0
            else:
                allowed = max(4, int(POOL_MAX_DIFFERING * num_written))
                record["pool_ok"] = bool(steps.max() <= 1 and differing <= allowed)
            record["ok"] = record["out_ok"] and record["pool_ok"]
        except Exception:  # reported as a failed case with its traceback; the run exits non-zero
            record.update(ok=False, error=traceback.format_exc())
        status = "PASS" if record["ok"] else "FAIL"
        detail = record.get("error") or (
            f"out max|err| {record['out_max_abs_err']:.3g} rel-l2 {record['out_rel_l2']:.2g}  pool: "
            f"{record['pool_bytes_differing']} bytes differ, {record['pool_differing']}/{record['pool_written']} "
            f"elements past tolerance (max {record['pool_max_steps']:.0f} step)  first call {record['first_call_s']} s")
        print(f"{status} {name:<22} T={record['num_tokens']:<5} B={record['num_seqs']:<3} {detail}", flush=True)
        report["checks"].append(record)

    for name, act, kv in FORMATS:
        batch_args, kv_scale = make_batch(seqs, act, kv)
        check(f"packed {name}", act, batch_args, kv_scale, exact=False)
    # The TensorRT plugins' kernels (paged_kv_write, paged_attention_core) launched as a plan launches them.
    for name, act, kv in FORMATS:
        batch_args, kv_scale = make_batch(seqs, act, kv)
        check(f"trt-abi {name}", act, batch_args, kv_scale, exact=False, kernel=gpu.paged_attention_tensorrt_abi)

    # Position-0 sweeps: every stored code, ties, saturation; bit-exact pool and output. Float32 activations
    # (float32 dots) and bfloat16 ones (the values rounded to bfloat16; float16 dots and decoders).
    for kv, scale, act in [(kv, scale, act) for kv in ("fp8", "int8") for scale in (1.0, 0.37)
                           for act in ("float32", "bfloat16")]:
        if kv == "fp8":
            values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
            values = values[values.isfinite()].unique()
            mids = (values[1:] + values[:-1]) / 2
            extra = torch.tensor([449.0, 464.0, 480.0, 1e6, 1e30, 2.0**-10, 3 * 2.0**-10, 2.0**-12, 1e-30])
            extra = torch.cat([extra, -extra])
        else:
            values = torch.arange(-130, 131, dtype=torch.float32)
            mids = values + 0.5
            extra = torch.tensor([1e6, -1e6, 1e-30, -1e-30])
        values = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(math.inf)),
                            torch.nextafter(mids, torch.tensor(-math.inf)), extra]) * scale
        per_token = shape["num_kv_heads"] * shape["head_dim"]
        num_tokens = -(-values.numel() // per_token)
        values = torch.cat([values, values.new_zeros(num_tokens * per_token - values.numel())])
        batch_args, _ = make_batch([(0, 1)] * num_tokens, "float32", "float32", num_layers=1, layer_idx=0)
        batch_args[2] = values.view(num_tokens, shape["num_kv_heads"], shape["head_dim"]).to(dtypes[act])
        batch_args[1] = values.flip(0).view(batch_args[2].shape).contiguous().to(dtypes[act])
        batch_args[0] = torch.zeros_like(batch_args[0]).to(dtypes[act])
        batch_args[3] = torch.zeros(batch_args[3].shape, dtype=dtypes[kv])
        label = f"sweep {kv} x{scale} {'f32' if act == 'float32' else 'bf16'}"
        check(label, act, batch_args, torch.tensor([scale, scale]), exact=True)

    if not args.interpret and not args.no_bench:
        bench(torch, triton, op, make_batch, to_device, shape, report)

    failed = [c["case"] for c in report["checks"] if not c["ok"]]
    report["ok"] = not failed
    print(f"{len(report['checks']) - len(failed)}/{len(report['checks'])} checks passed" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu_check.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
    return 0 if not failed else 1


def bench(torch, triton, op, make_batch, to_device, shape, report) -> None:
    """Times a decode and a prefill batch (bfloat16 activations; bfloat16 and FP8 pools)."""
    from triton.testing import do_bench

    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=50, return_mode="median")
    copy_gbps = 2 * copy_src.numel() / copy_ms / 1e6  # bytes read + written
    del copy_src, copy_dst
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    report["copy_gbps"] = copy_gbps
    gen = torch.Generator().manual_seed(1)
    batches = {
        "decode 32 x ~1000": [(c, 1) for c in torch.randint(990, 1031, (32,), generator=gen).tolist()],
        "decode 128 x 2048": [(2047, 1)] * 128,
        "prefill 8 x 512": [(0, 512)] * 8,
        "prefill 2 x 2048": [(0, 2048)] * 2,
    }
    kv_bytes_per_token = 2 * shape["num_kv_heads"] * shape["head_dim"]  # K and V elements
    for label, seqs in batches.items():
        for kv in ("bfloat16", "fp8"):
            batch_args, kv_scale = make_batch(seqs, "bfloat16", kv, num_layers=1, layer_idx=0, spare_blocks=0)
            dev_args, dev_scale = to_device(batch_args, kv_scale)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compile, and warm up outside the capture
                for _ in range(3):
                    op(*dev_args, dev_scale)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                op(*dev_args, dev_scale)
            graph_ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
            eager_ms = do_bench(lambda: op(*dev_args, dev_scale), warmup=25, rep=200, return_mode="median")
            torch.cuda.synchronize()
            start, calls = time.perf_counter(), 50
            for _ in range(calls):
                op(*dev_args, dev_scale)
            torch.cuda.synchronize()
            host_us = (time.perf_counter() - start) / calls * 1e6
            kv_tokens = sum(c + n for c, n in seqs)
            kv_read_bytes = kv_tokens * kv_bytes_per_token * (1 if kv == "fp8" else 2)
            pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)  # (query, key) pairs attended
            tflops = 4 * pairs * shape["num_heads"] * shape["head_dim"] / graph_ms / 1e9
            gbps = kv_read_bytes / graph_ms / 1e6
            record = {"batch": label, "pool": kv, "graph_us": graph_ms * 1e3, "eager_us": eager_ms * 1e3,
                      "host_us_per_call": host_us, "kv_read_bytes": kv_read_bytes, "kv_read_gbps": gbps,
                      "tflops": tflops, "fraction_of_copy_bw": gbps / copy_gbps}
            report["bench"].append(record)
            print(f"bench {label:<18} pool {kv:<8} graph {graph_ms * 1e3:7.1f} us  KV read {gbps:6.0f} GB/s "
                  f"({100 * gbps / copy_gbps:4.1f}% of copy)  {tflops:6.1f} TFLOP/s | eager {eager_ms * 1e3:6.1f} us, "
                  f"host {host_us:5.1f} us/call", flush=True)
            del graph, dev_args

if __name__ == "__main__":
    sys.exit(main())
