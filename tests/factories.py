"""Test factories shared by the builder and runtime tests: tiny random-weight checkpoints and packed
engine inputs with a simple, deterministic block allocation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from kilnlm.runtime.abi import EngineInputs

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
)


def make_tiny_checkpoint(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, architecture: str = "llama",
                         seed: int = 0, **overrides) -> Path:
    """Write a random-weight HF checkpoint (config.json, model.safetensors, tokenizer files copied from
    ``tokenizer_dir``) with SmolLM2's vocabulary. ``architecture``: "llama" | "qwen2" | "mistral".
    Weights are scaled up from transformers' init so the logits are not all near zero."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    params = dict(TINY_LLAMA, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=architecture == "llama")
    if architecture == "mistral":
        params["sliding_window"] = None
    params.update(overrides)
    config = AutoConfig.for_model(architecture, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


def make_engine_inputs(seqs: list[tuple[list[int], int]], tokens_per_block: int, max_blocks_per_seq: int) -> EngineInputs:
    """Pack sequences into one :class:`EngineInputs`.

    ``seqs``: per sequence ``(new_token_ids, num_cached)`` -- the new tokens sit at positions
    ``num_cached .. num_cached + len(new) - 1``. Sequence b owns physical blocks
    ``b * max_blocks_per_seq + j`` (so a pool of ``len(seqs) * max_blocks_per_seq`` blocks suffices and
    a sequence keeps its blocks from step to step as long as it keeps its index b). Logits come back
    for each sequence's last new token."""
    input_ids, positions, slots, cu, logits_indices, seq_lens = [], [], [], [0], [], []
    for b, (new_ids, num_cached) in enumerate(seqs):
        for i, tok in enumerate(new_ids):
            pos = num_cached + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append((b * max_blocks_per_seq + pos // tokens_per_block) * tokens_per_block + pos % tokens_per_block)
        cu.append(cu[-1] + len(new_ids))
        logits_indices.append(cu[-1] - 1)
        seq_lens.append(num_cached + len(new_ids))
    num_seqs = len(seqs)
    block_tables = torch.arange(num_seqs * max_blocks_per_seq, dtype=torch.int32).reshape(num_seqs, max_blocks_per_seq)
    return EngineInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens_kv=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


def greedy_generate(engine, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    """Minimal greedy decoding through ``engine`` (a :class:`kilnlm.runtime.engine.Engine`): one context
    step over the whole prompt, then one generation step per token, all through the paged KV cache.
    Returns the generated token ids (without the prompt), stopping after an EOS id."""
    build = engine.manifest.build
    kv_cache = engine.allocate_kv_cache(build.max_blocks_per_seq)
    generated: list[int] = []
    new_ids, num_cached = list(prompt_ids), 0
    for _ in range(max_new_tokens):
        inputs = make_engine_inputs([(new_ids, num_cached)], build.tokens_per_block, build.max_blocks_per_seq)
        token = int(engine.forward(inputs, kv_cache)[0].argmax())
        generated.append(token)
        if token in eos_token_ids:
            break
        num_cached += len(new_ids)
        new_ids = [token]
    return generated


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate of exactly ``max_new_tokens`` tokens: ``min_new_tokens`` masks the EOS
    logits, which the executor matches by banning the EOS ids as ``bad_words``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def run_in_flight(executor, prompts: list[list[int]], max_tokens: list[int], timeout_s: float = 300) -> list[list[int]]:
    """Submit half the requests, wait until the first one is in its generation phase, then submit the rest
    (joining mid-flight); returns each request's generated token ids. EOS is banned (``bad_words``) so
    each request generates exactly its ``max_tokens``, as :func:`hf_greedy` does."""
    from kilnlm.runtime.request import SamplingParams

    half = len(prompts) // 2
    no_eos = tuple((e,) for e in executor.eos_token_ids)
    params = [SamplingParams(max_tokens=n, bad_words=no_eos) for n in max_tokens]
    ids = [executor.submit(p, sp) for p, sp in zip(prompts[:half], params[:half])]
    first_stream = executor.stream(ids[0], timeout_s=timeout_s)
    first = [next(first_stream)]
    ids += [executor.submit(p, sp) for p, sp in zip(prompts[half:], params[half:])]
    outputs = [[t for r in first + list(first_stream) for t in r.token_ids]]
    for rid in ids[1:]:
        outputs.append([t for r in executor.stream(rid, timeout_s=timeout_s) for t in r.token_ids])
    return outputs
