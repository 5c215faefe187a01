"""Quantization quality on the real model: SmolLM2-135M perplexity of each format relative to the fp32
engine, through the engines themselves (:mod:`kilnlm.runtime.perplexity`, what ``kilnlm eval`` runs).

Held-out text: the first ``NUM_TOKENS`` tokens of Debian's GPL-3 licence text
(``/usr/share/common-licenses/GPL-3``, ~7,650 SmolLM2 tokens in all), never the calibration text
(the builder's default: kilnlm's general English text and ``pydoc_data.topics``). Windows of
``CONTEXT_LEN`` tokens every ``STRIDE`` tokens.

Bounds (issue 3, item 9), perplexity relative to fp32 on the same tokens and windows: fp8 <= +3%,
int8_sq <= +5%, int8_wo <= +2%, int4_awq <= +12%, and int4_awq below int4_wo. The 8-bit KV caches
(fp8 / int8 pool with calibrated per-layer scales) are measured on the fp8-weight engine against the same
engine with a bfloat16 KV cache; bound: <= +4% (KV_CACHE_BOUND, kilnlm's own: issue 3 sets none).
Measured on SmolLM2: int8 KV +1.0% (AMD Zen 2, AVX2); fp8 KV +2.5% there, and on an Intel Xeon with
AVX-512 +3.2% through the AVX-512 kernels but +2.1% with the same two engines on the AVX2 kernels
(``KILNLM_CPU_ISA=avx2``): the fp8 engine's perplexity moves by ~0.5% with the kernels' arithmetic alone,
both ways. 4% leaves room for that without hiding a broken scale (which costs tens of percent). Each engine is built once per
session (the ``smollm2_format_engine`` factory in tests/conftest.py).

Factual recall (``FACT_PROBES``): perplexity on licence text does not show whether a quantized model still
recalls facts. Each 8-bit format must keep the answer of six one-line factual questions its most likely
next token (probability above 1/2), as fp32 does. int8_sq calibrated on the language reference alone
failed four of them (e.g. " Paris" at log-probability -2.28 after "The capital of France is").
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kilnlm.runtime.perplexity import PerplexityConfig, PerplexityResult, evaluate_perplexity, plan_windows

pytestmark = [pytest.mark.e2e]

HELD_OUT_TEXT = Path("/usr/share/common-licenses/GPL-3")
NUM_TOKENS = 3072
CONTEXT_LEN = 512
STRIDE = 384  # 8 windows: ~4,100 tokens through each engine
EVAL = PerplexityConfig(context_len=CONTEXT_LEN, stride=STRIDE, max_tokens=NUM_TOKENS)

# qformat -> largest allowed perplexity / fp32 perplexity
FORMAT_BOUNDS = {"fp8": 1.03, "int8_sq": 1.05, "int8_wo": 1.02, "int4_awq": 1.12}
KV_CACHE_BOUND = 1.04
KV_CACHE_BASE_QFORMAT = "fp8"


@pytest.fixture(scope="module")
def held_out_ids(smollm2_hf_dir) -> list[int]:
    from kilnlm.runtime.tokenizer import Tokenizer

    if not HELD_OUT_TEXT.is_file():
        pytest.skip(f"held-out evaluation text {HELD_OUT_TEXT} is missing (Debian's base-files ships it)")
    ids = Tokenizer.from_dir(smollm2_hf_dir).encode(HELD_OUT_TEXT.read_text(encoding="utf-8"))
    assert len(ids) >= NUM_TOKENS
    return ids[:NUM_TOKENS]


@pytest.fixture(scope="module")
def perplexity(smollm2_format_engine, held_out_ids):
    """``perplexity(qformat, kv_cache_dtype="auto", **options) -> PerplexityResult``, each engine evaluated
    once (``options``: further build options, e.g. int8_sq's per_token)."""
    from kilnlm.runtime.engine import Engine

    results: dict[tuple, PerplexityResult] = {}

    def get(qformat: str, kv_cache_dtype: str = "auto", **options) -> PerplexityResult:
        key = (qformat, kv_cache_dtype, *sorted(options.items()))
        if key not in results:
            engine = Engine.load(smollm2_format_engine(qformat, kv_cache_dtype, **options))
            results[key] = evaluate_perplexity(engine, held_out_ids, EVAL)
            r = results[key]
            print(f"\n[quality] {qformat:<9} kv {kv_cache_dtype:<5} perplexity {r.perplexity:.4f} over {r.tokens} tokens "
                  f"({r.seconds:.1f} s, {r.tokens_per_s:.0f} tokens/s through the engine)")
        return results[key]

    return get


def test_fp32_engine_perplexity_matches_transformers(perplexity, smollm2_engine_fp32_dir, smollm2_hf_dir, held_out_ids):
    """The baseline itself: the fp32 engine's perplexity equals transformers' fp32 on the same windows
    (the first 1,024 tokens, so the reference stays cheap), within 1e-3 relative."""
    from transformers import AutoModelForCausalLM

    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.perplexity import token_nlls

    assert math.isfinite(perplexity("fp32").perplexity)
    ids = held_out_ids[:1024]
    nlls, _ = token_nlls(Engine.load(smollm2_engine_fp32_dir), ids, EVAL)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    expected = torch.empty(len(ids) - 1, dtype=torch.float64)
    t = torch.tensor(ids)
    for w in plan_windows(len(ids), CONTEXT_LEN, STRIDE):
        with torch.no_grad():
            log_probs = torch.log_softmax(model(t[w.begin:w.end].unsqueeze(0)).logits[0].float(), dim=-1)
        rows = torch.arange(w.score_from - 1, w.end - 1) - w.begin
        expected[w.score_from - 1:w.end - 1] = -log_probs[rows, t[w.score_from:w.end]].double()
    assert math.isclose(math.exp(nlls.mean()), math.exp(expected.mean()), rel_tol=1e-3)


# Formats that miss issue 3's bound (format -> the measured miss, as the xfail reason). Strict: a format that
# starts meeting its bound fails here until its marker is removed. None today: int4_awq met its bound once
# it rounded with zero points (measured 2026-11-22: +10.76% with 16 calibration samples; ModelOpt's
# symmetric rounding +24.5%, its simulation +20% to +22% with every AWQ variant tried; docs/quantization.md).
KNOWN_MISSES: dict[str, str] = {}


@pytest.mark.parametrize("qformat", [
    pytest.param(q, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[q])) if q in KNOWN_MISSES else q
    for q in FORMAT_BOUNDS
])
def test_format_perplexity_within_bound(perplexity, qformat):
    base, quant = perplexity("fp32"), perplexity(qformat)
    ratio = quant.perplexity / base.perplexity
    print(f"[quality] {qformat}: perplexity {quant.perplexity:.4f} = {ratio:.4f} x fp32 ({base.perplexity:.4f}); "
          f"bound {FORMAT_BOUNDS[qformat]:.2f}")
    assert ratio <= FORMAT_BOUNDS[qformat], (
        f"{qformat} perplexity {quant.perplexity:.4f} is {100 * (ratio - 1):+.2f}% over fp32 {base.perplexity:.4f}; "
        f"allowed {100 * (FORMAT_BOUNDS[qformat] - 1):+.0f}%")


def test_int8_sq_per_token_within_the_int8_sq_bound(perplexity):
    """int8_sq with TensorRT-LLM's recipe for outlier-heavy models (``--per-token --smoothquant-alpha 0.5``:
    dynamic per-token activation scales, half the activations' range migrated into the weights) meets
    int8_sq's bound too. Measured on SmolLM2: +1.58% (the per-tensor default with its searched alpha 0.9:
    +3.20%; docs/quantization.md)."""
    base = perplexity("fp32")
    sq = perplexity("int8_sq", per_token=True, smoothquant_alpha=0.5)
    ratio = sq.perplexity / base.perplexity
    print(f"[quality] int8_sq --per-token --smoothquant-alpha 0.5: perplexity {sq.perplexity:.4f} = {ratio:.4f} x fp32")
    assert ratio <= FORMAT_BOUNDS["int8_sq"], f"{100 * (ratio - 1):+.2f}% over fp32"


def test_int8_sq_quantized_lm_head_within_the_int8_sq_bound(perplexity):
    """int8_sq ``--quantize-lm-head`` (the LM head W8A8 too, its smoothing folded into the final norm;
    what takes int8_sq past issue 3's 1.6x decode target on CPU) keeps int8_sq's bound. Measured on
    SmolLM2: +4.16%, the same with the CLI's and the benchmark's engine limits (docs/quantization.md)."""
    base = perplexity("fp32")
    sq = perplexity("int8_sq", quantize_lm_head=True)
    ratio = sq.perplexity / base.perplexity
    print(f"[quality] int8_sq --quantize-lm-head: perplexity {sq.perplexity:.4f} = {ratio:.4f} x fp32")
    assert ratio <= FORMAT_BOUNDS["int8_sq"], f"{100 * (ratio - 1):+.2f}% over fp32"


# (question, answer prefix, answer's first token): fp32 gives each answer token a log-probability of -0.02 to
# -0.16. None of them appears in the bundled calibration text (tests/builder/test_calibration.py).
FACT_PROBES = [("What is the capital of France?", "The capital of France is", " Paris"),
               ("What is the capital of Japan?", "The capital of Japan is", " Tokyo"),
               ("What is the capital of Italy?", "The capital of Italy is", " Rome"),
               ("What is the capital of Germany?", "The capital of Germany is", " Berlin"),
               ("Who wrote Romeo and Juliet?", "Romeo and Juliet was written by", " William"),
               ("What is the chemical symbol for gold?", "The chemical symbol for gold is", " Au")]
FACT_QFORMATS = ("fp32", "fp8", "int8_sq", "int8_wo")


@pytest.mark.parametrize("qformat", FACT_QFORMATS)
def test_8bit_formats_keep_factual_answers_most_likely(smollm2_format_engine, qformat):
    """After the chat-templated question and the answer's prefix, the answer's first token has probability
    above 1/2 (so greedy decoding picks it) through the engine. Measured 2026-11-22, log-probabilities
    Paris / Tokyo / Rome / Berlin / William / Au: fp32 -0.05 / -0.07 / -0.16 / -0.04 / -0.04 / -0.02;
    int8_sq -0.16 / -0.22 / -0.27 / -0.11 / -0.43 / -0.08 (calibrated on the language reference alone,
    ModelOpt's simulation: -2.28 / -1.61 / -3.42 / -2.14 / -0.28 / -0.15). int4 formats are not held to
    it (int4_awq: Rome -1.97, Tokyo -0.81; docs/quantization.md)."""
    from kilnlm.runtime.engine import Engine
    from kilnlm.runtime.perplexity import PerplexityConfig, token_nlls
    from kilnlm.runtime.tokenizer import Tokenizer

    engine = Engine.load(smollm2_format_engine(qformat))
    tokenizer = Tokenizer.from_dir(engine.tokenizer_dir)
    log_probs = {}
    for question, prefix, answer in FACT_PROBES:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        ids = tokenizer.encode(prompt + prefix + answer)
        assert tokenizer.decode(ids[-1:]) == answer, "the answer must be one token"
        nlls, _ = token_nlls(engine, ids, PerplexityConfig(context_len=len(ids), stride=len(ids) - 1))
        log_probs[answer.strip()] = -float(nlls[-1])
    print(f"\n[quality] {qformat} factual answers' log-probabilities: "
          + " ".join(f"{a} {lp:.2f}" for a, lp in log_probs.items()))
    assert {a: lp for a, lp in log_probs.items() if lp <= math.log(0.5)} == {}


def test_int4_awq_better_than_int4_wo(perplexity):
    awq, rtn = perplexity("int4_awq"), perplexity("int4_wo")
    print(f"[quality] int4_awq {awq.perplexity:.4f} vs int4_wo {rtn.perplexity:.4f}")
    assert awq.perplexity < rtn.perplexity


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_8bit_kv_cache_perplexity_within_bound(perplexity, kv_cache_dtype):
    base, kv8 = perplexity(KV_CACHE_BASE_QFORMAT), perplexity(KV_CACHE_BASE_QFORMAT, kv_cache_dtype)
    ratio = kv8.perplexity / base.perplexity
    print(f"[quality] {KV_CACHE_BASE_QFORMAT} weights, {kv_cache_dtype} KV cache: perplexity {kv8.perplexity:.4f} = "
          f"{ratio:.4f} x the bfloat16 KV cache ({base.perplexity:.4f}); bound {KV_CACHE_BOUND:.2f}")
    assert ratio <= KV_CACHE_BOUND
