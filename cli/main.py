"""The ``kilnlm`` console script: one entry point, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (registers its options, each with unit and
default in its help) and ``run(args) -> int`` (the exit status). Errors kilnlm raises on bad input
(:class:`kilnlm.runtime.errors.KilnError`) are printed as one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# subcommand -> module under kilnlm.cli. Imported lazily so that `kilnlm generate` on a serving-only
# install never imports the build toolchain.
SUBCOMMANDS = {
    "build": ("kilnlm.cli.build_cmd", "compile a checkpoint (HF directory or .gguf) into an engine"),
    "generate": ("kilnlm.cli.generate_cmd", "run a prompt through an engine and stream the completion"),
    "cache": ("kilnlm.cli.cache_cmd", "list, push, pull, tag, verify, rm and gc engines in an engine cache (directory or S3)"),
    "deploy": ("kilnlm.cli.deploy_cmd", "write an engine (directory or cache reference) into a Triton model repository"),
    "eval": ("kilnlm.cli.eval_cmd", "perplexity of a text file through an engine"),
    "serve": ("kilnlm.cli.serve_cmd", "serve an engine over OpenAI's HTTP API (completions, chat, SSE, metrics)"),
}

# Subcommands that load the engine their --engine names (and a --speculative-config's draft engine): its
# files' SHA-256 checks start before anything imports torch (kilnlm.runtime.manifest.prehash_engine_files),
# on the core `import torch` leaves idle.
LOADS_ENGINE = ("generate", "serve", "eval")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kilnlm",
        description="kilnlm: an ahead-of-time compiled LLM engine builder and in-flight-batching runtime.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub, name, help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    from kilnlm.runtime.errors import KilnError
    from kilnlm.runtime.manifest import prehash_engine_files

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LOADS_ENGINE:
        for engine_dir in _engine_dirs(argv[1:]):
            prehash_engine_files(engine_dir)  # a cache reference, or no engine there: nothing starts
    args = make_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KilnError as exc:
        print(f"kilnlm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _engine_dirs(args: list[str]) -> list[str]:
    """The engines a subcommand's arguments name, read before argparse (whose parsers' construction imports
    torch): ``--engine``'s value, and a ``--speculative-config``'s draft ``model``. Options spelled
    otherwise (abbreviated) or JSON that does not parse name none: argparse and the executor report those."""
    engine_dirs = [value for value in (_option_value(args, "--engine"),) if value is not None]
    try:
        spec = json.loads(_option_value(args, "--speculative-config") or "null")
    except json.JSONDecodeError:
        spec = None
    if isinstance(spec, dict) and spec.get("method") == "draft" and isinstance(spec.get("model"), str):
        engine_dirs.append(spec["model"])
    return engine_dirs


def _option_value(args: list[str], option: str) -> str | None:
    """The value of ``option`` (``--name VALUE`` or ``--name=VALUE``) in ``args``, or None."""
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(option + "="):
            return arg.partition("=")[2]
    return None


if __name__ == "__main__":
    sys.exit(main())
