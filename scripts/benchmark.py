#!/usr/bin/env python3
"""kilnlm engines vs Hugging Face ``generate`` on SmolLM2-135M-Instruct, side by side on this machine.

    python scripts/benchmark.py [--formats fp32,bf16,fp8,fp8_rowwise,int8_wo,int8_sq,int4_wo,int4_awq] [--work-dir .work/bench]
        [--num-requests 32] [--decode-only] [--no-transformers] [--decode-rounds N] [--malloc auto]
        [--speculative-config JSON] [--tp-size N]

Scenarios (greedy, EOS ignored, the same prompt token ids for both; prompts are real English text from the
standard library's ``pydoc_data.topics``):

(a) one request, 128 prompt tokens, 128 output tokens: decode tokens/s (tokens after the first / time
    after the first); then time to first token (TTFT), the median of 5 more requests of 128 other prompt
    tokens, each alone (one output token). For kilnlm also the weight bytes read per decode step
    and the GB/s that achieves (gpt-fast's measure of how close batch-1 decode is to memory bandwidth).
(b) 32 requests at once, 256 prompt tokens each, 128 output tokens each: wall time and output tokens/s.
    kilnlm: all submitted together to the executor (in-flight batching, chunked context);
    transformers: one ``generate`` call on the batch (equal lengths, so no padding).
(c) kilnlm only, shared prefix: 64 requests at once, each one 200-token prefix + 56 distinct tokens, 64
    output tokens each: output tokens/s, and its ratio to (b)'s on the same engine ("x (b)"; the prefix is
    computed once, since requests that arrive together wait for the blocks another is computing).

Engines are built with room for 64 sequences per step (``max_batch_size``, so that (c)'s requests decode in
one batch; (b)'s 32 never need more), ``max_seq_len`` 512 and ``max_num_tokens`` 2048; a ``--formats`` option
overrides them (``bf16:max_batch_size=32``).

(d) with ``--speculative-config JSON`` (vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``), kilnlm
    only: batch-1 decode (128 output tokens, greedy, EOS ignored) of two chat prompts, with and without
    speculative decoding in the same process, alternating, best of 3: "grounded" asks to repeat a ~150-token
    passage of the same English text (the output copies its input, where prompt lookup pays), "free" asks
    for a story; reports tokens/s, the speed-up and the draft acceptance rate.

With ``--tp-size N`` every format also runs as an engine built with ``--tp-size N`` (its ranks share this
machine's threads: each rank gets threads / N), side by side with its one-rank engine, and the collectives a
step makes are timed alone: ``kilnlm::all_reduce`` of ``[T, hidden]`` bfloat16 (2 per layer + the
embedding's) and ``kilnlm::all_gather`` of the ``[T, vocab / N]`` logits, over a gloo group of N processes
on this host, medians of 200 calls, for T = 1 (batch-1 decode) and T = 32 (scenario (b)'s decode steps),
with the bytes each rank sends per step (ring all-reduce: 2 (N - 1) / N of the tensor; all-gather: (N - 1)
/ N of the result).

With ``--decode-rounds N`` scenario (a)'s decode is measured again in N rounds, each engine in a fresh process
in turn (round-robin): on a shared machine bandwidth and load drift by tens of percent within minutes, so a
ratio to bf16 is only meaningful within a round; the table then shows medians and the per-round ratios.

Also the cold start: seconds from launching a fresh Python process to its first generated token from an
already built engine (load + verify + first forward), the engine's SHA-256 checks started before torch imports
as kilnlm's CLI and Triton model start them (``kilnlm.runtime.manifest.prehash_engine_files``).

Quantized engines (fp8, fp8_rowwise, int8_wo, int8_sq, int4_wo, int4_awq; ``int4_awq+lm_head`` etc. build with
``--quantize-lm-head``, ``fp8:auto_quantize_bits=8.5`` etc. with the options given) run bf16 activations, so they are compared
against transformers at bf16, and their batch-1 decode also against the kilnlm bf16 engine ("x bf16"). The
machine's memory bandwidth is measured first (the best of several passes summing a 1 GiB tensor with all
threads: the rate at which weights can possibly stream from DRAM) and again just before and just after each
batch-1 decode, in its process; "% BW" is the weight GB/s a format's batch-1 decode achieves as a fraction of
the faster of those two (issue 3, item 12): on a shared host the bandwidth drifts by tens of percent within
minutes, so the figure from the start of a run can be far from the one a decode minutes later had. Engines
are built once into ``--work-dir`` and reused by later runs that ask for the same limits and options.

Everything runs on the C allocator the Triton launcher gives the engines (``--malloc``, default "auto":
TCMalloc, else jemalloc, when installed; ``kilnlm.runtime.memory.preload_malloc``): the benchmark starts
itself again under that ``LD_PRELOAD``, so the transformers baseline, every engine and every round share
it. The header says which it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.memory import MALLOC_CHOICES, preload_malloc

DEFAULT_FORMATS = "fp32,bf16,fp8,fp8_rowwise,int8_wo,int8_sq,int4_wo,int4_awq"
INT4_GROUP_SIZE = 64  # group-wise formats: SmolLM2's hidden size 576 is not a multiple of the default 128


LM_HEAD_SUFFIX = "+lm_head"  # a format spec "int4_awq+lm_head" builds with --quantize-lm-head
OPTIONS_SEP = ":"  # a format spec "fp8:auto_quantize_bits=8.5" builds with --auto-quantize-bits 8.5


def split_spec(spec: str) -> tuple[str, dict]:
    """A ``--formats`` entry -> (qformat, further build options): ``"int4_awq+lm_head"`` -> ``("int4_awq",
    {"quantize_lm_head": True})``; ``"int8_sq:per_token=false,smoothquant_alpha=0.8"`` -> ``("int8_sq",
    {"per_token": False, "smoothquant_alpha": 0.8})`` (any :class:`~kilnlm.builder.config.BuildOptions`
    field; true / false, numbers, else the string)."""
    spec, _, given = spec.partition(OPTIONS_SEP)
    options = {"quantize_lm_head": True} if spec.endswith(LM_HEAD_SUFFIX) else {}
    for item in filter(None, given.split(",")):
        key, _, value = item.partition("=")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[key] = lowered == "true"
        else:
            try:
                options[key] = int(value) if value.lstrip("-").isdigit() else float(value)
            except ValueError:
                options[key] = value
    return spec.removesuffix(LM_HEAD_SUFFIX), options


def hf_dtype(spec: str) -> torch.dtype:
    """The transformers dtype a format is compared with: its activation dtype."""
    from kilnlm.builder.formats import FORMATS

    return getattr(torch, FORMATS[split_spec(spec)[0]].activation_dtype)


@dataclass
class Result:
    ttft_s: float = float("nan")
    decode_tokens_per_s: float = float("nan")
    batch_wall_s: float = float("nan")
    batch_tokens_per_s: float = float("nan")
    shared_prefix_tokens_per_s: float = float("nan")
    decode_bandwidth_gbs: float = float("nan")  # read bandwidth beside (a)'s decode: the faster of before / after
    speculative: dict | None = None  # scenario (d): task -> tokens/s without and with, acceptance rate


def prepare_hf_dir(work_dir: Path) -> Path:
    from kilnlm.builder.bundled import smollm2_gguf_path
    from kilnlm.builder.checkpoint import load_checkpoint, save_as_hf_dir

    hf_dir = work_dir / "smollm2-hf"
    if not (hf_dir / "config.json").exists():
        save_as_hf_dir(load_checkpoint(smollm2_gguf_path()), hf_dir)
    return hf_dir


def prepare_engine(work_dir: Path, hf_dir: Path, spec: str, limits: dict | None = None) -> Path:
    """The engine of format spec ``spec`` (:func:`split_spec`) in ``work_dir`` with ``limits``
    (BuildOptions fields; None: ``BENCH_LIMITS``, {}: the CLI's defaults), built unless an engine built with
    the same options is there."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.config import BuildOptions
    from kilnlm.builder.formats import FORMATS

    qformat, options = split_spec(spec)
    engine_dir = work_dir / ("engine-" + "".join(c if c.isalnum() or c in "._" else "-" for c in spec))
    # a spec's options override the limits
    asked = dict(BENCH_LIMITS if limits is None else limits)
    if FORMATS[qformat].group_wise:
        asked["group_size"] = INT4_GROUP_SIZE
    asked |= options
    manifest_path = engine_dir / "manifest.json"
    built = json.loads(manifest_path.read_text())["build"] if manifest_path.exists() else {}
    if not built or any(built.get(key) != value for key, value in asked.items() if key in built):
        t0 = time.perf_counter()
        build_engine(BuildOptions(checkpoint=hf_dir, output=engine_dir, qformat=qformat, overwrite=True, **asked))
        print(f"[bench] built {spec} engine in {time.perf_counter() - t0:.1f} s", flush=True)
    return engine_dir


def make_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """``num_prompts`` different windows of exactly ``num_tokens`` token ids of real English text."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    stride = max(num_tokens, (len(ids) - num_tokens) // max(num_prompts, 1))
    return [ids[i * stride: i * stride + num_tokens] for i in range(num_prompts)]


TTFT_REQUESTS = 5  # scenario (a)'s TTFT: the median of this many requests, each alone, after its first
SHARED_PREFIX = (64, 200, 56, 64)  # scenario (c): requests, prefix tokens, distinct tokens, output tokens
# the engines' limits: scenario (c)'s requests decode in one batch
BENCH_LIMITS = dict(max_batch_size=SHARED_PREFIX[0], max_seq_len=512, max_num_tokens=2048)


def make_shared_prefix_prompts(tokenizer, num_prompts: int, prefix_tokens: int, distinct_tokens: int) -> list[list[int]]:
    """``num_prompts`` prompts of one ``prefix_tokens``-token prefix followed by ``distinct_tokens`` tokens of
    a different window each, all real English text."""
    prefix = make_prompts(tokenizer, 1, prefix_tokens)[0]
    return [prefix + tail for tail in make_prompts(tokenizer, num_prompts, distinct_tokens)]


def linear_bytes(qformat: str, out_features: int, in_features: int) -> float:
    """Bytes of one linear's weights in ``qformat``, its scales (and zero points, for the formats built with
    them by default) included."""
    from kilnlm.builder.formats import FORMATS

    fmt = FORMATS[qformat]
    group_size = INT4_GROUP_SIZE if fmt.group_wise else None
    return (out_features * in_features * fmt.bytes_per_weight
            + fmt.scale_bytes_per_linear(out_features, in_features, group_size, zero_point=bool(fmt.zero_point)))


def decode_weight_bytes(manifest, spec: str) -> int:
    """Bytes of weights one decode step reads: every linear layer (packed weights + their scales; 16-bit for
    the linears ``--auto-quantize-bits`` kept, the manifest's ``exclude_modules``), the norms and the LM
    head (16-bit for every format but fp32 unless ``+lm_head``; the embedding row gather is negligible)."""
    from kilnlm.builder.network.llama import DOWN_PROJ, GATE_UP_PROJS, O_PROJ, QKV_PROJS

    qformat, options = split_spec(spec)
    quantize_lm_head = options.get("quantize_lm_head", False)
    m = manifest.model
    float_bytes = torch.empty((), dtype=getattr(torch, manifest.build.dtype)).element_size()  # norms, 16-bit LM head
    q_out = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    # the first HF part of qkv, o, gate/up, down -> their fused (out_features, in_features)
    shapes = {QKV_PROJS[0]: (q_out, m.hidden_size), O_PROJ: (m.hidden_size, m.num_heads * m.head_dim),
              GATE_UP_PROJS[0]: (2 * m.intermediate_size, m.hidden_size), DOWN_PROJ: (m.hidden_size, m.intermediate_size)}
    kept = set(manifest.build.exclude_modules)
    linears = sum(o * i * float_bytes if f"model.layers.{layer}.{name}" in kept else linear_bytes(qformat, o, i)
                  for layer in range(m.num_layers) for name, (o, i) in shapes.items())
    norms = (2 * m.num_layers + 1) * m.hidden_size * float_bytes
    lm_head = (linear_bytes(qformat, m.vocab_size, m.hidden_size) if quantize_lm_head
               else m.vocab_size * m.hidden_size * float_bytes)
    return int(linears) + norms + lm_head


def measure_read_bandwidth_gbs(num_bytes: int = 1 << 30, num_passes: int = 7) -> float:
    """The machine's DRAM read bandwidth as torch sees it: GB/s (1e9 B/s) of the fastest of
    ``num_passes`` full sums of a ``num_bytes`` float32 tensor (much larger than the caches), all threads."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    best_s = float("inf")
    for _ in range(num_passes):
        t0 = time.perf_counter()
        x.sum()
        best_s = min(best_s, time.perf_counter() - t0)
    return num_bytes / best_s / 1e9


def warm_up(executor, prompt: list[int]) -> None:
    """A 4-token request on a new executor (its first forwards), then the wait for its KV pool to be faulted
    in (:func:`kilnlm.runtime.memory.wait_until_populated`): the scenarios measure an engine in its steady
    state, the cold start measures the start (beside the populating thread a forward loses one of a 2-vCPU
    machine's cores: docs/performance.md, "Reproducing")."""
    from kilnlm.runtime.memory import wait_until_populated
    from kilnlm.runtime.request import SamplingParams

    executor.generate(prompt[:16], SamplingParams(max_tokens=4, ignore_eos=True))
    wait_until_populated()


def bench_engine(engine_dir: Path, single_prompt: list[int], batch_prompts: list[list[int]], max_tokens: int,
                 shared_prompts: list[list[int]] = (), shared_max_tokens: int = 0,
                 ttft_prompts: list[list[int]] = ()) -> Result:
    """Scenario (a) (its TTFT the median over ``ttft_prompts`` when given, each alone, after (a)'s request),
    then (b) unless ``batch_prompts`` is empty, then (c) unless ``shared_prompts`` is."""
    from kilnlm.runtime.executor import Executor
    from kilnlm.runtime.request import SamplingParams

    def run_batch(executor: Executor, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
        """(wall seconds, output tokens) of ``prompts`` submitted together."""
        t0 = time.perf_counter()
        ids = [executor.submit(p, params) for p in prompts]
        num_generated = sum(len(r.token_ids) for i in ids for r in executor.stream(i))
        return time.perf_counter() - t0, num_generated

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result = Result()
    with Executor.from_engine_dir(engine_dir) as executor:
        warm_up(executor, single_prompt)
        bandwidth_before_gbs = measure_read_bandwidth_gbs()
        t0 = time.perf_counter()
        rid = executor.submit(single_prompt, params)
        stamps = []
        for response in executor.stream(rid):
            stamps += [time.perf_counter()] * len(response.token_ids)
        result.decode_bandwidth_gbs = max(bandwidth_before_gbs, measure_read_bandwidth_gbs())
        result.ttft_s = stamps[0] - t0
        result.decode_tokens_per_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        if ttft_prompts:
            ttfts = []
            for prompt in ttft_prompts:
                t0 = time.perf_counter()
                next(executor.stream(executor.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True))))
                ttfts.append(time.perf_counter() - t0)
            result.ttft_s = statistics.median(ttfts)
        if batch_prompts:
            result.batch_wall_s, num_generated = run_batch(executor, batch_prompts, params)
            result.batch_tokens_per_s = num_generated / result.batch_wall_s
    if shared_prompts:  # a fresh executor: nothing of (b)'s prompts in its prefix cache
        with Executor.from_engine_dir(engine_dir) as executor:
            warm_up(executor, single_prompt)
            wall_s, num_generated = run_batch(executor, shared_prompts,
                                              SamplingParams(max_tokens=shared_max_tokens, temperature=0.0, ignore_eos=True))
            result.shared_prefix_tokens_per_s = num_generated / wall_s
    return result


SPECULATIVE_ROUNDS = 3


def speculative_prompts(tokenizer) -> dict[str, list[int]]:
    """Scenario (d)'s chat prompts: "grounded" (repeat a ~150-token passage of real English text) and "free"."""
    passage = tokenizer.decode(make_prompts(tokenizer, 1, 150)[0])
    users = {"grounded": f"Repeat the following text exactly, word for word:\n\n{passage}",
             "free": "Write a short story about a lighthouse keeper who finds a message in a bottle."}
    return {task: tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True), add_special_tokens=False)
            for task, text in users.items()}


def bench_speculative(engine_dir: Path, prompts: dict[str, list[int]], speculative_config: str, max_tokens: int) -> dict:
    """Scenario (d): per task, decode tokens/s (after the first token) without and with speculation, best of
    :data:`SPECULATIVE_ROUNDS` alternating runs, and the acceptance rate of the speculative runs. One executor
    at a time: two in one process slowed each other's decode 2.6x (their OpenMP pools)."""
    from kilnlm.runtime.executor import Executor, ExecutorConfig
    from kilnlm.runtime.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    configs = {"off": ExecutorConfig(max_batch_size=1), "on": ExecutorConfig(max_batch_size=1, speculative_config=speculative_config)}
    best = {task: {"off": 0.0, "on": 0.0} for task in prompts}
    drafts = {task: [0, 0] for task in prompts}  # verified, accepted
    for _ in range(SPECULATIVE_ROUNDS):
        for name, config in configs.items():
            with Executor.from_engine_dir(engine_dir, config) as executor:
                warm_up(executor, next(iter(prompts.values())))
                for task, prompt in prompts.items():
                    before = executor.stats()
                    stamps = []
                    for response in executor.stream(executor.submit(prompt, params)):
                        stamps += [time.perf_counter()] * len(response.token_ids)
                    best[task][name] = max(best[task][name], (len(stamps) - 1) / (stamps[-1] - stamps[0]))
                    after = executor.stats()
                    drafts[task][0] += after.total_draft_tokens - before.total_draft_tokens
                    drafts[task][1] += after.total_accepted_draft_tokens - before.total_accepted_draft_tokens
    return {task: {"tokens_per_s": best[task]["off"], "speculative_tokens_per_s": best[task]["on"],
                   "speedup": best[task]["on"] / best[task]["off"],
                   "acceptance_rate": drafts[task][1] / drafts[task][0] if drafts[task][0] else 0.0} for task in prompts}


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
                       max_tokens: int, ttft_prompts: list[list[int]] = ()) -> Result:
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
        if ttft_prompts:  # as bench_engine: each alone, the median
            ttfts = []
            for prompt in ttft_prompts:
                streamer = _TimingStreamer()
                t0 = time.perf_counter()
                model.generate(torch.tensor([prompt]), streamer=streamer, do_sample=False, max_new_tokens=1, pad_token_id=0)
                ttfts.append(streamer.stamps[0] - t0)
            result.ttft_s = statistics.median(ttfts)
        if not batch_prompts:
            return result

        batch = torch.tensor(batch_prompts)
        t0 = time.perf_counter()
        out = model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
        result.batch_wall_s = time.perf_counter() - t0
        result.batch_tokens_per_s = (out.shape[1] - batch.shape[1]) * batch.shape[0] / result.batch_wall_s
    return result


COLD_START = """
import sys, time
from kilnlm.runtime.manifest import prehash_engine_files
prehash_engine_files(sys.argv[1])  # as kilnlm's CLI and Triton model do, before torch imports
from kilnlm.runtime.executor import Executor
from kilnlm.runtime.request import SamplingParams
ex = Executor.from_engine_dir(sys.argv[1])
rid = ex.submit([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
next(iter(ex.stream(rid)))
print(time.time(), flush=True)
ex.shutdown()  # and a normal exit: os._exit would leave torch's extracted engine (~0.2-0.6 GB) in the temp dir
"""


# Scenario (a) alone through bench_engine (this file), in a fresh process that exits normally.
DECODE_ONCE = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from benchmark import bench_engine
r = bench_engine(Path(sys.argv[2]), json.loads(sys.argv[3]), [], int(sys.argv[4]))
print(r.decode_tokens_per_s, r.decode_bandwidth_gbs, flush=True)
"""


def decode_rounds(engines: dict[str, Path], prompt: list[int], max_tokens: int,
                  num_rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Scenario (a)'s decode of every engine in ``num_rounds`` rounds, each engine in a fresh process in turn
    within a round (round-robin), so that the machine's drift in bandwidth and load (large on shared machines)
    falls on every format alike and ratios can be taken within a round: per engine, (tokens/s, the read
    bandwidth in GB/s measured beside it) for each round."""
    rounds: dict[str, list[tuple[float, float]]] = {spec: [] for spec in engines}
    for round_idx in range(num_rounds):
        for spec, engine_dir in engines.items():
            args = [str(Path(__file__).resolve().parent), str(engine_dir), json.dumps(prompt), str(max_tokens)]
            out = subprocess.run([sys.executable, "-c", DECODE_ONCE, *args], check=True, capture_output=True, text=True)
            tokens_per_s, bandwidth_gbs = map(float, out.stdout.strip().splitlines()[-1].split())
            rounds[spec].append((tokens_per_s, bandwidth_gbs))
        print(f"[bench] decode round {round_idx + 1}/{num_rounds}: " +
              ", ".join(f"{spec} {r[-1][0]:.1f} ({r[-1][1]:.1f} GB/s)" for spec, r in rounds.items()), flush=True)
    return rounds


COLLECTIVE_CALLS = 200


def _collectives_rank(rank: int, tp_size: int, port: int, shapes: list, results) -> None:
    """One rank of :func:`measure_collectives` (a spawned process): median seconds per call of each shape."""
    from datetime import timedelta

    import torch.distributed as dist

    from kilnlm.plugins import set_tensor_parallel_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp_size, timeout=timedelta(seconds=60))
    set_tensor_parallel_group(dist.group.WORLD)
    medians = []
    for op, rows, cols in shapes:
        x = torch.randn(rows, cols).to(torch.bfloat16)
        call = (lambda: torch.ops.kilnlm.all_reduce(x)) if op == "all_reduce" else (
            lambda: torch.ops.kilnlm.all_gather(x, tp_size))
        times = []
        for _ in range(COLLECTIVE_CALLS + 20):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times[20:]))
    if rank == 0:
        results.put(medians)
    dist.destroy_process_group()


def measure_collectives(tp_size: int, manifest) -> dict:
    """Seconds of collectives per step at T = 1 and 32 tokens, and the bytes each rank sends per step,
    for ``manifest``'s model split over ``tp_size`` ranks (module docstring)."""
    import socket

    import torch.multiprocessing as mp

    m = manifest.model
    vocab_per_rank = -(-m.vocab_size // tp_size)
    shapes = [(op, t, cols) for t in (1, 32) for op, cols in (("all_reduce", m.hidden_size), ("all_gather", vocab_per_rank))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_collectives_rank, args=(r, tp_size, port, shapes, results)) for r in range(tp_size)]
    for p in processes:
        p.start()
    medians = results.get(timeout=600)
    for p in processes:
        p.join(60)
    num_reduces = 2 * m.num_layers + 1
    out = {}
    for i, tokens in enumerate((1, 32)):
        all_reduce_s, all_gather_s = medians[2 * i], medians[2 * i + 1]
        sent = (num_reduces * 2 * (tp_size - 1) / tp_size * tokens * m.hidden_size * 2
                + (tp_size - 1) * tokens * vocab_per_rank * 2)
        out[tokens] = {"all_reduce_s": all_reduce_s, "all_gather_s": all_gather_s,
                       "per_step_s": num_reduces * all_reduce_s + all_gather_s, "bytes_sent_per_rank": sent}
    return out


def cold_start_s(engine_dir: Path) -> float:
    """Seconds from launching a new Python process to its first token from ``engine_dir``."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", COLD_START, str(engine_dir)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1]) - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS,
                        help=f"engine qformats to run; QFORMAT{LM_HEAD_SUFFIX} also quantizes the LM head "
                             f"(--quantize-lm-head), QFORMAT{OPTIONS_SEP}FIELD=VALUE,... sets other build options "
                             f"(e.g. int8_sq{OPTIONS_SEP}per_token=false) (default: {DEFAULT_FORMATS})")
    parser.add_argument("--work-dir", type=Path, default=Path(".work/bench"), help="where engines are built and kept (default: .work/bench)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in scenario (b) (default: 32)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 256), metavar=("A", "B"),
                        help="prompt tokens in scenarios (a) and (b) (default: 128 256)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default: 128)")
    parser.add_argument("--decode-only", action="store_true", help="run scenario (a) only, no batch and no cold start")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--decode-rounds", type=int, default=1,
                        help="with N > 1, scenario (a)'s decode tokens/s is also measured in N round-robin rounds of one "
                             "fresh process per engine; the table then shows the median over rounds and x bf16 the "
                             "median of each round's ratio to that round's bf16 (default: 1)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='run scenario (d) with this speculative decoding config (vLLM\'s JSON, e.g. '
                             '{"method": "ngram", "num_speculative_tokens": 4}) (default: off)')
    parser.add_argument("--tp-size", type=int, default=1,
                        help="with N > 1, also run each format as a --tp-size N engine, and time the collectives of a "
                             "step (default: 1)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--malloc", choices=MALLOC_CHOICES, default="auto",
                        help="C allocator of every process, as scripts/launch_triton.py's (default auto: TCMalloc, "
                             "else jemalloc, when installed; system: glibc's)")
    args = parser.parse_args()

    try:
        env, malloc_library = preload_malloc(os.environ, args.malloc)
    except KilnError as exc:
        parser.error(str(exc))
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):  # an allocator is chosen at process start
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    from kilnlm.builder.formats import FORMATS
    from kilnlm.runtime.manifest import read_manifest
    from kilnlm.runtime.tokenizer import Tokenizer

    formats = [f for f in args.formats.split(",") if f]
    if args.tp_size > 1:
        formats = [s for f in formats for s in (f, f + ("," if OPTIONS_SEP in f else OPTIONS_SEP) + f"tp_size={args.tp_size}")]
    unknown = [f for f in formats if split_spec(f)[0] not in FORMATS]
    if unknown:
        parser.error(f"--formats {','.join(unknown)}: this kilnlm builds {', '.join(FORMATS)} "
                     f"(append {LM_HEAD_SUFFIX} to quantize the LM head too, {OPTIONS_SEP}FIELD=VALUE,... for "
                     "other build options)")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    bandwidth_gbs = measure_read_bandwidth_gbs()
    print(f"[bench] measured memory read bandwidth: {bandwidth_gbs:.1f} GB/s", flush=True)
    print(f"[bench] C allocator: {malloc_library or 'glibc malloc'}", flush=True)
    hf_dir = prepare_hf_dir(args.work_dir)
    engines = {q: prepare_engine(args.work_dir, hf_dir, q) for q in formats}
    tokenizer = Tokenizer.from_dir(engines[formats[0]] / "tokenizer")
    single_prompt = make_prompts(tokenizer, 1, args.prompt_tokens[0])[0]
    # other windows (the first is single_prompt): no prefix in common with it
    ttft_prompts = make_prompts(tokenizer, TTFT_REQUESTS + 1, args.prompt_tokens[0])[1:]
    batch_prompts = [] if args.decode_only else make_prompts(tokenizer, args.num_requests, args.prompt_tokens[1])
    num_shared, prefix_tokens, distinct_tokens, shared_max_tokens = SHARED_PREFIX
    shared_prompts = [] if args.decode_only else make_shared_prefix_prompts(tokenizer, num_shared, prefix_tokens,
                                                                             distinct_tokens)
    print(f"[bench] torch {torch.__version__}, {torch.get_num_threads()} threads; (a) 1 x {args.prompt_tokens[0]} -> "
          f"{args.max_tokens}" + ("" if args.decode_only else f"; (b) {args.num_requests} x {args.prompt_tokens[1]} -> "
                                  f"{args.max_tokens}"), flush=True)

    rows = []  # (name, qformat or None, Result, transformers Result, weight bytes, cold start s)
    hf_results: dict[torch.dtype, Result] = {}
    for qformat in formats:
        dtype = hf_dtype(qformat)
        if not args.no_transformers and dtype not in hf_results:
            print(f"[bench] transformers {dtype} ...", flush=True)
            hf_results[dtype] = bench_transformers(hf_dir, dtype, single_prompt, batch_prompts, args.max_tokens,
                                                   ttft_prompts)
            rows.append((f"transformers {str(dtype).removeprefix('torch.')}", None, hf_results[dtype], None, None, None))
        print(f"[bench] kilnlm {qformat} ...", flush=True)
        result = bench_engine(engines[qformat], single_prompt, batch_prompts, args.max_tokens, shared_prompts,
                              shared_max_tokens, ttft_prompts)
        weight_bytes = decode_weight_bytes(read_manifest(engines[qformat]), qformat)
        cold_s = None if args.decode_only else cold_start_s(engines[qformat])
        if args.speculative_config:
            result.speculative = bench_speculative(engines[qformat], speculative_prompts(tokenizer), args.speculative_config,
                                                   args.max_tokens)
        rows.append((f"kilnlm {qformat}", qformat, result, hf_results.get(dtype), weight_bytes, cold_s))
    rounds = decode_rounds(engines, single_prompt, args.max_tokens, args.decode_rounds) if args.decode_rounds > 1 else {}
    round_ratios: dict[str, list[float]] = {}
    round_fractions: dict[str, list[float]] = {}  # weight GB/s / the bandwidth beside it, per round
    for _, qformat, r, _, weight_bytes, _ in rows:
        if qformat in rounds:
            r.decode_tokens_per_s = statistics.median(rate for rate, _ in rounds[qformat])
            round_fractions[qformat] = [weight_bytes * rate / 1e9 / gbs for rate, gbs in rounds[qformat]]
            if "bf16" in rounds:
                round_ratios[qformat] = [a / b for (a, _), (b, _) in zip(rounds[qformat], rounds["bf16"])]
    bf16 = next((r for _, q, r, *_ in rows if q == "bf16"), None)

    header = (f"{'':<22}{'TTFT ms':>9}{'decode tok/s':>14}{'x HF':>7}{'x bf16':>8}{'MB/token':>10}{'GB/s':>7}{'% BW':>6}"
              f"{'batch s':>9}{'batch tok/s':>13}{'x HF':>7}{'prefix tok/s':>14}{'x (b)':>7}{'cold start s':>14}")
    print(f"\n(memory read bandwidth {bandwidth_gbs:.1f} GB/s at the start; % BW against the bandwidth measured beside "
          f"each decode{', the median round' if rounds else ''}; C allocator {malloc_library or 'glibc malloc'})\n"
          + header + "\n" + "-" * len(header))
    records = []
    for name, qformat, r, base, weight_bytes, cold_s in rows:
        ratio_a = r.decode_tokens_per_s / base.decode_tokens_per_s if base else None
        ratio_bf16 = r.decode_tokens_per_s / bf16.decode_tokens_per_s if bf16 and qformat else None
        if qformat in round_ratios:
            ratio_bf16 = statistics.median(round_ratios[qformat])
        ratio_b = r.batch_tokens_per_s / base.batch_tokens_per_s if base and batch_prompts else None
        gbs = weight_bytes * r.decode_tokens_per_s / 1e9 if weight_bytes else None
        fraction = gbs / r.decode_bandwidth_gbs if gbs else None
        if qformat in round_fractions:
            fraction = statistics.median(round_fractions[qformat])
        ratio_c = r.shared_prefix_tokens_per_s / r.batch_tokens_per_s if qformat and batch_prompts else None

        def cell(value, fmt, width):
            return f"{value:{width}{fmt}}" if value is not None and value == value else " " * width

        print(f"{name:<22}{r.ttft_s * 1e3:>9.1f}{r.decode_tokens_per_s:>14.1f}{cell(ratio_a, '.2f', 7)}"
              f"{cell(ratio_bf16, '.2f', 8)}{cell(weight_bytes and weight_bytes / 1e6, '.0f', 10)}{cell(gbs, '.1f', 7)}"
              f"{cell(fraction and 100 * fraction, '.0f', 6)}{cell(r.batch_wall_s, '.2f', 9)}"
              f"{cell(r.batch_tokens_per_s, '.1f', 13)}{cell(ratio_b, '.2f', 7)}{cell(r.shared_prefix_tokens_per_s, '.1f', 14)}"
              f"{cell(ratio_c, '.2f', 7)}{cell(cold_s, '.2f', 14)}")
        records.append({"name": name, **vars(r), "weight_bytes_per_token": weight_bytes, "weight_gbs": gbs,
                        "fraction_of_bandwidth": fraction, "cold_start_s": cold_s,
                        "decode_ratio_vs_transformers": ratio_a, "decode_ratio_vs_bf16_engine": ratio_bf16,
                        "batch_ratio_vs_transformers": ratio_b, "shared_prefix_ratio_vs_batch": ratio_c,
                        "memory_read_bandwidth_gbs": bandwidth_gbs,
                        "malloc": malloc_library,
                        "decode_rounds": rounds.get(qformat), "decode_ratio_vs_bf16_rounds": round_ratios.get(qformat),
                        "fraction_of_bandwidth_rounds": round_fractions.get(qformat)})
    if round_ratios:
        print(f"\nx bf16 in each of {args.decode_rounds} rounds (decode tok/s of one fresh process per engine, round-robin):")
        for spec, ratios in round_ratios.items():
            print(f"  {spec:<20} " + " ".join(f"{x:.2f}" for x in ratios) + f"   (min {min(ratios):.2f}, median "
                  f"{statistics.median(ratios):.2f}, max {max(ratios):.2f})")
    if args.speculative_config:
        print(f"\n(d) batch-1 decode with speculative decoding {args.speculative_config} (tok/s after the first token, "
              f"best of {SPECULATIVE_ROUNDS}):")
        print(f"{'':<22}" + "".join(f"{task + ' ' + what:>18}" for task in ("grounded", "free")
                                    for what in ("off", "on", "x", "accepted")))
        for name, qformat, r, *_ in rows:
            if qformat and r.speculative:
                print(f"{name:<22}" + "".join(
                    f"{d['tokens_per_s']:>18.1f}{d['speculative_tokens_per_s']:>18.1f}{d['speedup']:>18.2f}"
                    f"{100 * d['acceptance_rate']:>17.0f}%" for d in r.speculative.values()))
    if args.tp_size > 1:
        collectives = measure_collectives(args.tp_size, read_manifest(engines[formats[0]]))
        print(f"\ncollectives of one step at --tp-size {args.tp_size} (timed alone over gloo, medians of "
              f"{COLLECTIVE_CALLS} calls):")
        for tokens, c in collectives.items():
            print(f"  T={tokens:<3} all_reduce {c['all_reduce_s'] * 1e6:.0f} us, all_gather {c['all_gather_s'] * 1e6:.0f} us; "
                  f"per step {c['per_step_s'] * 1e3:.2f} ms, {c['bytes_sent_per_rank'] / 1e3:.0f} KB sent per rank")
        records.append({"name": f"collectives tp_size={args.tp_size}", **{f"T={t}": c for t, c in collectives.items()}})
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
