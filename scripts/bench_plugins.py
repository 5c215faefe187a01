"""Microbenchmarks of kilnlm's C++ CPU kernels, printed against what limits them.

Every cold-weight sweep reads weights packed on transparent huge pages, as an engine's sit (on_huge_pages).

- gemm (the bf16 linear layers and LM head, ``--only gemm``): a cold-weight pass over SmolLM2's 30 layers
  and LM head at T = 1 / 4 / 16 / 32 / 64 / 128 tokens, kilnlm::gemm against F.linear (oneDNN), with GB/s of weights.
- fp8_linear on SmolLM2-135M's projection shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
  576x1536) at T = 1 / 32 / 256 tokens, against torch's float32 and bfloat16 linear (at::mm / oneDNN) on
  the same shapes. GB/s counts weight bytes read once per call (1 byte per FP8 weight, 2 per bf16, 4 per
  fp32): the generation phase (T=1) is memory bound, so GB/s is the figure of merit there; GFLOP/s is
  printed for the larger T.
- fp8_rowwise_linear (``--only fp8_rowwise``; per-channel weight scales, per-token activation scales computed
  per call) side by side with fp8_linear (per-tensor, static activation scale) on the same weights, SmolLM2's
  shapes at T = 1 / 4 / 32 / 256 and a cold-weight decode sweep of 30 layers: what the per-token amax pass
  and the per-token epilogue cost (minimum of repeats; "rowwise / fp8" is the time ratio).
- paged_attention in the generation phase (batch 1 and 32, KV length 512) and for one 256-token context
  chunk, SmolLM2's heads (9 query / 3 KV heads, head_dim 64), against dense (unpaged) SDPA of the same
  problem. GB/s counts the K/V bytes read.

- The quantized GEMMs (int4_linear W4A16 with group size 64, symmetric and with zero points as int4_awq
  builds it, int8_linear W8A16, int8_sq_linear W8A8) on
  the same shapes at T = 1 (generation phase) and T = 256 (context phase), against bf16 F.linear. Weight
  GB/s counts the packed weight bytes *and* their scales, read once per call; each figure is the minimum
  over repeats (the machine may be shared), and "x bf16" is the speed-up over bf16 F.linear. Then a cold-
  weight decode sweep of 30 layers per format (what one engine decode step reads).
- paged_attention with an 8-bit KV pool (``--only kv8``): bfloat16 activations over a bfloat16, an FP8
  (E4M3) and an int8 pool with per-layer scales, generation phase (B=1 / 32, KV 512; B=8, KV 2048) and one
  256-token context chunk; time per layer call, KV GB/s (bytes of the pool read), and SmolLM2's KV bytes
  per token for each pool dtype.

Usage: python scripts/bench_plugins.py [--threads N] [--dtype float32|bfloat16] [--min-time-s 0.2]
       [--only gemm|fp8|fp8_rowwise|quant|attention|kv8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kilnlm.plugins import load_cpu_kernels

SMOLLM2_LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def time_call(fn: Callable[[], object], min_time_s: float) -> float:
    """Median seconds per call over repeats of at least min_time_s / 5 each (after a warm-up)."""
    for _ in range(3):
        fn()
    samples = []
    deadline = time.perf_counter() + min_time_s
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_fp8_linear(min_time_s: float) -> None:
    print("fp8_linear  (weight GB/s = weight bytes / time; fp8 reads 1 B/weight, bf16 2 B, fp32 4 B)")
    print(f"{'layer':>8} {'T':>4} | {'fp8 us':>8} {'GB/s':>6} {'GFLOP/s':>8} | {'bf16 us':>8} {'GB/s':>6} | "
          f"{'fp32 us':>8} {'GB/s':>6} | fp8 vs bf16")
    gen = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in SMOLLM2_LINEARS.items():
        weight = torch.randn(out_features, in_features, generator=gen)
        w_fp8 = (weight * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_bf16, scale = weight.to(torch.bfloat16), torch.tensor(0.01)
        for num_tokens in (1, 32, 256):
            x = torch.randn(num_tokens, in_features, generator=gen)
            x_bf16 = x.to(torch.bfloat16)
            t_fp8 = time_call(lambda: torch.ops.kilnlm.fp8_linear(x, w_fp8, scale, scale, None), min_time_s)
            t_bf16 = time_call(lambda: F.linear(x_bf16, w_bf16), min_time_s)
            t_fp32 = time_call(lambda: F.linear(x, weight), min_time_s)
            num_weights = out_features * in_features
            gflops = 2 * num_weights * num_tokens / t_fp8 / 1e9
            print(f"{name:>8} {num_tokens:>4} | {t_fp8 * 1e6:8.1f} {num_weights / t_fp8 / 1e9:6.1f} {gflops:8.1f} | "
                  f"{t_bf16 * 1e6:8.1f} {2 * num_weights / t_bf16 / 1e9:6.1f} | "
                  f"{t_fp32 * 1e6:8.1f} {4 * num_weights / t_fp32 / 1e9:6.1f} | {t_bf16 / t_fp8:5.2f}x")


def time_call_min(fn: Callable[[], object], min_time_s: float) -> float:
    """Minimum seconds per call over at least 10 repeats and min_time_s (after a warm-up): on a shared
    machine the minimum is the least disturbed figure."""
    for _ in range(3):
        fn()
    best, count = float("inf"), 0
    deadline = time.perf_counter() + min_time_s
    while time.perf_counter() < deadline or count < 10:
        start = time.perf_counter()
        fn()
        best, count = min(best, time.perf_counter() - start), count + 1
    return best


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` packed into one buffer on transparent huge pages, each on a 64-byte boundary, as
    an engine's weights sit (the loader's ``realign_constants``, kilnlm.runtime.memory): a cold sweep over
    4 KiB pages would also time TLB misses and hardware prefetchers stopping at every page boundary, which
    an engine's decode step does not pay."""
    from kilnlm.runtime.memory import HUGE_PAGE_BYTES, advise_huge_pages

    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buffer = torch.empty(sum(sizes) + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
    advise_huge_pages(buffer.data_ptr() + offset, buffer.data_ptr() + buffer.numel())
    copies = []
    for t, size in zip(tensors, sizes):
        copy = buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
        offset += size
    return copies


INT4_GROUP_SIZE = 64  # AWQ's usual 128 does not divide SmolLM2's hidden size 576


def quantized_layer(out_features: int, in_features: int, gen: torch.Generator) -> dict[str, tuple]:
    """Random weights of one layer in each quantized format: {format: (op args after x, weight bytes)}."""
    from kilnlm.plugins import pack_int4

    q4 = pack_int4(torch.randint(-8, 8, (out_features, in_features), generator=gen))
    s4 = torch.rand(out_features, in_features // INT4_GROUP_SIZE, generator=gen) * 0.02
    z4 = torch.randint(-8, 8, s4.shape, generator=gen, dtype=torch.int8)
    q8 = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    s8 = torch.rand(out_features, generator=gen) * 0.01
    return {
        "int4": ((q4, s4, None, None, INT4_GROUP_SIZE), q4.numel() + 4 * s4.numel()),
        "int4_zp": ((q4, s4, None, None, INT4_GROUP_SIZE, z4), q4.numel() + 5 * s4.numel()),
        "int8_wo": ((q8, s8, None), q8.numel() + 4 * s8.numel()),
        "int8_sq": ((q8, s8, torch.tensor(0.02), None, None), q8.numel() + 4 * s8.numel()),
    }


QUANT_OPS = {"int4": "int4_linear", "int4_zp": "int4_linear", "int8_wo": "int8_linear", "int8_sq": "int8_sq_linear"}


def bench_quantized_linear(dtype: torch.dtype, min_time_s: float) -> None:
    print(f"\nquantized GEMMs, x {dtype} (weight GB/s = packed weight + scale bytes / time; minimum of repeats; "
          f"int4 group size {INT4_GROUP_SIZE}; x bf16 = speed-up over bf16 F.linear)")
    print(f"{'layer':>8} {'T':>4} | {'bf16 us':>8} {'GB/s':>6} | " +
          " | ".join(f"{fmt + ' us':>11} {'GB/s':>6} {'x bf16':>6}" for fmt in QUANT_OPS))
    gen = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in SMOLLM2_LINEARS.items():
        formats = quantized_layer(out_features, in_features, gen)
        w_bf16 = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        for num_tokens in (1, 256):
            x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
            x_bf16 = x.to(torch.bfloat16)
            t_bf16 = time_call_min(lambda: F.linear(x_bf16, w_bf16), min_time_s)
            cells = []
            for fmt, (args, num_bytes) in formats.items():
                op = getattr(torch.ops.kilnlm, QUANT_OPS[fmt])
                t = time_call_min(lambda: op(x, *args), min_time_s)
                cells.append(f"{t * 1e6:11.1f} {num_bytes / t / 1e9:6.1f} {t_bf16 / t:5.2f}x")
            print(f"{name:>8} {num_tokens:>4} | {t_bf16 * 1e6:8.1f} {2 * w_bf16.numel() / t_bf16 / 1e9:6.1f} | " +
                  " | ".join(cells))


def bench_quantized_decode_sweep(dtype: torch.dtype, min_time_s: float, num_layers: int = 30) -> None:
    """Generation phase with cold weights: T=1 over the four projections of num_layers distinct layers in
    each format (int4 ~27 MB, int8 ~53 MB, bf16 ~106 MB: the larger ones exceed the L3 cache), as one
    decode step of an engine reads them."""
    gen = torch.Generator().manual_seed(4)
    layers = [{name: quantized_layer(o, i, gen) for name, (o, i) in SMOLLM2_LINEARS.items()} for _ in range(num_layers)]
    bf16 = on_huge_pages([torch.randn(o, i, generator=gen).to(torch.bfloat16) for _ in range(num_layers)
                          for o, i in SMOLLM2_LINEARS.values()])
    xs = {i: torch.randn(1, i, generator=gen).to(dtype) for _, i in SMOLLM2_LINEARS.values()}
    xs_bf16 = {i: t.to(torch.bfloat16) for i, t in xs.items()}
    num_bf16_bytes = 2 * sum(w.numel() for w in bf16)
    t_bf16 = time_call_min(lambda: [F.linear(xs_bf16[w.shape[1]], w) for w in bf16], min_time_s)
    print(f"\nquantized generation phase, cold weights: {num_layers} layers x (qkv, o, gate_up, down) at T=1, x {dtype}")
    print(f"{'bf16 F.linear':>14}: {t_bf16 * 1e3:7.2f} ms per step, {num_bf16_bytes / t_bf16 / 1e9:6.1f} GB/s")
    for fmt, op_name in QUANT_OPS.items():
        op = getattr(torch.ops.kilnlm, op_name)
        calls = [(xs[args[0].shape[1] * (2 if fmt.startswith("int4") else 1)], args)
                 for layer in layers for formats in layer.values() for args in [formats[fmt][0]]]
        is_array = lambda a: isinstance(a, torch.Tensor) and a.dim() > 0  # weights, scales, zero points
        moved = iter(on_huge_pages([a for _, args in calls for a in args if is_array(a)]))
        calls = [(x, tuple(next(moved) if is_array(a) else a for a in args)) for x, args in calls]
        num_bytes = sum(formats[fmt][1] for layer in layers for formats in layer.values())
        t = time_call_min(lambda: [op(x, *args) for x, args in calls], min_time_s)
        print(f"{fmt:>14}: {t * 1e3:7.2f} ms per step, {num_bytes / t / 1e9:6.1f} GB/s, {t_bf16 / t:5.2f}x bf16")


def bench_fp8_decode_sweep(min_time_s: float, num_layers: int = 30) -> None:
    """Generation phase with cold weights: one T=1 pass over SmolLM2's four projections of num_layers
    distinct layers (fp8 ~106 MB, more than the L3 cache), as one decode step of the engine reads them."""
    gen = torch.Generator().manual_seed(2)
    layers = [{name: torch.randn(o, i, generator=gen) for name, (o, i) in SMOLLM2_LINEARS.items()}
              for _ in range(num_layers)]
    num_weights = sum(o * i for o, i in SMOLLM2_LINEARS.values()) * num_layers
    scale = torch.tensor(0.01)
    fp8 = on_huge_pages([(w * 30).clamp(-448, 448).to(torch.float8_e4m3fn) for layer in layers for w in layer.values()])
    bf16 = on_huge_pages([w.to(torch.bfloat16) for layer in layers for w in layer.values()])
    layers = on_huge_pages([w for layer in layers for w in layer.values()])
    x = {i: torch.randn(1, i, generator=gen) for _, i in SMOLLM2_LINEARS.values()}
    x_bf16 = {i: t.to(torch.bfloat16) for i, t in x.items()}

    def sweep_fp8():
        for w in fp8:
            torch.ops.kilnlm.fp8_linear(x[w.shape[1]], w, scale, scale, None)

    def sweep(weights, xs):
        return lambda: [F.linear(xs[w.shape[1]], w) for w in weights]

    print(f"\nfp8_linear generation phase, cold weights: {num_layers} layers x (qkv, o, gate_up, down) at T=1")
    for label, fn, bytes_per_weight in (("fp8 (kilnlm)", sweep_fp8, 1), ("bf16 F.linear", sweep(bf16, x_bf16), 2),
                                        ("fp32 F.linear", sweep(layers, x), 4)):
        t = time_call(fn, min_time_s)
        print(f"{label:>14}: {t * 1e3:7.2f} ms per step, {bytes_per_weight * num_weights / t / 1e9:6.1f} GB/s, "
              f"{num_weights / t / 1e9:5.1f} G weights/s")


def bench_fp8_rowwise(dtype: torch.dtype, min_time_s: float, num_layers: int = 30) -> None:
    gen = torch.Generator().manual_seed(5)
    w_scale, x_scale = torch.tensor(0.01), torch.tensor(0.05)
    print(f"\nfp8_rowwise_linear vs fp8_linear, x {dtype} (weight GB/s = 1 B per weight / time; minimum of repeats)")
    print(f"{'layer':>8} {'T':>4} | {'fp8 us':>8} {'GB/s':>6} | {'rowwise us':>10} {'GB/s':>6} | rowwise / fp8")
    for name, (out_features, in_features) in SMOLLM2_LINEARS.items():
        w = (torch.randn(out_features, in_features, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
        row_scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-3
        for num_tokens in (1, 4, 32, 256):
            x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
            t_fp8 = time_call_min(lambda: torch.ops.kilnlm.fp8_linear(x, w, w_scale, x_scale, None), min_time_s)
            t_row = time_call_min(lambda: torch.ops.kilnlm.fp8_rowwise_linear(x, w, row_scale, None), min_time_s)
            gbs = w.numel() / 1e9
            print(f"{name:>8} {num_tokens:>4} | {t_fp8 * 1e6:8.1f} {gbs / t_fp8:6.1f} | {t_row * 1e6:10.1f} "
                  f"{gbs / t_row:6.1f} | {t_row / t_fp8:5.3f}")
    shapes = list(SMOLLM2_LINEARS.values()) * num_layers
    weights = on_huge_pages([(torch.randn(o, i, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
                             for o, i in shapes])
    layers = list(zip(weights, on_huge_pages([torch.rand(o, generator=gen) * 0.01 + 1e-3 for o, _ in shapes])))
    xs = {i: torch.randn(1, i, generator=gen).to(dtype) for _, i in SMOLLM2_LINEARS.values()}
    num_bytes = sum(w.numel() for w in weights)
    fp8 = lambda: [torch.ops.kilnlm.fp8_linear(xs[w.shape[1]], w, w_scale, x_scale, None) for w, _ in layers]
    rowwise = lambda: [torch.ops.kilnlm.fp8_rowwise_linear(xs[w.shape[1]], w, s, None) for w, s in layers]
    print(f"cold weights: {num_layers} layers x (qkv, o, gate_up, down) at T=1 ({num_bytes / 1e6:.0f} MB), alternating")
    times = {"fp8": [], "rowwise": []}
    for _ in range(3):  # alternate, so that both see the same machine load
        times["fp8"].append(time_call_min(fp8, min_time_s))
        times["rowwise"].append(time_call_min(rowwise, min_time_s))
    t_fp8, t_row = min(times["fp8"]), min(times["rowwise"])
    print(f"{'fp8':>8}: {t_fp8 * 1e3:7.2f} ms per step, {num_bytes / t_fp8 / 1e9:6.1f} GB/s")
    print(f"{'rowwise':>8}: {t_row * 1e3:7.2f} ms per step, {num_bytes / t_row / 1e9:6.1f} GB/s, {t_row / t_fp8:5.3f}x fp8")


def bench_gemm_sweep(min_time_s: float, dtype: torch.dtype, num_layers: int = 30) -> None:
    """kilnlm::gemm against F.linear (oneDNN / MKL) on cold weights of ``dtype``: SmolLM2's four projections
    of num_layers distinct layers plus the [49152, 576] LM head (~269 MB in bf16, far more than the L3
    cache), at the token counts of a decode step with T sequences -- where kMaxDirectTokens (bf16) and
    kMaxGemvTokensF32 (float32) in csrc/gemm.cpp come from. Past those limits kilnlm::gemm is F.linear
    itself, so the kilnlm column is timed with KILNLM_BATCH_INVARIANT=1, which keeps its own kernel on at
    every token count."""
    gen = torch.Generator().manual_seed(4)
    weights = [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for _ in range(num_layers)
               for o, i in SMOLLM2_LINEARS.values()]
    weights.append((torch.randn(49152, 576, generator=gen) * 0.05).to(dtype))
    weights = on_huge_pages(weights)
    num_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"\ngemm ({dtype}), cold weights: {num_layers} layers x (qkv, o, gate_up, down) + LM head, "
          f"{num_bytes / 1e6:.0f} MB per pass")
    print(f"{'T':>4} | {'F.linear ms':>11} {'GB/s':>6} | {'kilnlm ms':>9} {'GB/s':>6} | {'x':>5}")
    for num_tokens in (1, 4, 16, 32, 64, 128):
        xs = {i: torch.randn(num_tokens, i, generator=gen).to(dtype) for i in (576, 1536)}
        t_aten = time_call_min(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], min_time_s)
        os.environ["KILNLM_BATCH_INVARIANT"] = "1"
        try:
            t_ours = time_call_min(lambda: [torch.ops.kilnlm.gemm(xs[w.shape[1]], w, None) for w in weights], min_time_s)
        finally:
            os.environ.pop("KILNLM_BATCH_INVARIANT")
        print(f"{num_tokens:>4} | {t_aten * 1e3:11.2f} {num_bytes / t_aten / 1e9:6.1f} | {t_ours * 1e3:9.2f} "
              f"{num_bytes / t_ours / 1e9:6.1f} | {t_aten / t_ours:5.2f}")


def paged_batch(seqs: list[tuple[int, int]], dtype: torch.dtype, tokens_per_block: int):
    """Arguments of paged_attention for sequences (num_cached, num_new), blocks shuffled in the pool."""
    gen = torch.Generator().manual_seed(1)
    blocks_per_seq = [-(-(c + n) // tokens_per_block) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 8
    pool = torch.randn(1, 2, num_blocks, tokens_per_block, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    positions, slots, used = [], [], 0
    for b, ((c, n), nblk) in enumerate(zip(seqs, blocks_per_seq)):
        tables[b, :nblk] = perm[used:used + nblk].to(torch.int32)
        used += nblk
        positions += range(c, c + n)
        slots += [int(tables[b, p // tokens_per_block]) * tokens_per_block + p % tokens_per_block for p in range(c, c + n)]
    num_tokens = len(positions)
    new = torch.tensor([n for _, n in seqs])
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    return (q, k, v, pool, 0, torch.tensor(positions), inv_freq,
            torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32),
            torch.tensor([c + n for c, n in seqs], dtype=torch.int32), tables, torch.tensor(slots),
            HEAD_DIM ** -0.5)


def bench_paged_attention(dtype: torch.dtype, min_time_s: float) -> None:
    print(f"\npaged_attention  ({dtype}, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}; "
          "KV GB/s = K/V bytes read / time; dense = SDPA on contiguous KV, no paging, no RoPE)")
    print(f"{'case':>28} {'tpb':>4} | {'paged us':>9} {'KV GB/s':>8} | {'dense us':>9}")
    elem_bytes = torch.empty(0, dtype=dtype).element_size()
    cases = {"decode B=1 kv=512": [(511, 1)], "decode B=32 kv=512": [(511, 1)] * 32,
             "context chunk 256 (first)": [(0, 256)], "context chunk 256 after 256": [(256, 256)]}
    for label, seqs in cases.items():
        for tokens_per_block in (16, 32):
            args = paged_batch(seqs, dtype, tokens_per_block)
            t = time_call(lambda: torch.ops.kilnlm.paged_attention(*args), min_time_s)
            kv_bytes = sum(c + n for c, n in seqs) * NUM_KV_HEADS * HEAD_DIM * 2 * elem_bytes
            # Dense reference problem: every sequence's queries over its contiguous K/V.
            num_new, kv_len = seqs[0][1], sum(seqs[0])
            qd = torch.randn(len(seqs), NUM_HEADS, num_new, HEAD_DIM).to(dtype)
            kd = torch.randn(len(seqs), NUM_KV_HEADS, kv_len, HEAD_DIM).to(dtype)
            mask = torch.ones(num_new, kv_len, dtype=torch.bool).tril(diagonal=kv_len - num_new)
            t_dense = time_call(lambda: F.scaled_dot_product_attention(qd, kd, kd, attn_mask=mask, enable_gqa=True),
                                min_time_s)
            print(f"{label:>28} {tokens_per_block:>4} | {t * 1e6:9.1f} {kv_bytes / t / 1e9:8.2f} | {t_dense * 1e6:9.1f}")


def bench_kv8_attention(min_time_s: float) -> None:
    from kilnlm.plugins import KV_CACHE_QMAX, quantize_kv_pool_reference

    num_layers = 30  # SmolLM2-135M
    print(f"\npaged_attention with 8-bit KV pools (bfloat16 activations, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}, tokens_per_block 32; per layer call)")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn),
                        ("int8", torch.int8)):
        per_token = num_layers * 2 * NUM_KV_HEADS * HEAD_DIM * torch.empty(0, dtype=dtype).element_size()
        print(f"  SmolLM2 KV bytes per token, {name:>8} pool: {per_token:,}")
    print(f"{'case':>28} | {'bf16 us':>8} {'GB/s':>6} | {'fp8 us':>8} {'GB/s':>6} {'x bf16':>6} | "
          f"{'int8 us':>8} {'GB/s':>6} {'x bf16':>6}")
    cases = {"decode B=1 kv=512": [(511, 1)], "decode B=32 kv=512": [(511, 1)] * 32,
             "decode B=8 kv=2048": [(2047, 1)] * 8, "context chunk 256 after 256": [(256, 256)]}
    for label, seqs in cases.items():
        args = paged_batch(seqs, torch.bfloat16, 32)
        pool = args[3]
        num_kv = sum(c + n for c, n in seqs) * NUM_KV_HEADS * HEAD_DIM * 2
        row = [f"{label:>28}"]
        t_bf16 = time_call_min(lambda: torch.ops.kilnlm.paged_attention(*args), min_time_s)
        row.append(f"{t_bf16 * 1e6:8.1f} {num_kv * 2 / t_bf16 / 1e9:6.2f}")
        for kv_dtype, qmax in KV_CACHE_QMAX.items():
            kv_scale = torch.tensor([4.0 / qmax, 4.0 / qmax])  # randn pool: |x| <= ~4.5
            pool8 = quantize_kv_pool_reference(pool, kv_scale, kv_dtype)
            args8 = args[:3] + (pool8,) + args[4:] + (kv_scale,)
            t = time_call_min(lambda: torch.ops.kilnlm.paged_attention(*args8), min_time_s)
            row.append(f"{t * 1e6:8.1f} {num_kv / t / 1e9:6.2f} {t_bf16 / t:6.2f}")
        print(" | ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="attention / quantized-GEMM activation dtype")
    parser.add_argument("--min-time-s", type=float, default=0.2, help="measuring time per case")
    parser.add_argument("--only", choices=["gemm", "fp8", "fp8_rowwise", "quant", "attention", "kv8"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_cpu_kernels()
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    if args.only in (None, "gemm"):
        for dtype in (torch.bfloat16, torch.float32):
            bench_gemm_sweep(args.min_time_s, dtype)
    if args.only in (None, "fp8"):
        bench_fp8_linear(args.min_time_s)
        bench_fp8_decode_sweep(args.min_time_s)
    if args.only in (None, "fp8_rowwise"):
        bench_fp8_rowwise(getattr(torch, args.dtype), args.min_time_s)
    if args.only in (None, "quant"):
        bench_quantized_linear(getattr(torch, args.dtype), args.min_time_s)
        bench_quantized_decode_sweep(getattr(torch, args.dtype), args.min_time_s)
    if args.only in (None, "attention"):
        bench_paged_attention(getattr(torch, args.dtype), args.min_time_s)
    if args.only in (None, "kv8"):
        bench_kv8_attention(args.min_time_s)


if __name__ == "__main__":
    main()
