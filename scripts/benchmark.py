#!/usr/bin/env python3
"""kilnlm engines vs Hugging Face ``generate`` on SmolLM2-135M-Instruct, side by side on this machine.

    python scripts/benchmark.py [--formats fp32,bf16,fp8] [--work-dir .work/bench] [--num-requests 32]

Scenarios (greedy, EOS ignored, the same prompt token ids for both; prompts are real English text from the
standard library's ``pydoc_data.topics``):

(a) one request, 128 prompt tokens, 128 output tokens: time to first token (TTFT) and decode tokens/s
    (tokens after the first / time after the first). For kilnlm also the weight bytes read per decode step
    and the GB/s that achieves (gpt-fast's measure of how close batch-1 decode is to memory bandwidth).
(b) 32 requests at once, 256 prompt tokens each, 128 output tokens each: wall time and output tokens/s.
    kilnlm: all submitted together to the executor (in-flight batching, chunked context);
    transformers: one ``generate`` call on the batch (equal lengths, so no padding).

Also the cold start: seconds from launching a fresh Python process to its first generated token from an
already built engine (load + verify + first forward).

FP8 engines run bf16 activations, so they are compared against transformers at bf16. Engines are built
once into ``--work-dir`` and reused by later runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HF_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
LM_HEAD_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}


@dataclass
class Result:
    ttft_s: float = float("nan")
    decode_tokens_per_s: float = float("nan")
    batch_wall_s: float = float("nan")
    batch_tokens_per_s: float = float("nan")


def prepare_hf_dir(work_dir: Path) -> Path:
    from kilnlm.builder.bundled import smollm2_gguf_path
    from kilnlm.builder.checkpoint import load_checkpoint, save_as_hf_dir

    hf_dir = work_dir / "smollm2-hf"
    if not (hf_dir / "config.json").exists():
        save_as_hf_dir(load_checkpoint(smollm2_gguf_path()), hf_dir)
    return hf_dir


def prepare_engine(work_dir: Path, hf_dir: Path, qformat: str) -> Path:
    from kilnlm.builder.build import BuildOptions, build_engine

    engine_dir = work_dir / f"engine-{qformat}"
    if not (engine_dir / "manifest.json").exists():
        t0 = time.perf_counter()
        build_engine(BuildOptions(checkpoint=hf_dir, output=engine_dir, qformat=qformat, max_batch_size=32,
                                  max_seq_len=512, max_num_tokens=2048, overwrite=True))
        print(f"[bench] built {qformat} engine in {time.perf_counter() - t0:.1f} s", flush=True)
    return engine_dir


def make_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """``num_prompts`` different windows of exactly ``num_tokens`` token ids of real English text."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    stride = max(num_tokens, (len(ids) - num_tokens) // max(num_prompts, 1))
    return [ids[i * stride: i * stride + num_tokens] for i in range(num_prompts)]


def decode_weight_bytes(manifest, qformat: str) -> int:
    """Bytes of weights one decode step reads: every linear layer, the norms and the LM head (the embedding
    row gather is negligible)."""
    m = manifest.model
    q_out = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    per_layer = m.hidden_size * (q_out + m.num_heads * m.head_dim + 3 * m.intermediate_size)
    linear = m.num_layers * per_layer * WEIGHT_BYTES[qformat]
    norms = (2 * m.num_layers + 1) * m.hidden_size * (4 if qformat == "fp32" else 2)
    return linear + norms + m.vocab_size * m.hidden_size * LM_HEAD_BYTES[qformat]


def bench_engine(engine_dir: Path, single_prompt: list[int], batch_prompts: list[list[int]], max_tokens: int) -> Result:
    from kilnlm.runtime.executor import Executor
    from kilnlm.runtime.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    executor = Executor.from_engine_dir(engine_dir)
    try:
        executor.generate(single_prompt[:16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        result = Result()
        t0 = time.perf_counter()
        rid = executor.submit(single_prompt, params)
        stamps = []
        for response in executor.stream(rid):
            stamps += [time.perf_counter()] * len(response.token_ids)
        result.ttft_s = stamps[0] - t0
        result.decode_tokens_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])

        t0 = time.perf_counter()
        ids = [executor.submit(p, params) for p in batch_prompts]
        num_generated = sum(len(r.token_ids) for i in ids for r in executor.stream(i))
        result.batch_wall_s = time.perf_counter() - t0
        result.batch_tokens_per_s = num_generated / result.batch_wall_s
        return result
    finally:
        executor.shutdown()


class _TimingStreamer:
    """A transformers streamer that stamps the arrival of each generated token (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.stamps.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def bench_transformers(hf_dir: Path, dtype: torch.dtype, single_prompt: list[int], batch_prompts: list[list[int]],
                       max_tokens: int) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    kwargs = dict(do_sample=False, min_new_tokens=max_tokens, max_new_tokens=max_tokens, pad_token_id=0)
    result = Result()
    with torch.inference_mode():
        model.generate(torch.tensor([single_prompt[:16]]), do_sample=False, max_new_tokens=4, pad_token_id=0)
        streamer = _TimingStreamer()
        t0 = time.perf_counter()
        model.generate(torch.tensor([single_prompt]), streamer=streamer, **kwargs)
        result.ttft_s = streamer.stamps[0] - t0
        result.decode_tokens_per_s = (len(streamer.stamps) - 1) / (streamer.stamps[-1] - streamer.stamps[0])

        batch = torch.tensor(batch_prompts)
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
        result.batch_wall_s = time.perf_counter() - t0
        result.batch_tokens_per_s = (out.shape[1] - batch.shape[1]) * batch.shape[0] / result.batch_wall_s
    return result


COLD_START = """
import sys, time
from kilnlm.runtime.executor import Executor
from kilnlm.runtime.request import SamplingParams
ex = Executor.from_engine_dir(sys.argv[1])
rid = ex.submit([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
next(iter(ex.stream(rid)))
print(time.time(), flush=True)
import os; os._exit(0)
"""


def cold_start_s(engine_dir: Path) -> float:
    """Seconds from launching a new Python process to its first token from ``engine_dir``."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", COLD_START, str(engine_dir)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1]) - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="fp32,bf16,fp8", help="engine qformats to run (default: fp32,bf16,fp8)")
    parser.add_argument("--work-dir", type=Path, default=Path(".work/bench"), help="where engines are built and kept (default: .work/bench)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in scenario (b) (default: 32)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 256), metavar=("A", "B"),
                        help="prompt tokens in scenarios (a) and (b) (default: 128 256)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default: 128)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args()

    from kilnlm.runtime.manifest import read_manifest
    from kilnlm.runtime.tokenizer import Tokenizer

    args.work_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare_hf_dir(args.work_dir)
    formats = [f for f in args.formats.split(",") if f]
    engines = {q: prepare_engine(args.work_dir, hf_dir, q) for q in formats}
    tokenizer = Tokenizer.from_dir(engines[formats[0]] / "tokenizer")
    single_prompt = make_prompts(tokenizer, 1, args.prompt_tokens[0])[0]
    batch_prompts = make_prompts(tokenizer, args.num_requests, args.prompt_tokens[1])
    print(f"[bench] torch {torch.__version__}, {torch.get_num_threads()} threads; (a) 1 x {args.prompt_tokens[0]} -> "
          f"{args.max_tokens}; (b) {args.num_requests} x {args.prompt_tokens[1]} -> {args.max_tokens}", flush=True)

    rows = []
    hf_results: dict[torch.dtype, Result] = {}
    for qformat in formats:
        dtype = HF_DTYPE[qformat]
        if not args.no_transformers and dtype not in hf_results:
            print(f"[bench] transformers {dtype} ...", flush=True)
            hf_results[dtype] = bench_transformers(hf_dir, dtype, single_prompt, batch_prompts, args.max_tokens)
            rows.append((f"transformers {str(dtype).removeprefix('torch.')}", hf_results[dtype], None, None, None))
        print(f"[bench] kilnlm {qformat} ...", flush=True)
        result = bench_engine(engines[qformat], single_prompt, batch_prompts, args.max_tokens)
        weight_bytes = decode_weight_bytes(read_manifest(engines[qformat]), qformat)
        rows.append((f"kilnlm {qformat}", result, hf_results.get(dtype), weight_bytes, cold_start_s(engines[qformat])))

    header = (f"{'':<22}{'TTFT ms':>9}{'decode tok/s':>14}{'x HF':>7}{'MB/token':>10}{'GB/s':>7}"
              f"{'batch s':>9}{'batch tok/s':>13}{'x HF':>7}{'cold start s':>14}")
    print("\n" + header + "\n" + "-" * len(header))
    records = []
    for name, r, base, weight_bytes, cold_s in rows:
        ratio_a = f"{r.decode_tokens_per_s / base.decode_tokens_per_s:.2f}" if base else ""
        ratio_b = f"{r.batch_tokens_per_s / base.batch_tokens_per_s:.2f}" if base else ""
        mb = f"{weight_bytes / 1e6:.0f}" if weight_bytes else ""
        gbs = f"{weight_bytes * r.decode_tokens_per_s / 1e9:.1f}" if weight_bytes else ""
        print(f"{name:<22}{r.ttft_s * 1e3:>9.1f}{r.decode_tokens_per_s:>14.1f}{ratio_a:>7}{mb:>10}{gbs:>7}"
              f"{r.batch_wall_s:>9.2f}{r.batch_tokens_per_s:>13.1f}{ratio_b:>7}{(f'{cold_s:.2f}' if cold_s else ''):>14}")
        records.append({"name": name, **vars(r), "weight_bytes_per_token": weight_bytes, "cold_start_s": cold_s,
                        "decode_ratio_vs_transformers": float(ratio_a) if ratio_a else None,
                        "batch_ratio_vs_transformers": float(ratio_b) if ratio_b else None})
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
