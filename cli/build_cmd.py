"""``kilnlm build``: compile a checkpoint (HF directory or .gguf) into an engine directory."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    from kilnlm.builder.build import QFORMATS
    from kilnlm.builder.kv_quant import KV_CACHE_DTYPE_CHOICES

    p = subparsers.add_parser(name, help=help_text, description=help_text)
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="Hugging Face model directory (config.json + *.safetensors) or a .gguf file")
    p.add_argument("--output", required=True, type=Path, help="engine directory to create")
    p.add_argument("--qformat", choices=QFORMATS, default="fp32",
                   help="weight format (TensorRT-LLM's names): fp32, bf16, fp8 (E4M3 per-tensor, calibrated), int4_awq "
                        "(W4A16 group-wise, AWQ-calibrated), int4_wo / int8_wo (weight-only round-to-nearest, per group / "
                        "per channel), int8_sq (W8A8 SmoothQuant, calibrated); quantization through NVIDIA ModelOpt "
                        "(default: fp32)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="activation and KV-cache dtype; auto = float32 for fp32, bfloat16 for every other qformat "
                        "(default: auto)")
    p.add_argument("--group-size", type=int, default=None, metavar="COLUMNS",
                   help="int4 formats: input columns sharing one weight scale; must divide every linear's in_features "
                        "(default: 128, or the largest of 64 / 32 / 16 that divides them, e.g. 64 for SmolLM2's 576)")
    p.add_argument("--calib-data", type=Path, default=None, metavar="PATH",
                   help="calibration text for fp8 / int4_awq / int8_sq: a plain UTF-8 text file, or .jsonl with a "
                        "\"text\" field per line (default: half the samples from kilnlm's general English text, half "
                        "from the Python standard library's pydoc_data.topics)")
    p.add_argument("--calib-size", type=int, default=None, metavar="SAMPLES",
                   help="calibration samples taken at evenly spaced offsets of the text (default: 24; 16 for int4_awq, whose "
                        "AWQ search runs every sample once per candidate scaling)")
    p.add_argument("--calib-max-seq-len", type=int, default=None, metavar="TOKENS",
                   help="tokens per calibration sample (default: 256)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantized formats: quantize the LM head too (default: off; the embedding and "
                        "LM head stay 16-bit)")
    p.add_argument("--zero-point", action=argparse.BooleanOptionalAction, default=None,
                   help="int4_awq / int4_wo: asymmetric groups, each with an int8 zero point: w = (q - zero) * scale "
                        "over the group's [min, max] (AWQ's own quantizer, Lin et al. 2023) instead of symmetric "
                        "[-amax, amax] (default: on for int4_awq, off for int4_wo, TensorRT-LLM's round-to-nearest; "
                        "--no-zero-point keeps ModelOpt's symmetric W4A16_AWQ checkpoint exactly)")
    p.add_argument("--per-token", action="store_true",
                   help="int8_sq: quantize activations with dynamic per-token scales (each token's amax / 127, as "
                        "TensorRT-LLM's --per_token) instead of one calibrated per-tensor scale (default: off)")
    p.add_argument("--smoothquant-alpha", type=float, default=None, metavar="ALPHA",
                   help="int8_sq: SmoothQuant's migration strength in [0, 1], how much of the activations' range moves "
                        "into the weights (default: searched over 0.5, 0.6, ..., 1.0 for the lowest loss on held-out "
                        "windows of the calibration text, seven calibrations; 0.5 with --per-token, TensorRT-LLM's "
                        "recipe)")
    p.add_argument("--export-checkpoint", type=Path, default=None, metavar="DIR",
                   help="integer formats: also write the quantized checkpoint in ModelOpt's unified Hugging Face "
                        "format (config.json with quantization_config, hf_quant_config.json, safetensors with "
                        "scales) to DIR (default: not written)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="paged KV-cache storage: auto = the activation dtype (--dtype); fp8 (E4M3) or int8 = 8 bits with "
                        "per-layer K and V scales calibrated on the calibration text (half of bfloat16's bytes: twice "
                        "the tokens in the same --kv-cache-bytes) (default: auto)")
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences per forward (default: 32)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="tokens per sequence, prompt + generated (default: 2048)")
    p.add_argument("--max-num-tokens", type=int, default=2048,
                   help="tokens packed into one forward, context chunks + generation tokens (default: 2048)")
    p.add_argument("--tokens-per-block", type=int, default=32, help="tokens per paged-KV block (default: 32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output directory")
    p.add_argument("--cache", default=None, metavar="URL",
                   help="engine cache (a directory, file:///path or s3://bucket/prefix): on a hit the engine is fetched "
                        "and verified instead of built, on a miss it is built and then published (default: no cache)")
    p.add_argument("--name", default=None, metavar="NAME[:VERSION]",
                   help="with --cache: tag the engine NAME:VERSION; without VERSION the next integer version, unless "
                        "NAME already has a version of this engine (default: untagged)")
    p.add_argument("--quiet", action="store_true", help="print only errors")
    p.set_defaults(run=run)
    return p


def _build(args: argparse.Namespace, opts):
    """Build ``opts`` -- through the engine cache when ``--cache`` is given -- and return the manifest."""
    from kilnlm.builder.build import build_engine

    if not args.cache:
        return build_engine(opts)
    from kilnlm.builder.cached_build import build_with_cache

    return build_with_cache(opts, args.cache, args.name, say=(lambda line: None) if args.quiet else print).manifest


def run(args: argparse.Namespace) -> int:
    from kilnlm.builder.build import BuildOptions

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="[kilnlm build] %(message)s")
    if args.name and not args.cache:
        from kilnlm.builder.errors import BuildError

        raise BuildError("--name tags an engine in a cache: add --cache URL (or drop --name)")
    manifest = _build(args, BuildOptions(
        checkpoint=args.checkpoint, output=args.output, qformat=args.qformat, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, max_num_tokens=args.max_num_tokens,
        tokens_per_block=args.tokens_per_block, overwrite=args.overwrite, group_size=args.group_size,
        calib_data=args.calib_data, calib_num_samples=args.calib_size, calib_seq_len=args.calib_max_seq_len,
        quantize_lm_head=args.quantize_lm_head, export_checkpoint=args.export_checkpoint,
        per_token=args.per_token, smoothquant_alpha=args.smoothquant_alpha, zero_point=args.zero_point,
    ))
    if not args.quiet:
        size_bytes = sum(f["size"] for f in manifest.files.values())
        print(f"engine written to {args.output} ({size_bytes / 1e6:.1f} MB, qformat {manifest.build.qformat})")
    return 0
