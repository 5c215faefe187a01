"""``kilnlm eval``: perplexity of text files through an engine (one JSON record per text on stdout).

The method (strided sliding windows through the engine's paged KV cache) is described in
:mod:`kilnlm.runtime.perplexity`. Use held-out text, never the calibration text (``kilnlm build``
calibrates on kilnlm's ``builder/data/general_en.txt`` and the standard library's ``pydoc_data.topics`` by
default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kilnlm.cli.trust_options import add_trusted_keys_option, trusted_keys


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    from kilnlm.runtime.perplexity import DEFAULT_CHUNK_TOKENS, DEFAULT_CONTEXT_LEN

    p = subparsers.add_parser(name, help=help_text, description=help_text + ". Prints one JSON object per --text, one "
                              "per line: text, perplexity, tokens (scored), seconds (of engine forwards), mean_nll "
                              "(nats/token), ...")
    p.add_argument("--engine", required=True, type=Path, help="engine directory written by `kilnlm build`")
    add_trusted_keys_option(p)
    p.add_argument("--text", required=True, type=Path, action="append",
                   help="UTF-8 text file to evaluate (held-out text, not the calibration text); repeat it to "
                        "evaluate several texts with one engine load, one JSON record each, in the order given")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="evaluate only the text's first N tokens (default: all of it)")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"tokens per window (default: {DEFAULT_CONTEXT_LEN} or the engine's max_seq_len if smaller)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts, 1..context-len - 1; each scored token sees at least "
                        "context-len - stride tokens of context (default: context-len / 2)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"tokens per engine forward, capped at max_num_tokens (default: {DEFAULT_CHUNK_TOKENS})")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kilnlm.runtime.errors import RequestError
    from kilnlm.runtime.perplexity import PerplexityConfig, evaluate_text_files

    if args.max_tokens is not None and args.max_tokens < 2:
        raise RequestError(f"--max-tokens is {args.max_tokens}: perplexity needs at least 2 tokens")
    config = PerplexityConfig(context_len=args.context_len, stride=args.stride, max_tokens=args.max_tokens,
                              chunk_tokens=args.chunk_tokens)
    for text, result in evaluate_text_files(args.engine, args.text, config, trusted_keys(args)):
        sys.stdout.write(json.dumps({"engine": str(args.engine), "text": str(text), **result.as_dict()}) + "\n")
        sys.stdout.flush()
    return 0
