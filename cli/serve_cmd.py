"""``kilnlm serve``: serve an engine (local directory or cache reference) over OpenAI's HTTP API.
The server is :mod:`kilnlm.runtime.serving.openai_server`.

The executor's settings are its :class:`~kilnlm.runtime.executor.ExecutorConfig` fields under their
TensorRT-LLM names, one option each (``--max-batch-size`` or ``--max_batch_size``), generated from the
dataclass in :func:`add_executor_options`; an option left out keeps the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kilnlm.cli.trust_options import add_trusted_keys_option, trusted_keys

def add_executor_options(p: argparse.ArgumentParser) -> None:
    """One option per ExecutorConfig field (dashes or TensorRT-LLM's underscores), with the type, choices,
    default and help of :func:`kilnlm.runtime.serving.parameters.executor_options` (the field's metadata);
    values parse as config.pbtxt parameters do (``ExecutorOption.parse``)."""
    from kilnlm.runtime.serving.parameters import executor_options

    group = p.add_argument_group("executor (TensorRT-LLM's names)")
    for option in executor_options():
        group.add_argument(
            option.flag, "--" + option.name, dest="executor_" + option.name, default=None,
            metavar="|".join(option.choices) or _METAVARS.get(option.value_type, "VALUE"),
            type=lambda text, option=option: _parse(option, text),
            help=option.help if "default" in option.help else f"{option.help} (default: {option.default})")


_METAVARS = {bool: "true|false", int: "N", float: "X"}


def _parse(option, text: str):
    from kilnlm.runtime.errors import KilnError

    try:
        return option.parse(text)
    except KilnError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def executor_config(args: argparse.Namespace):
    """The ExecutorConfig the parsed options ask for (fields not given keep their defaults)."""
    from kilnlm.runtime.executor import ExecutorConfig

    return ExecutorConfig(**{field.name: getattr(args, "executor_" + field.name)
                             for field in dataclasses.fields(ExecutorConfig)
                             if getattr(args, "executor_" + field.name) is not None})


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    from kilnlm.runtime.serving.parameters import DEFAULT_MAX_TOKENS

    p = subparsers.add_parser(name, help=help_text, description=help_text + ": /v1/models, /v1/completions, "
                              "/v1/chat/completions (SSE streaming), /health, /metrics (Prometheus).")
    p.add_argument("--engine", required=True, metavar="DIR|CACHE_REF",
                   help="an engine directory written by `kilnlm build`, or a cache reference "
                        "(s3://bucket/prefix/NAME:VERSION, /local/cache/NAME:latest; NAME:VERSION alone with "
                        "--cache), fetched into --engine-cache-dir and verified")
    add_trusted_keys_option(p)
    p.add_argument("--cache", default=None, metavar="URL",
                   help="cache to look a bare NAME:VERSION or key up in (default: $KILNLM_CACHE or "
                        "~/.cache/kilnlm/engines, as for `kilnlm cache`)")
    p.add_argument("--engine-cache-dir", type=Path, default=None,
                   help="where a cache reference's engine is kept locally (default: $KILNLM_ENGINE_CACHE_DIR or "
                        "~/.cache/kilnlm/served-engines)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on; 0.0.0.0 = all (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the last part of --engine, e.g. smollm2_fp32)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: none, no key needed)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="TOKENS",
                   help=f"max_tokens of a request that sends none, in tokens (default: {DEFAULT_MAX_TOKENS})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    add_executor_options(p)
    p.set_defaults(run=run)
    return p


def resolve_engine(ref: str, cache_url: str | None, engine_cache_dir: Path | None) -> Path:
    """The local engine directory ``ref`` names: ``ref`` itself when it is a directory, else the verified
    local copy of the cache reference (``<cache url>/<ref>`` for a bare name or key).

    Raises:
        EngineError: the reference cannot be resolved, fetched or verified.
    """
    from kilnlm.runtime.distribution.deploy import is_cache_ref
    from kilnlm.runtime.distribution.engine_source import default_engine_cache_dir, materialize_cached_engine

    if not is_cache_ref(ref):
        return Path(ref).expanduser()
    full_ref = cache_url.rstrip("/") + "/" + ref if cache_url and "/" not in ref else ref
    served = materialize_cached_engine(full_ref, None, engine_cache_dir or default_engine_cache_dir(),
                                       log=lambda message: print(message, flush=True))
    return served.engine_dir


def run(args: argparse.Namespace) -> int:
    from kilnlm.cli.cache_cmd import default_cache_url
    from kilnlm.runtime.executor import Executor
    from kilnlm.runtime.serving.openai_server import ServerSettings, serve

    engine_dir = resolve_engine(args.engine, args.cache or default_cache_url(), args.engine_cache_dir)
    settings = ServerSettings(model_name=args.served_model_name or args.engine.rstrip("/").rsplit("/", 1)[-1],
                              api_key=args.api_key, default_max_tokens=args.default_max_tokens)
    executor = Executor.from_engine_dir(engine_dir, executor_config(args), trusted_keys(args))
    try:
        print(f"kilnlm serve: {engine_dir} as model '{settings.model_name}' on http://{args.host}:{args.port}/v1",
              flush=True)
        engine_error = serve(executor, settings, args.host, args.port, args.log_level)
    finally:
        executor.shutdown()
    if engine_error is not None:
        print(f"kilnlm serve: stopped: the engine cannot run any more ({engine_error})", file=sys.stderr, flush=True)
        return 1
    return 0
