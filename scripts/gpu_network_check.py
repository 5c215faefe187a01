#!/usr/bin/env python
"""Runs kilnlm's whole network forward on a CUDA GPU, against the compiled CPU engine of the same build.

Two steps, because the GPU machine has torch with CUDA and triton but not the builder's dependencies
(transformers, ModelOpt) nor the CPU engine's toolchain::

    python scripts/gpu_network_check.py prepare --checkpoint DIR --out FILE   # here: builds, records
    python scripts/gpu_network_check.py run FILE                              # on the GPU machine

``prepare`` builds one CPU engine per case of :data:`CASES` (``--target cpu``, the engine limits of
:data:`LIMITS`) and keeps the network each build compiled: the network the ``onnx`` and ``tensorrt`` targets
export, quantized and calibrated. It then runs :data:`SCHEDULE` through the CPU engine: a packed batch of
three sequences over seven steps, mixing context and generation in one forward (a 37-token and a 5-token
context, then a 24-token chunk and a 16-token chunk of a third sequence beside two decoding ones, then
decode), teacher-forced on the engine's greedy tokens. FILE holds the networks (tensors that are equal
across cases stored once), the steps' inputs, the engine's logits and its pool after the last step.

``run``, for each case, moves the network to CUDA, where ``kilnlm::paged_attention`` is the Triton kernels of
:mod:`kilnlm.plugins.gpu` and the linear plugins are their plain-torch references from
:mod:`kilnlm.plugins.reference` (dequantize, then a float32 cuBLAS GEMM without TF32: the math the ONNX
export's Q/DQ graph states; TensorRT would run its own GEMMs there). It runs the steps twice on a fresh
CUDA pool: the eager network, and the ``torch.export`` program of it (exported on the GPU machine with the
build's dynamic shapes: the graph the ONNX export translates). Each run passes when its logits (and
16/32-bit pools) are within the case's tolerance of the CPU engine's (:data:`CASES` says why each). Relative L2
distance, greedy-token (argmax) agreement and the 8-bit pool codes that differ are reported beside, and the
same for the steps run on the CPU through the plugins' plain-torch references (:mod:`kilnlm.plugins.reference`,
registered for CPU in this process), as a yardstick: how far a second implementation lands from the engine.

Writes ``$OUT/gpu_network_check.json`` when OUT is set; exits 1 on any failed check or error.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

# Each case: (the build options on top of LIMITS, the tolerance on logits and 16/32-bit pools). Float32
# activations without 8-bit rounding in the data path: 1e-4, the ONNX Runtime equivalence test's bound
# (kernels summing in another order differ by ~1e-6). Elsewhere a value near a rounding boundary of bfloat16,
# an 8-bit activation or an 8-bit KV code rounds one way in one implementation and the other way in another,
# and the step propagates: about twice the largest distance from the CPU engine measured for either the
# plugins' plain-torch references (on CPU) or the GPU, on the recorded steps.
CASES = {
    "fp32": (dict(qformat="fp32", dtype="float32"), 1e-4),
    "fp32, fp8 KV": (dict(qformat="fp32", dtype="float32", kv_cache_dtype="fp8"), 1e-3),
    "bf16": (dict(qformat="bf16", dtype="bfloat16"), 0.1),
    "bf16, int8 KV": (dict(qformat="bf16", dtype="bfloat16", kv_cache_dtype="int8"), 0.15),
    "fp8": (dict(qformat="fp8", dtype="float32"), 0.05),
    "fp8, bf16, fp8 KV": (dict(qformat="fp8", dtype="bfloat16", kv_cache_dtype="fp8"), 0.5),
    "int4_awq": (dict(qformat="int4_awq", dtype="float32", group_size=32), 1e-4),
    "int8_sq": (dict(qformat="int8_sq", dtype="float32"), 0.05),
}
LIMITS = dict(max_batch_size=8, max_seq_len=256, max_num_tokens=256, tokens_per_block=16)
# Per step, per sequence b: ("prompt", b, n) its prompt's first n tokens, ("chunk", b, start, end) its prompt's
# tokens start..end-1 after start cached ones, ("gen", b) the engine's last greedy token for it. Sequence b owns
# blocks b * max_blocks_per_seq ... (a pool of 3 sequences' worth).
PROMPT_LENGTHS = (37, 5, 40)
SCHEDULE = [
    [("prompt", 0, 37), ("prompt", 1, 5)],
    [("gen", 0), ("gen", 1), ("chunk", 2, 0, 24)],
    [("gen", 0), ("gen", 1), ("chunk", 2, 24, 40)],
    [("gen", 0), ("gen", 1), ("gen", 2)],
    [("gen", 0), ("gen", 1), ("gen", 2)],
    [("gen", 0), ("gen", 1), ("gen", 2)],
    [("gen", 0), ("gen", 1), ("gen", 2)],
]


# ---- prepare (the build machine) -------------------------------------------------------------------------

def record_steps(engine, vocab_size: int) -> dict:
    """Runs :data:`SCHEDULE` through ``engine`` (teacher-forced on its greedy tokens); returns the steps'
    inputs, logits and the pool after the last step."""
    from kilnlm.runtime.abi import pack_sequences

    build = engine.manifest.build
    max_blocks = build.max_blocks_per_seq
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    lengths = [0] * len(prompts)  # tokens in the cache
    last = [None] * len(prompts)  # greedy token of the last step
    pool = engine.allocate_kv_cache(len(prompts) * build.max_blocks_per_seq)
    steps, logits = [], []
    for step in SCHEDULE:
        seqs = []
        for kind, b, *span in step:
            if kind == "gen":
                seqs.append(([last[b]], lengths[b]))
            else:
                start, end = (0, span[0]) if kind == "prompt" else span
                seqs.append((prompts[b][start:end], lengths[b]))
        # sequence b owns blocks b * max_blocks ... (b + 1) * max_blocks - 1
        inputs = pack_sequences([(new_ids, cached, range(b * max_blocks, (b + 1) * max_blocks))
                                 for (new_ids, cached), (_, b, *_) in zip(seqs, step)],
                                build.tokens_per_block, max_blocks)
        out = engine.forward(inputs, pool)
        for row, ((new_ids, cached), (_, b, *_)) in enumerate(zip(seqs, step)):
            lengths[b] = cached + len(new_ids)
            last[b] = int(out[row].argmax())
        steps.append(dict(vars(inputs)))
        logits.append(out.clone())
    return dict(steps=steps, logits=logits, pool=pool.clone())


def share_equal_tensors(networks: list[torch.nn.Module]) -> int:
    """Points every parameter / buffer equal (dtype, shape, values) to one seen earlier at the same storage,
    so torch.save writes it once. Returns the bytes saved."""
    seen: dict[tuple, list[torch.Tensor]] = {}
    saved = 0
    for network in networks:
        for tensor in [*network.parameters(), *network.buffers()]:
            if tensor.numel() < 4096:
                continue
            candidates = seen.setdefault((tensor.dtype, tuple(tensor.shape)), [])
            match = next((c for c in candidates if c is tensor or torch.equal(c, tensor)), None)
            if match is None:
                candidates.append(tensor)
            elif match is not tensor:
                tensor.data = match.data
                saved += tensor.numel() * tensor.element_size()
    return saved


def prepare(checkpoint: Path, out: Path, work_dir: Path, names: list[str]) -> None:
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.config import BuildOptions
    from kilnlm.builder.targets.cpu import CpuTarget
    from kilnlm.runtime.engine import Engine

    captured = {}
    compile_engine = CpuTarget.compile

    def capture(self, network, model, build, dtype, out_dir, options):
        captured.update(network=copy.deepcopy(network), model=model, build=build, dtype=dtype)
        return compile_engine(self, network, model, build, dtype, out_dir, options)

    CpuTarget.compile = capture
    cases = {}
    try:
        for name in names:
            options, _ = CASES[name]
            t0 = time.perf_counter()
            engine_dir = work_dir / name.replace(", ", "_").replace(" ", "-")
            build_engine(BuildOptions(checkpoint=checkpoint, output=engine_dir, overwrite=True, **LIMITS, **options))
            engine = Engine.load(engine_dir, trusted_keys=None)
            record = record_steps(engine, captured["model"].vocab_size)
            cases[name] = dict(options=options, network=captured["network"].eval(), model=captured["model"],
                               build=captured["build"], dtype=captured["dtype"], **record)
            print(f"{name}: built and recorded in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        CpuTarget.compile = compile_engine
    saved = share_equal_tensors([case["network"] for case in cases.values()])
    torch.save(dict(cases=cases, checkpoint=str(checkpoint), torch=torch.__version__), out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {saved / 1e6:.1f} MB of equal tensors stored once)")


# ---- run (the GPU machine) -------------------------------------------------------------------------------

def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def compare(case: dict, logits: list[torch.Tensor], pool: torch.Tensor) -> dict:
    """Distances of a run's logits and pool from the CPU engine's."""
    expected, got = torch.cat(case["logits"]).float(), torch.cat([x.cpu() for x in logits]).float()
    pool, expected_pool = pool.cpu(), case["pool"]
    same = got.argmax(-1) == expected.argmax(-1)
    result = dict(max_abs_logit_diff=float((got - expected).abs().max()),
                  rel_l2_logit_diff=float((got - expected).norm() / expected.norm()),
                  argmax_agreement=f"{int(same.sum())}/{same.numel()}",
                  max_margin_of_disagreements=float(margins(expected)[~same].max()) if not same.all() else None)
    if expected_pool.dtype in (torch.float32, torch.bfloat16):
        result["max_abs_pool_diff"] = float((pool.float() - expected_pool.float()).abs().max())
    else:
        written = expected_pool.view(torch.uint8) != 0
        differing = pool.view(torch.uint8) != expected_pool.view(torch.uint8)
        result["pool_codes_differing"] = f"{int(differing.sum())}/{int(written.sum())}"
    return result


def check(result: dict, tolerance: float) -> bool:
    """The logits and (16/32-bit pools) the pool within ``tolerance`` of the CPU engine's."""
    return all(result[key] <= tolerance for key in ("max_abs_logit_diff", "max_abs_pool_diff") if key in result)


def run_steps(forward, case: dict, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """The case's steps through ``forward(*args)`` on a fresh pool; returns logits, pool, seconds."""
    from kilnlm.runtime.abi import EngineInputs

    pool = torch.zeros_like(case["pool"], device=device)
    logits = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for inputs in case["steps"]:
            args = EngineInputs(**{k: v.to(device) for k, v in inputs.items()}).as_args(pool)
            logits.append(forward(*args))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return logits, pool, time.perf_counter() - t0


def export_program(network: torch.nn.Module, case: dict, device: torch.device) -> torch.nn.Module:
    """``torch.export`` of ``network`` with the build's dynamic shapes, as the ONNX export runs it."""
    from kilnlm.builder.targets.cpu import dynamic_shapes, example_inputs

    args = tuple(a.to(device) for a in example_inputs(case["model"], case["build"], case["dtype"]))
    with torch.no_grad():
        exported = torch.export.export(network, args, dynamic_shapes=dynamic_shapes(case["build"]), strict=False)
        exported = exported.run_decompositions({})
    return exported.module()


def run(payload_path: Path, device: torch.device) -> dict:
    from kilnlm.plugins.reference import register_references

    if device.type == "cuda":
        from kilnlm.plugins.gpu import register_cuda_kernels

        register_cuda_kernels()
    # the references on CPU (every op), and on CUDA the linears (paged attention has the Triton kernels)
    registrations = [register_references(dispatch_key) for dispatch_key in ("CPU", "CUDA")]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    payload = torch.load(payload_path, weights_only=False)
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, prepared_with_torch=payload["torch"], cases={})
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    cpu = torch.device("cpu")
    for name, case in payload["cases"].items():
        entry = report["cases"][name] = dict(tolerance=CASES[name][1])
        try:
            logits, pool, _ = run_steps(case["network"], case, cpu)  # the references on CPU, for comparison
            entry["reference_cpu"] = compare(case, logits, pool)
            network = case["network"].to(device)
            for mode, make in (("eager", lambda: network), ("exported", lambda: export_program(network, case, device))):
                t0 = time.perf_counter()
                forward = make()
                setup = time.perf_counter() - t0
                run_steps(forward, case, device)  # warm-up: Triton compiles the kernels for this case
                logits, pool, seconds = run_steps(forward, case, device)
                result = compare(case, logits, pool)
                entry[mode] = dict(result, passed=check(result, CASES[name][1]), setup_s=round(setup, 2),
                                   steps_s=round(seconds, 4))
        except Exception:
            entry["error"] = traceback.format_exc(limit=6)
        status = "ERROR" if "error" in entry else " ".join(
            f"{mode}:{'ok' if entry[mode]['passed'] else 'FAIL'}" for mode in ("eager", "exported"))
        print(f"{name:20s} {status}  " + json.dumps({m: r for m, r in entry.items() if m != "error"}), flush=True)
        if "error" in entry:
            print(entry["error"], flush=True)
    report["passed"] = all("error" not in e and e["eager"]["passed"] and e["exported"]["passed"]
                           for e in report["cases"].values())
    del registrations  # kept alive until here: the references stay registered while the cases run
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="build the cases' CPU engines and record their steps (build machine)")
    prep.add_argument("--checkpoint", type=Path, required=True, help="a Hugging Face Llama checkpoint directory")
    prep.add_argument("--out", type=Path, required=True, help="the file to write")
    prep.add_argument("--work-dir", type=Path, default=Path("gpu_network_engines"), help="where the engines are built")
    prep.add_argument("--cases", type=lambda text: text.split(";"), default=list(CASES),
                      help=f"';'-separated case names (default: all of {'; '.join(CASES)})")
    check = commands.add_parser("run", help="run the recorded steps on the GPU and compare (GPU machine)")
    check.add_argument("payload", type=Path, help="the file prepare wrote")
    check.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of this script)")
    args = parser.parse_args()
    if args.command == "prepare":
        unknown = sorted(set(args.cases) - set(CASES))
        if unknown:
            parser.error(f"unknown cases {unknown}: choose from {list(CASES)}")
        prepare(args.checkpoint, args.out, args.work_dir, args.cases)
        return 0
    report = run(args.payload, torch.device(args.device))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_network_check.json").write_text(json.dumps(report, indent=1))
    print("all checks passed" if report["passed"] else "SOME CHECKS FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
