"""Test factories shared by the builder and runtime tests: tiny random-weight checkpoints, packed engine
inputs with a simple, deterministic block allocation, and the runtime's configs, manifests, requests,
KV-cache managers and schedulers on tiny limits."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from kilnlm.runtime.abi import EngineInputs, pack_sequences
from kilnlm.runtime.kv_cache import KVCacheConfig, KVCacheManager
from kilnlm.runtime.manifest import BuildConfig, GenerationDefaults, Manifest, ModelConfig
from kilnlm.runtime.request import Request, SamplingParams
from kilnlm.runtime.scheduler import BatchSchedulerPolicy, Scheduler, SchedulerConfig

# The question the end-to-end checks ask SmolLM2 (chat template, greedy), expecting "Paris" in the answer.
# SmolLM2's fp32 model starts its answer with "The" 0.93 nats ahead of the next candidate ("L"); for the more
# common "What is the capital of France?" the lead is 0.08 nats, so any rounding may answer in French
# (docs/quantization.md, "Factual probes").
CAPITAL_QUESTION = "Name the capital city of France."

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
)


def build_config(**overrides) -> BuildConfig:
    """A small CPU build config (fp32, max_batch_size 4, max_num_tokens 32, max_seq_len 128,
    tokens_per_block 4); keyword arguments override its fields."""
    params = dict(qformat="fp32", dtype="float32", kv_cache_dtype="float32", max_batch_size=4, max_num_tokens=32,
                  max_seq_len=128, tokens_per_block=4, target="cpu")
    params.update(overrides)
    return BuildConfig(**params)


def tiny_model_config(vocab_size: int = 49152) -> ModelConfig:
    """A 1-layer Llama config (hidden 8, 2 heads, 1 KV head, head_dim 4) for engine stand-ins."""
    return ModelConfig("LlamaForCausalLM", 1, 8, 16, 2, 1, 4, vocab_size, 4096, 10000.0, 1e-5, True)


def make_manifest(build: BuildConfig | None = None, model: ModelConfig | None = None,
                  eos_token_ids: tuple[int, ...] = (2,), **fields) -> Manifest:
    """A manifest of ``build`` (default :func:`build_config`) and ``model`` (default
    :func:`tiny_model_config`); ``fields`` override the Manifest's other fields (plugins, toolchain, ...)."""
    params = dict(model=model or tiny_model_config(), build=build or build_config(),
                  generation=GenerationDefaults(list(eos_token_ids), bos_token_id=1, pad_token_id=eos_token_ids[0]),
                  plugins={}, toolchain={}, source_checkpoint_digest="sha256:test")
    params.update(fields)
    return Manifest(**params)


def prompt_token_ids(request_id: int, num_tokens: int) -> list[int]:
    """Distinct, deterministic prompt tokens of one request (no prefix shared with another request id)."""
    return [(request_id * 1000 + i) % 50000 for i in range(num_tokens)]


def make_request(request_id: int, token_ids: list[int] | None = None, *, num_prompt_tokens: int = 8,
                 max_tokens: int = 8, end_ids: frozenset[int] = frozenset(), **sampling) -> Request:
    """A request as ``Executor.submit`` makes it: prompt ``token_ids`` (default
    :func:`prompt_token_ids` of ``num_prompt_tokens``), ``SamplingParams(max_tokens=max_tokens, **sampling)``,
    no end ids unless given, ``max_num_tokens`` = prompt + ``max_tokens``."""
    prompt = list(token_ids) if token_ids is not None else prompt_token_ids(request_id, num_prompt_tokens)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling), end_ids=end_ids,
                   max_num_tokens=len(prompt) + max_tokens)


def make_kv_cache_manager(num_blocks: int = 16, tokens_per_block: int = 4, enable_kv_cache_reuse: bool = False) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks, tokens_per_block, enable_kv_cache_reuse))


def make_scheduler(num_blocks: int = 16, tokens_per_block: int = 4, max_batch_size: int = 4, max_num_tokens: int = 8,
                   enable_kv_cache_reuse: bool = False, policy: str = "max_utilization",
                   enable_chunked_context: bool = True) -> Scheduler:
    """A scheduler over its own :func:`make_kv_cache_manager` (``scheduler.kv_cache``); ``policy`` is a
    ``batch_scheduler_policy`` name."""
    kv_cache = make_kv_cache_manager(num_blocks, tokens_per_block, enable_kv_cache_reuse)
    config = SchedulerConfig(max_batch_size, max_num_tokens, BatchSchedulerPolicy.from_name(policy), enable_chunked_context)
    return Scheduler(config, kv_cache)


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


def truncate_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int) -> Path:
    """Write the first ``num_layers`` decoder layers of the HF checkpoint ``src_dir`` (its real weights, every
    other tensor and file as they are, ``num_hidden_layers`` set) to ``out_dir``: the real model's shapes and
    weight statistics at a fraction of its compile time."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and ".safetensors" not in path.name and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((src / "config.json").read_text())
    assert num_layers <= config["num_hidden_layers"], (num_layers, config["num_hidden_layers"])
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                kept[name] = tensor
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


# What the batch-invariant kernel paths need (/proc/cpuinfo flag names), and why, for the tests' skip reasons.
BATCH_INVARIANT_CPU_FLAGS = ("avx512_bf16", "avx512vbmi")
BATCH_INVARIANT_SKIP_REASON = ("without KILNLM_BATCH_INVARIANT=1 the linear kernels sum each row in one order at every token "
                               "count only with AVX512-BF16 and AVX512-VBMI (VDPBF16PS on both the GEMV and the tiles); "
                               "docs/reliability.md")


def cpu_has(*flags: str) -> bool:
    """Whether this CPU reports every one of ``flags`` in /proc/cpuinfo (and KILNLM_CPU_ISA does not cap the
    kernels below AVX-512, or below AMX for AMX flags)."""
    cap = os.environ.get("KILNLM_CPU_ISA", "").lower()
    if cap in ("generic", "avx2") or (cap in ("avx512", "avx512bf16") and any(f.startswith("amx") for f in flags)):
        return False
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            reported = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return set(flags) <= set(reported)


def random_linear_ops(out_features: int, in_features: int, group_size: int, gen: torch.Generator) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Random weights of one layer in every kilnlm linear op's format (the ops loaded): ``({name: fn(x) -> y},
    weight, bias)``, ``weight [out_features, in_features]`` float32 (``gemm`` takes it in x's dtype), ``bias
    [out_features]`` float32; int4 with ``group_size``, symmetric and with zero points."""
    from kilnlm.plugins.reference import pack_int4

    ops = torch.ops.kilnlm
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    row_scale = w.abs().amax(1) / 448
    fp8 = (w / row_scale[:, None]).to(torch.float8_e4m3fn)
    i8 = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    i8_scale = torch.rand(out_features, generator=gen) * 0.01
    i4 = pack_int4(torch.randint(-8, 8, (out_features, in_features), generator=gen))
    i4_scale = torch.rand(out_features, in_features // group_size, generator=gen) * 0.02 + 1e-3
    i4_zero = torch.randint(-8, 8, (out_features, in_features // group_size), generator=gen, dtype=torch.int8)
    pqs = torch.rand(in_features, generator=gen) + 0.5
    bias = torch.randn(out_features, generator=gen)
    linears = {
        "gemm": lambda x: ops.gemm(x, w.to(x.dtype), bias.to(x.dtype)),
        "fp8_linear": lambda x: ops.fp8_linear(x, fp8, row_scale, torch.tensor(0.5), bias),
        "fp8_rowwise_linear": lambda x: ops.fp8_rowwise_linear(x, fp8, row_scale, bias),
        "int8_linear": lambda x: ops.int8_linear(x, i8, i8_scale, bias),
        "int8_sq_linear": lambda x: ops.int8_sq_linear(x, i8, i8_scale, torch.tensor(0.05), pqs, bias, True),
        "int4_linear": lambda x: ops.int4_linear(x, i4, i4_scale, pqs, bias, group_size),
        "int4_linear zero points": lambda x: ops.int4_linear(x, i4, i4_scale, None, None, group_size, i4_zero),
    }
    return linears, w, bias


def random_fp8_weight(out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """A random ``[out_features, in_features] float8_e4m3fn`` weight spread over E4M3's whole range,
    subnormals included (one random power-of-two scale per call)."""
    w = torch.randn(out_features, in_features, generator=gen) * torch.exp2(torch.randint(-10, 8, (1,), generator=gen))
    return w.clamp(-448, 448).to(torch.float8_e4m3fn)


def make_engine_inputs(seqs: list[tuple[list[int], int]], tokens_per_block: int, max_blocks_per_seq: int) -> EngineInputs:
    """Pack sequences into one :class:`EngineInputs` (:func:`kilnlm.runtime.abi.pack_sequences`).

    ``seqs``: per sequence ``(new_token_ids, num_cached)`` -- the new tokens sit at positions
    ``num_cached .. num_cached + len(new) - 1``. Sequence b owns physical blocks
    ``b * max_blocks_per_seq + j`` (so a pool of ``len(seqs) * max_blocks_per_seq`` blocks suffices and
    a sequence keeps its blocks from step to step as long as it keeps its index b). Logits come back for
    each sequence's last new token."""
    return pack_sequences([(new_ids, num_cached, range(b * max_blocks_per_seq, (b + 1) * max_blocks_per_seq))
                           for b, (new_ids, num_cached) in enumerate(seqs)], tokens_per_block, max_blocks_per_seq)


def greedy_generate(engine, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int],
                    num_blocks: int | None = None) -> list[int]:
    """Minimal greedy decoding through ``engine`` (a :class:`kilnlm.runtime.engine.Engine`): one context
    step over the whole prompt, then one generation step per token, all through the paged KV cache of
    ``num_blocks`` blocks (default: one sequence's most). Returns the generated token ids (without the
    prompt), stopping after an EOS id."""
    build = engine.manifest.build
    kv_cache = engine.allocate_kv_cache(num_blocks or build.max_blocks_per_seq)
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


def reference_penalised(logits: torch.Tensor, token_ids: list[list[int]], num_prompt_tokens: list[int],
                        params: list) -> torch.Tensor:
    """The penalties as plain per-token loops (the oracle of :mod:`kilnlm.runtime.sampler`): row b of
    ``logits [B, vocab]`` (a copy is returned) gets CTRL's repetition penalty over every token of
    ``token_ids[b]`` (prompt + generated: a positive logit divided by it, a negative one multiplied), then
    OpenAI's presence / frequency penalties over its generated tokens (``token_ids[b][num_prompt_tokens[b]:]``);
    ``params[b]``: its ``SamplingParams``."""
    out = logits.clone()
    for row, (tokens, num_prompt, p) in enumerate(zip(token_ids, num_prompt_tokens, params)):
        for token in set(tokens):
            x = float(out[row, token])
            out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        generated = tokens[num_prompt:]
        for token in set(generated):
            out[row, token] -= p.presence_penalty + p.frequency_penalty * generated.count(token)
    return out


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
