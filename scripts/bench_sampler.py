"""Benchmark one sampler step on SmolLM2's vocabulary: per-step time of each path (greedy, penalties,
log-probs, temperature + top-p) for a batch of rows with prompt + generated tokens, and the penalties'
sparse form (kilnlm.runtime.sampler) against a dense ``[rows, vocab]`` count + ``where``::

    .venv/bin/python scripts/bench_sampler.py --rows 32 --prompt-tokens 512 --generated-tokens 256
"""

from __future__ import annotations

import argparse
import time

import torch

from kilnlm.runtime.request import Request, SamplingParams
from kilnlm.runtime.sampler import Sampler

VOCAB_SIZE = 49152  # SmolLM2's


def make_requests(args, generator: torch.Generator, **params) -> list[Request]:
    requests = []
    for i in range(args.rows):
        prompt = torch.randint(0, VOCAB_SIZE, (args.prompt_tokens,), generator=generator).tolist()
        request = Request(i, prompt, SamplingParams(max_tokens=args.generated_tokens + 1, **params), end_ids=frozenset(),
                          max_num_tokens=args.prompt_tokens + args.generated_tokens + 1)
        request.token_ids += torch.randint(0, VOCAB_SIZE, (args.generated_tokens,), generator=generator).tolist()
        requests.append(request)
    return requests


def dense_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The dense alternative: [R, 2, vocab] counts from one bincount, then where over every logit."""
    rows, vocab_size = len(requests), logits.shape[1]
    token_ids = torch.tensor([t for r in requests for t in r.token_ids])
    lengths = torch.tensor([n for r in requests for n in (r.num_prompt_tokens, r.num_generated_tokens)])
    segment = torch.repeat_interleave(torch.arange(2 * rows), lengths)
    counts = torch.bincount(segment * vocab_size + token_ids, minlength=2 * rows * vocab_size).view(rows, 2, vocab_size).float()
    p = requests[0].params
    penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
    logits = torch.where((counts[:, 0] + counts[:, 1]) > 0, penalised, logits)
    return logits - p.presence_penalty * (counts[:, 1] > 0).float() - p.frequency_penalty * counts[:, 1]


def time_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--generated-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, VOCAB_SIZE, generator=generator)
    sampler = Sampler()
    penalties = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
    print(f"{args.rows} rows, vocab {VOCAB_SIZE:,}, {args.prompt_tokens} + {args.generated_tokens} tokens each, "
          f"{torch.get_num_threads()} threads")
    for name, params in [("greedy", {}), ("greedy + 3 penalties", penalties), ("greedy + logprobs=5", dict(logprobs=5)),
                         ("temperature 0.8, top_p 0.9", dict(temperature=0.8, top_p=0.9, seed=1))]:
        requests = make_requests(args, generator, **params)
        print(f"  sample, {name:28s} {time_ms(lambda: sampler.sample(logits, requests), args.repeats):8.2f} ms per step")
    requests = make_requests(args, generator, **penalties)
    sparse = time_ms(lambda: Sampler._apply_penalties(logits, requests), args.repeats)
    dense = time_ms(lambda: dense_penalties(logits, requests), args.repeats)
    assert torch.allclose(Sampler._apply_penalties(logits, requests), dense_penalties(logits, requests), atol=1e-5)
    print(f"  penalties: sparse (kilnlm) {sparse:.2f} ms, dense [rows, vocab] {dense:.2f} ms per step")


if __name__ == "__main__":
    main()
