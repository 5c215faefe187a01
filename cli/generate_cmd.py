"""``kilnlm generate``: run one prompt through an engine and stream the completion to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kilnlm.cli.trust_options import add_trusted_keys_option, trusted_keys


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--engine", required=True, type=Path, help="engine directory written by `kilnlm build`")
    add_trusted_keys_option(p)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: 0.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens reaching this probability mass; 1.0 = off (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string; the output ends before it (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens (default: off)")
    guide = p.add_mutually_exclusive_group()
    guide.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                       help="structured output: the completion is JSON valid under the JSON schema in FILE "
                            "(needs kilnlm[guided]; default: unconstrained)")
    guide.add_argument("--regex", default=None, help="structured output: the completion matches this regular "
                                                     "expression (needs kilnlm[guided]; default: unconstrained)")
    guide.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                       help="structured output: the completion follows the EBNF grammar in FILE, xgrammar's "
                            "syntax, root rule `root` (needs kilnlm[guided]; default: unconstrained)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the engine's chat template (default: off)")
    p.add_argument("--system", default=None, help="with --chat: a system message (default: the template's own)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3} or {"method": "draft", "model": DRAFT_ENGINE_DIR, '
                        '"num_speculative_tokens": 3} (default: off)')
    p.add_argument("--stats", action="store_true",
                   help="print token counts, time to first token (ms) and tokens/s to stderr (default: off)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kilnlm.runtime.executor import Executor, ExecutorConfig
    from kilnlm.runtime.request import SamplingParams

    guided_decoding = _guided_decoding(args)
    # One request: a batch of one, and (by default) a KV pool of one max_seq_len sequence.
    config = ExecutorConfig(max_batch_size=1, speculative_config=args.speculative_config)
    executor = Executor.from_engine_dir(args.engine, config, trusted_keys(args))
    try:
        tokenizer = executor.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                          add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(args.prompt)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                                guided_decoding=guided_decoding)
        start_s = time.perf_counter()
        first_token_s = None
        request_id = executor.submit(prompt_ids, params)
        for response in executor.stream(request_id):
            if first_token_s is None and response.token_ids:
                first_token_s = time.perf_counter() - start_s
            if response.text:
                sys.stdout.write(response.text)
                sys.stdout.flush()
            last = response
        total_s = time.perf_counter() - start_s
        stats = executor.stats()
        sys.stdout.write("\n")
        sys.stdout.flush()
    finally:
        executor.shutdown()
    if last.finish_reason is not None and last.finish_reason.value == "error":
        print(f"kilnlm generate: error: {last.error}", file=sys.stderr)
        return 1
    if args.stats:
        decode_s = total_s - (first_token_s or 0.0)
        num_decoded = max(last.num_generated_tokens - 1, 0)
        print(f"[kilnlm generate] prompt {last.num_prompt_tokens} tokens, generated {last.num_generated_tokens} "
              f"({last.finish_reason.value}); TTFT {1e3 * (first_token_s or total_s):.1f} ms; "
              f"{num_decoded / decode_s if decode_s > 0 else 0.0:.1f} tokens/s after the first", file=sys.stderr)
        if stats.total_draft_tokens:
            print(f"[kilnlm generate] speculative: {stats.total_accepted_draft_tokens} of {stats.total_draft_tokens} "
                  f"draft tokens accepted ({stats.total_accepted_draft_tokens / stats.total_draft_tokens:.0%})",
                  file=sys.stderr)
    return 0


def _guided_decoding(args: argparse.Namespace):
    """The ``GuidedDecodingParams`` of --json-schema / --regex / --grammar, or None. Raises
    :class:`KilnError` for a guide file that cannot be read."""
    from kilnlm.runtime.errors import KilnError
    from kilnlm.runtime.request import GuidedDecodingParams

    if args.regex is not None:
        return GuidedDecodingParams("regex", args.regex)
    for option, guide_type, path in (("--json-schema", "json_schema", args.json_schema),
                                     ("--grammar", "ebnf_grammar", args.grammar)):
        if path is not None:
            try:
                return GuidedDecodingParams(guide_type, path.read_text())
            except OSError as exc:
                raise KilnError(f"{option} {path}: {exc.strerror or exc}: give a readable file") from None
    return None
