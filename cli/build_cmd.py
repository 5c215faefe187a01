"""``kilnlm build``: compile a checkpoint (HF directory or .gguf) into an engine directory.

One flag per :class:`kilnlm.builder.config.BuildOptions` field, of the same name (``--calib-size`` is
``calib_size``). Defaults, choices and the defaults quoted in the help texts are read from the options'
field defaults and from the format and target registries, never written here.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from pathlib import Path

from kilnlm.cli.trust_options import add_sign_key_option


def _formats_help() -> dict[str, str]:
    """Help fragments generated from the format registry (:mod:`kilnlm.builder.formats`)."""
    from kilnlm.builder.formats import (FORMATS, PER_TOKEN_SMOOTHQUANT_ALPHA, SMOOTHQUANT_ALPHA_GRID, QuantFormat,
                                        format_names)

    def names(predicate) -> str:
        return " / ".join(format_names(predicate))

    described = ", ".join(f"{f.name} ({f.summary})" if f.summary else f.name for f in FORMATS.values())
    by_dtype: dict[str, list[str]] = {}
    for f in FORMATS.values():
        by_dtype.setdefault(f.activation_dtype, []).append(f.name)
    usual_dtype = max(by_dtype, key=lambda d: len(by_dtype[d]))
    auto = ", ".join(f"{d} for {', '.join(n)}" for d, n in by_dtype.items() if d != usual_dtype)
    usual_calib = next(f.default for f in fields(QuantFormat) if f.name == "calib_size")
    calib_exceptions = "".join(f"; {f.calib_size} for {f.name}" + (f", {f.calib_size_reason}" if f.calib_size_reason else "")
                               for f in FORMATS.values() if f.calibrated and f.calib_size != usual_calib)
    group_sizes = sorted({f.group_size for f in FORMATS.values() if f.group_wise})
    zero_points = [f for f in FORMATS.values() if f.zero_point is not None]
    grid = SMOOTHQUANT_ALPHA_GRID
    return {
        "qformat": described,
        "auto_dtype": f"{auto}, {usual_dtype} for every other qformat",
        "group_size": " / ".join(map(str, group_sizes)),
        "calibrated": names(lambda f: f.calibrated),
        "calib_size": f"{usual_calib}{calib_exceptions}",
        "zero_point": names(lambda f: f.zero_point is not None),
        "zero_point_default": ", ".join(f"{'on' if f.zero_point else 'off'} for {f.name}" for f in zero_points),
        "smoothquant": names(lambda f: f.smoothquant),
        "smooths": names(lambda f: f.smooths),
        "smoothing_default": ", ".join(f"{f.smoothing_alpha:g} for {f.name}" for f in FORMATS.values()
                                       if f.smoothing_alpha is not None),
        "alpha_grid": f"{grid[0]}, {grid[1]}, ..., {grid[-1]}",
        "alpha_calibrations": str(len(grid) + 1),
        "per_token_alpha": str(PER_TOKEN_SMOOTHQUANT_ALPHA),
        "per_token_default": ", ".join(f"{'on' if f.per_token else 'off'} for {f.name}" for f in FORMATS.values()
                                       if f.smoothquant),
        "auto_quantize": names(lambda f: f.auto_quantize_bits is not None),
        "auto_quantize_default": ", ".join(f"{f.auto_quantize_bits:g} for {f.name}" for f in FORMATS.values()
                                           if f.auto_quantize_bits is not None),
        "fp8_rowwise": " / ".join(f"--qformat {f.fp8_rowwise_of} --use-fp8-rowwise = --qformat {f.name}"
                                  for f in FORMATS.values() if f.fp8_rowwise_of),
    }


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    from kilnlm.builder.config import DEFAULT_CALIB_MAX_SEQ_LEN, DTYPES, option_default
    from kilnlm.builder.formats import FORMATS
    from kilnlm.builder.kv_quant import KV_CACHE_DTYPE_CHOICES
    from kilnlm.builder.targets import TARGETS

    default = option_default
    h = _formats_help()
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="Hugging Face model directory (config.json + *.safetensors) or a .gguf file (required unless "
                        "--from-onnx)")
    p.add_argument("--from-onnx", type=Path, default=None, metavar="EXPORT",
                   help="with --target tensorrt: build the TensorRT plan from an onnx export (an engine directory "
                        "built with --target onnx, or with --target tensorrt on a machine without TensorRT or a GPU) "
                        "on this GPU machine; the export's build options and limits apply")
    p.add_argument("--output", required=True, type=Path, help="engine directory to create")
    p.add_argument("--qformat", choices=tuple(FORMATS), default=default("qformat"),
                   help=f"weight format (TensorRT-LLM's names): {h['qformat']}; quantization through NVIDIA ModelOpt "
                        f"(default: {default('qformat')})")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default=default("dtype"),
                   help=f"activation and KV-cache dtype; auto = {h['auto_dtype']} (default: {default('dtype')})")
    p.add_argument("--target", choices=tuple(TARGETS), default=default("target"),
                   help=f"what the engine is compiled for: {', '.join(f'{t.name} ({t.description})' for t in TARGETS.values())}"
                        f" (default: {default('target')})")
    p.add_argument("--group-size", type=int, default=None, metavar="COLUMNS",
                   help=f"int4 formats: input columns sharing one weight scale; must divide every linear's in_features "
                        f"(default: {h['group_size']}, or the largest of 64 / 32 / 16 that divides them, e.g. 64 for "
                        "SmolLM2's 576)")
    p.add_argument("--calib-data", type=Path, default=None, metavar="PATH",
                   help=f"calibration text for {h['calibrated']}: a plain UTF-8 text file, or .jsonl with a "
                        "\"text\" field per line (default: half the samples from kilnlm's general English text, half "
                        "from the Python standard library's pydoc_data.topics)")
    p.add_argument("--calib-size", type=int, default=None, metavar="SAMPLES",
                   help=f"calibration samples taken at evenly spaced offsets of the text (default: {h['calib_size']})")
    p.add_argument("--calib-max-seq-len", type=int, default=None, metavar="TOKENS",
                   help=f"tokens per calibration sample (default: {DEFAULT_CALIB_MAX_SEQ_LEN})")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantized formats: quantize the LM head too (default: off; the embedding and "
                        "LM head stay 16-bit)")
    p.add_argument("--zero-point", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{h['zero_point']}: asymmetric groups, each with an int8 zero point: w = (q - zero) * scale "
                        "over the group's [min, max] (AWQ's own quantizer, Lin et al. 2023) instead of symmetric "
                        f"[-amax, amax] (default: {h['zero_point_default']}, TensorRT-LLM's round-to-nearest; "
                        "--no-zero-point keeps ModelOpt's symmetric W4A16_AWQ checkpoint exactly)")
    p.add_argument("--per-token", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{h['smoothquant']}: quantize activations with dynamic per-token scales (each token's amax / "
                        "127, as TensorRT-LLM's --per_token); --no-per-token: one per-tensor scale calibrated on the "
                        f"text (default: {h['per_token_default']})")
    p.add_argument("--use-fp8-rowwise", action="store_true",
                   help=f"TensorRT-LLM's spelling of FP8 rowwise (per-channel weight scales, per-token activation scales "
                        f"computed at run time): {h['fp8_rowwise']} (default: off)")
    p.add_argument("--auto-quantize-bits", type=float, default=None, metavar="BITS",
                   help=f"{h['auto_quantize']}: mean bits per weight of the decoder's linears; ModelOpt's auto_quantize "
                        "keeps the linears most sensitive on the calibration text in bfloat16 within that budget "
                        "(8 = every linear quantized, no search; the LM head is not counted, --quantize-lm-head "
                        f"decides it) (default: {h['auto_quantize_default']})")
    p.add_argument("--smoothquant-alpha", type=float, default=None, metavar="ALPHA",
                   help=f"{h['smooths']}: SmoothQuant's migration strength in [0, 1], how much of the activations' "
                        f"range moves into the weights (default: {h['smoothing_default']}; for {h['smoothquant']} "
                        f"searched over {h['alpha_grid']} for the lowest loss "
                        f"on held-out windows of the calibration text, {h['alpha_calibrations']} calibrations, with --no-per-token; "
                        f"{h['per_token_alpha']} with per-token scales, TensorRT-LLM's recipe)")
    p.add_argument("--export-checkpoint", type=Path, default=None, metavar="DIR",
                   help="integer formats: also write the quantized checkpoint in ModelOpt's unified Hugging Face "
                        "format (config.json with quantization_config, hf_quant_config.json, safetensors with "
                        "scales) to DIR (default: not written)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default=default("kv_cache_dtype"),
                   help="paged KV-cache storage: auto = the activation dtype (--dtype); fp8 (E4M3) or int8 = 8 bits with "
                        "per-layer K and V scales calibrated on the calibration text (half of bfloat16's bytes: twice "
                        f"the tokens in the same --kv-cache-bytes) (default: {default('kv_cache_dtype')})")
    p.add_argument("--max-batch-size", type=int, default=default("max_batch_size"),
                   help=f"sequences per forward (default: {default('max_batch_size')})")
    p.add_argument("--max-seq-len", type=int, default=default("max_seq_len"),
                   help=f"tokens per sequence, prompt + generated (default: {default('max_seq_len')})")
    p.add_argument("--max-num-tokens", type=int, default=default("max_num_tokens"),
                   help=f"tokens packed into one forward, context chunks + generation tokens "
                        f"(default: {default('max_num_tokens')})")
    p.add_argument("--tokens-per-block", type=int, default=default("tokens_per_block"),
                   help=f"tokens per paged-KV block (default: {default('tokens_per_block')})")
    p.add_argument("--tp-size", type=int, default=default("tp_size"),
                   help="tensor-parallel ranks: shard the network Megatron-style into one engine per rank (rank0.pt2, ...), "
                        "served by that many processes joined over torch.distributed (gloo); must divide the attention "
                        f"heads, KV heads and MLP width (default: {default('tp_size')})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output directory")
    p.add_argument("--cache", default=None, metavar="URL",
                   help="engine cache (a directory, file:///path or s3://bucket/prefix): on a hit the engine is fetched "
                        "and verified instead of built, on a miss it is built and then published (default: no cache)")
    p.add_argument("--name", default=None, metavar="NAME[:VERSION]",
                   help="with --cache: tag the engine NAME:VERSION; without VERSION the next integer version, unless "
                        "NAME already has a version of this engine (default: untagged)")
    add_sign_key_option(p)
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(run=run)
    return p


def build_options(args: argparse.Namespace):
    """The :class:`~kilnlm.builder.config.BuildOptions` of parsed ``kilnlm build`` arguments: each field from
    the flag of the same name (fields without a flag keep their defaults)."""
    from kilnlm.builder.config import BuildOptions

    return BuildOptions(**{f.name: getattr(args, f.name) for f in fields(BuildOptions) if hasattr(args, f.name)})


def _build(args: argparse.Namespace, opts):
    """Build ``opts`` -- through the engine cache when ``--cache`` is given -- and return the manifest."""
    from kilnlm.builder.build import build_engine

    if not args.cache:
        return build_engine(opts)
    from kilnlm.builder.cached_build import build_with_cache

    return build_with_cache(opts, args.cache, args.name, say=(lambda line: None) if args.quiet else print).manifest


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="[kilnlm build] %(message)s")
    if args.name and not args.cache:
        from kilnlm.builder.errors import BuildError

        raise BuildError("--name tags an engine in a cache: add --cache URL (or drop --name)")
    if args.from_onnx is not None:
        return _finish_from_onnx(args)
    if args.checkpoint is None:
        from kilnlm.builder.errors import BuildError

        raise BuildError("--checkpoint is required (or --from-onnx EXPORT --target tensorrt to finish an export)")
    manifest = _build(args, build_options(args))
    if not args.quiet:
        size_bytes = sum(f["size"] for f in manifest.files.values())
        print(f"engine written to {args.output} ({size_bytes / 1e6:.1f} MB, qformat {manifest.build.qformat})")
    return 0


def _finish_from_onnx(args: argparse.Namespace) -> int:
    """``--from-onnx EXPORT --target tensorrt``: the plan from an onnx export
    (:func:`kilnlm.builder.targets.tensorrt_target.build_plan_from_export`)."""
    from kilnlm.builder.errors import BuildError
    from kilnlm.builder.targets.tensorrt_target import TensorRTTarget, build_plan_from_export

    if args.target != TensorRTTarget.name:
        raise BuildError(f"--from-onnx builds a TensorRT plan: add --target {TensorRTTarget.name}")
    if args.checkpoint is not None or args.cache:
        raise BuildError("--from-onnx takes the export's checkpoint and options: drop --checkpoint and --cache")
    manifest = build_plan_from_export(args.from_onnx, args.output, overwrite=args.overwrite)
    if not args.quiet:
        size_bytes = sum(f["size"] for f in manifest.files.values())
        print(f"engine written to {args.output} ({size_bytes / 1e6:.1f} MB, target tensorrt, "
              f"TensorRT {manifest.toolchain['tensorrt']}, sm {manifest.toolchain['cuda_compute_capability']})")
    return 0
