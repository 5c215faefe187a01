"""``kilnlm deploy``: write an engine (local directory or cache reference) into a Triton model repository
as the model's next version. The logic is :func:`kilnlm.runtime.distribution.deploy.deploy`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kilnlm.cli.trust_options import add_trusted_keys_option, trusted_keys


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help=help_text, description=help_text + ". Each deploy adds a numbered version directory; "
        "Triton serves the highest, and removing it rolls back to the one before.")
    p.add_argument("ref", metavar="REF",
                   help="a local engine directory, or a cache reference: s3://bucket/prefix/NAME:VERSION, "
                        "/local/cache/NAME:latest, <cache url>/<key> (NAME:VERSION alone with --cache)")
    p.add_argument("--model-repository", required=True, type=Path,
                   help="the Triton model repository to write (created if absent)")
    p.add_argument("--version", type=int, default=None,
                   help="version number to write (default: the highest existing version + 1, or 1)")
    p.add_argument("--cache", default=None, metavar="URL",
                   help="cache to look a bare NAME:VERSION or key up in (default: $KILNLM_CACHE or "
                        "~/.cache/kilnlm/engines, as for `kilnlm cache`)")
    p.add_argument("--copy", action="store_true",
                   help="store a cache reference's engine files in the version directory instead of a "
                        "pointer resolved when the model loads (default: off, a pointer)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding the version serves with (over the model\'s speculative_config '
                        'parameter), vLLM\'s JSON as for `kilnlm serve`: {"method": "ngram", '
                        '"num_speculative_tokens": 4} or {"method": "draft", "model": DRAFT, '
                        '"num_speculative_tokens": 4}, DRAFT a local engine directory or cache reference of the '
                        'same tokenizer, verified as REF is and copied into the version as draft/ (default: none)')
    add_trusted_keys_option(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: off, one line)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kilnlm.cli.cache_cmd import default_cache_url
    from kilnlm.runtime.distribution.deploy import DeployConfig, deploy

    result = deploy(DeployConfig(ref=args.ref, model_repository=args.model_repository,
                                 version=args.version,
                                 cache_url=args.cache or default_cache_url(), copy_engine=args.copy,
                                 trusted_keys=trusted_keys(args), speculative_config=args.speculative_config))
    if args.json:
        print(json.dumps({"model_dir": str(result.model_dir), "version": result.version,
                          "version_dir": str(result.version_dir), "mode": result.mode,
                          "engine_ref": result.engine_ref, "cache_key": result.cache_key,
                          "created_model": result.created_model,
                          "companion_dirs": [str(p) for p in result.companion_dirs],
                          "speculative_config": result.speculative_config and json.loads(result.speculative_config)}))
        return 0
    what = f"pointer to {result.engine_ref}" if result.mode == "pointer" else \
        f"engine copy{' of ' + result.engine_ref if result.engine_ref else ''}"
    key = f" (key {result.cache_key[:16]}...)" if result.cache_key else ""
    print(f"deployed {result.model_dir.name} version {result.version}: {result.version_dir} holds the {what}{key}")
    if result.speculative_config:
        print(f"version {result.version} speculates with {json.dumps(json.loads(result.speculative_config))}")
    if result.created_model:
        print(f"new model set (tensorrt_llm, {', '.join(p.name for p in result.companion_dirs)}) in "
              f"{result.model_dir.parent}: serve it with "
              f"`python scripts/launch_triton.py --model-repository {result.model_dir.parent}`")
    return 0
