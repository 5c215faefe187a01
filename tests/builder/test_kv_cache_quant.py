"""``--kv-cache-dtype fp8 | int8``: calibration (ModelOpt's KV quantizers against exact forward hooks),
the scale rule, tiny engines with 8-bit pools against the same engine with a bfloat16 pool, the KV
budget (bytes per block halved, twice the blocks in the executor's kv_cache_bytes), refusals, and the
SmolLM2 answer with fp8 weights and an fp8 KV cache.

Tolerance of the tiny engines' logits (2 layers, random weights, bfloat16 activations) against the same
engine with a bfloat16 pool, as the relative RMS error ``std(logits - ref) / std(ref)``: K/V rounded to
E4M3 (3 mantissa bits) or int8 (per-tensor step amax / 127) moved it by 3-5% (fp8) and 1.2-1.8% (int8)
when measured; the bounds ``REL_RMS_BOUND`` are about twice that. A wrong scale (a factor 2 off
saturates half the range, a missing scale reads garbage) gives errors of order 100%.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from factories import CAPITAL_QUESTION, greedy_generate, make_engine_inputs

from kilnlm.plugins import PLUGIN_VERSIONS

TINY_LIMITS = dict(max_batch_size=4, max_seq_len=128, max_num_tokens=128, tokens_per_block=16)
REL_RMS_BOUND = {"fp8": 0.08, "int8": 0.04}
# a context chunk, a second prompt, and (below) three generation steps
PROMPTS = [[5, 17, 300, 41, 9, 2200, 77, 123, 4000, 11, 600, 31, 8, 95, 1000, 42, 7, 3, 250, 19],
           [60, 70, 80, 90, 100, 110, 120]]


@pytest.fixture(scope="module")
def tiny_kv_engines(tiny_llama_dir, tmp_path_factory):
    """Tiny bf16-weight engines with a bfloat16 ("auto"), fp8 and int8 KV cache, built once per module."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.config import BuildOptions

    root = tmp_path_factory.mktemp("kv_engines")
    dirs = {}
    for kv in ("auto", "fp8", "int8"):
        dirs[kv] = root / kv
        # a short calibration: the tiny model's KV range is reached within a few hundred tokens
        calib = {} if kv == "auto" else dict(calib_size=4, calib_max_seq_len=64)
        build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=dirs[kv], qformat="bf16", kv_cache_dtype=kv,
                                  **TINY_LIMITS, **calib))
    return dirs


def run_prompts(engine, steps: int = 3) -> list[torch.Tensor]:
    """Logits of a packed context step over PROMPTS, then ``steps`` generation steps feeding fixed tokens
    (the same for every engine, so that their logits stay comparable step by step)."""
    build = engine.manifest.build
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq
    kv_cache = engine.allocate_kv_cache(len(PROMPTS) * max_blocks)
    out = [engine.forward(make_engine_inputs([(p, 0) for p in PROMPTS], tpb, max_blocks), kv_cache)]
    lens = [len(p) for p in PROMPTS]
    for step in range(steps):
        next_ids = [1000 + 7 * step + b for b in range(len(PROMPTS))]
        out.append(engine.forward(make_engine_inputs([([t], n) for t, n in zip(next_ids, lens)], tpb, max_blocks), kv_cache))
        lens = [n + 1 for n in lens]
    return out


# ---- calibration and scale rule -------------------------------------------------------------------------

def test_modelopt_kv_amax_equals_post_rope_amax_from_hooks(tiny_llama_dir, monkeypatch):
    """ModelOpt's k/v_bmm_quantizer amax == max |K after RoPE| and max |V| per layer, computed exactly with
    hooks on transformers' apply_rotary_pos_emb and v_proj over the same batches."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.kv_quant import calibrate_kv_cache

    ck = load_checkpoint(tiny_llama_dir)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, ck.config.vocab_size, (1, 48), generator=gen) for _ in range(3)]
    amax = calibrate_kv_cache(ck, batches)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    k_amax, v_amax = [], []
    original = modeling_llama.apply_rotary_pos_emb

    def recording_rope(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = original(q, k, cos, sin, *args, **kwargs)
        k_amax.append(float(k_out.abs().max()))
        return q_out, k_out

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", recording_rope)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda mod, args, out: v_amax.append(float(out.abs().max())))
    with torch.no_grad():
        model(torch.cat(batches))
    assert len(amax) == ck.config.num_hidden_layers == len(k_amax) == len(v_amax)
    for i, a in enumerate(amax):
        assert a.k_amax == pytest.approx(k_amax[i], rel=1e-6), f"layer {i} K"
        assert a.v_amax == pytest.approx(v_amax[i], rel=1e-6), f"layer {i} V"


def test_scale_rule_and_unusable_amax():
    from kilnlm.builder.errors import BuildError
    from kilnlm.builder.kv_quant import KvAmax, kv_scales

    amax = [KvAmax(8.96, 2.54), KvAmax(4.48, 1.27)]
    fp8 = kv_scales(amax, "fp8")
    int8 = kv_scales(amax, "int8")
    torch.testing.assert_close(fp8[0], torch.tensor([8.96 / 448, 2.54 / 448]))
    torch.testing.assert_close(int8[1], torch.tensor([4.48 / 127, 1.27 / 127]))
    assert all(s.dtype == torch.float32 and s.shape == (2,) for s in fp8 + int8)
    for bad in (0.0, float("nan"), float("inf"), -1.0):
        with pytest.raises(BuildError, match="unusable amax"):
            kv_scales([KvAmax(1.0, bad)], "fp8")


def test_bad_kv_cache_dtype_refused_before_loading(tmp_path):
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.config import BuildOptions
    from kilnlm.builder.errors import BuildError

    for typo in ("fp16", "FP8", "float8", "bfloat16"):
        with pytest.raises(BuildError, match=r"--kv-cache-dtype .* choose one of auto, fp8, int8"):
            build_engine(BuildOptions(checkpoint=tmp_path / "missing", output=tmp_path / "out", kv_cache_dtype=typo))


def test_cli_lists_kv_cache_dtype_choices():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "kilnlm.cli", "build", "--checkpoint", "x", "--output", "y",
                             "--kv-cache-dtype", "fp16"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--kv-cache-dtype" in result.stderr and "choose from 'auto', 'fp8', 'int8'" in result.stderr


# ---- tiny engines --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_tiny_engine_logits_close_to_bf16_pool(tiny_kv_engines, kv):
    from kilnlm.runtime.engine import Engine

    base, quant = Engine.load(tiny_kv_engines["auto"]), Engine.load(tiny_kv_engines[kv])
    assert quant.manifest.build.kv_cache_dtype == kv and base.manifest.build.kv_cache_dtype == "bfloat16"
    assert quant.manifest.plugins["paged_attention"] == PLUGIN_VERSIONS["paged_attention"] >= 2  # kv_scale: version 2 on
    ref, out = run_prompts(base), run_prompts(quant)
    errors = [float((o - r).std() / r.std()) for r, o in zip(ref, out)]  # context step, 3 generation steps
    print(f"\n[kv {kv}] relative RMS logits error vs the bf16 pool per step: {', '.join(f'{e:.4f}' for e in errors)}")
    assert max(errors) <= REL_RMS_BOUND[kv]
    assert min(errors) > 0  # the 8-bit pool really is in use


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_kv_bytes_halved_and_executor_holds_twice_the_blocks(tiny_kv_engines, kv):
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.executor import Executor, ExecutorConfig
    from kilnlm.runtime.tokenizer import Tokenizer

    base, quant = Engine.load(tiny_kv_engines["auto"]), Engine.load(tiny_kv_engines[kv])
    assert quant.kv_cache_bytes_per_block() * 2 == base.kv_cache_bytes_per_block()
    assert quant.allocate_kv_cache(3).dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv]
    assert quant.dtype == torch.bfloat16  # activations unchanged
    budget = 40 * base.kv_cache_bytes_per_block()
    tokenizer = Tokenizer.from_dir(base.tokenizer_dir)
    blocks = {}
    for name, engine in (("auto", base), (kv, quant)):
        with Executor(engine, tokenizer, ExecutorConfig(kv_cache_bytes=budget)) as executor:
            blocks[name] = executor.kv_cache.shape[2]
            assert executor.kv_cache.nbytes == budget
            executor.generate(PROMPTS[0], timeout_s=120)  # the 8-bit pool serves a request end to end
    assert blocks[kv] == 2 * blocks["auto"] == 80


def test_wrong_pool_dtype_refused(tiny_kv_engines):
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.errors import EngineError

    engine = Engine.load(tiny_kv_engines["fp8"])
    build = engine.manifest.build
    inputs = make_engine_inputs([(PROMPTS[1], 0)], build.tokens_per_block, build.max_blocks_per_seq)
    bf16_pool = torch.zeros(engine.allocate_kv_cache(build.max_blocks_per_seq).shape, dtype=torch.bfloat16)
    with pytest.raises(EngineError, match="expects torch.float8_e4m3fn: use Engine.allocate_kv_cache"):
        engine.forward(inputs, bf16_pool)


def test_plugin_versions_accepted_and_refused(tiny_kv_engines, tmp_path):
    """An engine recording paged_attention version 1 (built before 8-bit pools: its calls have no
    kv_scale, which the v2 kernel defaults to None) or 2 (calls through the proxy executor, before the C
    shims) still verifies; an unknown version says rebuild."""
    import json

    from kilnlm.runtime.engine import verify_engine
    from kilnlm.runtime.errors import EngineError
    from kilnlm.runtime.manifest import read_manifest, write_manifest

    for version, ok in ((1, True), (2, True), (3, True), (4, False)):
        copy = tmp_path / f"v{version}"
        shutil.copytree(tiny_kv_engines["auto"], copy)
        manifest = read_manifest(copy)
        manifest.plugins["paged_attention"] = version
        write_manifest(copy, manifest)
        assert json.loads((copy / "manifest.json").read_text())["plugins"]["paged_attention"] == version
        if ok:
            verify_engine(copy)
        else:
            with pytest.raises(EngineError, match="rebuild the engine"):
                verify_engine(copy)


# ---- SmolLM2 -------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_smollm2_fp8_weights_fp8_kv_answers_paris(smollm2_format_engine):
    from transformers import AutoTokenizer

    from kilnlm.runtime.engine import Engine

    engine = Engine.load(smollm2_format_engine("fp8", "fp8"))
    assert engine.manifest.build.kv_cache_dtype == "fp8" and engine.kv_cache_dtype == torch.float8_e4m3fn
    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": CAPITAL_QUESTION}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    generated = greedy_generate(engine, prompt, 24, engine.manifest.generation.eos_token_ids)
    assert "Paris" in tokenizer.decode(generated)
