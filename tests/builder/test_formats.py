"""Every format of the registry (:data:`kilnlm.builder.formats.FORMATS`) built from the tiny random Llama:
engine numerics against the same network on the reference ops and against the fp32 engine; then the
integer formats' packed sizes, determinism, the exported unified checkpoint, and refusals through the CLI.
A format added to the registry is built and checked here; a format whose kernel is missing fails.

The tiny engines here run float32 activations (``--dtype float32``, which every quantized op accepts)
wherever the format allows it, so that the engine-vs-reference comparison is tight: with bfloat16
activations the two paths' roundings differ by a few bf16 steps per layer and would hide a real layout bug
of the same size. The default bfloat16 path is covered by the bf16 format here, the SmolLM2 tests and the
quality tests (tests/builder/test_quality.py).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from factories import make_engine_inputs, make_tiny_checkpoint

from kilnlm.builder.config import BuildOptions
from kilnlm.builder.formats import FORMATS, Quantization, format_names
from kilnlm.builder.network.llama import DOWN_PROJ, GATE_UP_PROJS, O_PROJ, QKV_PROJS
from kilnlm.cli.main import main
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.runtime.abi import kv_cache_shape

QUANTIZED = format_names(lambda f: f.quantization is not Quantization.NONE)
TINY_LIMITS = dict(max_batch_size=8, max_seq_len=256, max_num_tokens=256, tokens_per_block=16)
PROMPTS = [[1, 9519, 28, 314, 1345, 42, 7, 11], [500, 600, 700], list(range(1000, 1041)), [77]]
# Engine (C++ kernels, AOTInductor) vs the eager network on the reference ops, float32 activations: both
# accumulate in float32 over the same packed integers and scales; only summation order differs.
REF_ATOL = 2e-3
# bfloat16 activations (bf16, whose dtype is fixed): the engine's and the eager network's roundings of the
# activations differ by a few bf16 steps per layer.
REF_ATOL_BF16 = 5e-2
# Engine vs the fp32 engine: the error of the quantization itself, on random N(0, 0.08) weights, which
# have no outlier structure for AWQ / SmoothQuant to exploit and are the worst case for round-to-nearest:
# int4 (group 32) moves each weight by ~9% of its standard deviation, int8 by ~0.5%; int8_sq also rounds
# every activation to 8 bits with one per-tensor scale, and AWQ / SmoothQuant calibrate on 4 x 64 tokens
# only. Bound: the relative RMS error of each logits row, ||engine - fp32|| / ||fp32||, about 1.3x the
# measured worst row (int4_awq 0.37, int4_wo < 0.35, int8_wo < 0.03, int8_sq 0.29; int8_sq was 0.19 with the
# language reference's 4 calibration windows, 0.29 with two of them replaced by the general text's: its one
# per-tensor activation scale per linear depends on which 256 tokens it saw). Real-model quality is
# measured as perplexity on SmolLM2 (tests/builder/test_quality.py).
# fp8: E4M3's 3 mantissa bits on weights and activations (measured worst row 0.108); fp8_rowwise: the same
# 3 bits with per-channel / per-token scales (measured worst row 0.129 with float32 activations, 0.118 with
# bfloat16 ones; E4M3's relative step does not depend on the scale, only which values fall to subnormals).
FP32_REL_ERR = {"fp8": 0.14, "fp8_rowwise": 0.17, "int4_awq": 0.5, "int4_wo": 0.45, "int8_wo": 0.04, "int8_sq": 0.38}


def format_options(qformat: str, **extra) -> dict:
    """Build options of a small, fast tiny-Llama engine in ``qformat``: float32 activations unless the format
    fixes its dtype, group size 32 (hidden size 64) for group-wise formats, 4 x 64 calibration tokens."""
    fmt = FORMATS[qformat]
    opts = dict(TINY_LIMITS, qformat=qformat, dtype=fmt.activation_dtype if fmt.fixed_dtype else "float32")
    if fmt.group_wise:
        opts["group_size"] = 32
    searches = fmt.searches_precision(extra.get("auto_quantize_bits", fmt.auto_quantize_bits))
    if fmt.calibrated or searches:  # the mixed-precision search reads calibration text too
        opts.update(calib_size=4, calib_max_seq_len=64)
    opts.update(extra)
    return opts


def require_kernel(qformat: str) -> None:
    """Fail (never skip) when the format's linear op has no CPU kernel: its engines could not run."""
    import kilnlm.plugins as plugins

    plugins.load_cpu_kernels()
    for op in filter(None, ["gemm", FORMATS[qformat].linear_plugin]):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kilnlm::{op}", "CPU"), \
            f"kilnlm::{op} ({qformat}'s linear op) has no CPU kernel in plugins/csrc"


@pytest.fixture(scope="module")
def int_engine(tiny_llama_dir, tmp_path_factory):
    """``int_engine(qformat) -> Path``: one tiny engine per format (float32 activations where the format
    allows them), built on first use."""
    from kilnlm.builder.build import build_engine

    built: dict[str, Path] = {}

    def get(qformat: str) -> Path:
        require_kernel(qformat)
        if qformat not in built:
            out = tmp_path_factory.mktemp("int_engines") / qformat
            build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=out, **format_options(qformat)))
            built[qformat] = out
        return built[qformat]

    return get


def eager_network(checkpoint: Path, **options):
    """The builder's eager network (quantization included) for build ``options``."""
    from kilnlm.builder.build import build_network
    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.config import resolve
    from kilnlm.builder.network.llama import model_config_from_hf

    import kilnlm.plugins as plugins

    plugins.load_cpu_kernels()  # paged_attention runs its C++ kernel in eager mode too
    opts = resolve(BuildOptions(checkpoint=checkpoint, output=checkpoint / "unused", **options))
    ck = load_checkpoint(checkpoint)
    return build_network(opts, ck, model_config_from_hf(ck.config)).eval()


def use_reference_ops(network: torch.nn.Module) -> None:
    """Route every linear of ``network`` through the plain-torch reference of its op."""
    from kilnlm.builder.network.layers import Fp8Linear, Fp8RowwiseLinear, Int4Linear, Int8Linear, Int8SqLinear, Linear
    from kilnlm.plugins import reference as ref

    for m in network.modules():
        if isinstance(m, Linear):
            m.forward = lambda x, m=m: ref.gemm_reference(x, m.weight, m.bias)
        elif isinstance(m, Fp8Linear):
            m.forward = lambda x, m=m: ref.fp8_linear_reference(x, m.weight, m.weight_scale, m.input_scale, m.bias)
        elif isinstance(m, Fp8RowwiseLinear):
            m.forward = lambda x, m=m: ref.fp8_rowwise_linear_reference(x, m.weight, m.weight_scale, m.bias)
        elif isinstance(m, Int4Linear):
            m.forward = lambda x, m=m: ref.int4_linear_reference(x, m.weight, m.weight_scale, m.pre_quant_scale, m.bias,
                                                                 m.group_size, m.zero_point)
        elif isinstance(m, Int8Linear):
            m.forward = lambda x, m=m: ref.int8_linear_reference(x, m.weight, m.weight_scale, m.bias)
        elif isinstance(m, Int8SqLinear):
            m.forward = lambda x, m=m: ref.int8_sq_linear_reference(x, m.weight, m.weight_scale, m.input_scale,
                                                                   m.pre_quant_scale, m.bias, m.per_token)


def engine_logits(engine_dir: Path) -> torch.Tensor:
    """Last-token logits ``[len(PROMPTS), vocab] float32`` of one packed context batch."""
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(engine_dir)
    build = engine.manifest.build
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], build.tokens_per_block, build.max_blocks_per_seq)
    return engine.forward(inputs, engine.allocate_kv_cache(len(PROMPTS) * build.max_blocks_per_seq))


def reference_logits(network, manifest) -> torch.Tensor:
    """The eager ``network`` on the plain-torch reference ops, fed the PROMPTS batch the engine gets in
    :func:`engine_logits` (float32 KV cache of the engine's shape)."""
    use_reference_ops(network)
    build, m = manifest.build, manifest.model
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], build.tokens_per_block, build.max_blocks_per_seq)
    kv_cache = torch.zeros(kv_cache_shape(m.num_layers, len(PROMPTS) * build.max_blocks_per_seq, build.tokens_per_block,
                                          m.num_kv_heads, m.head_dim), dtype=getattr(torch, build.kv_cache_dtype))
    with torch.no_grad():
        return network(*inputs.as_args(kv_cache))


@pytest.mark.parametrize("qformat", tuple(FORMATS))
def test_engine_matches_the_network_on_reference_ops(int_engine, tiny_llama_dir, qformat):
    """The registry walk: every format builds a tiny engine that calls the format's linear op and equals the
    eager network with every linear on its op's reference."""
    engine_dir = int_engine(qformat)
    from kilnlm.runtime.manifest import read_manifest

    manifest = read_manifest(engine_dir)
    assert manifest.build.qformat == qformat and manifest.build.target == "cpu"
    ops = ("paged_attention", "gemm", *filter(None, [FORMATS[qformat].linear_plugin]))
    assert manifest.plugins == {name: PLUGIN_VERSIONS[name] for name in ops}
    logits = engine_logits(engine_dir)

    network = eager_network(tiny_llama_dir, **format_options(qformat))
    atol = REF_ATOL if manifest.build.dtype == "float32" else REF_ATOL_BF16
    torch.testing.assert_close(logits, reference_logits(network, manifest), atol=atol, rtol=0)


@pytest.mark.parametrize("qformat", QUANTIZED)
def test_engine_stays_close_to_the_fp32_engine(int_engine, tiny_engine_dir, qformat):
    logits = engine_logits(int_engine(qformat))
    fp32 = engine_logits(tiny_engine_dir)
    rel_err = (logits - fp32).norm(dim=-1) / fp32.norm(dim=-1)
    assert float(rel_err.max()) < FP32_REL_ERR[qformat], rel_err


@pytest.mark.parametrize("per_token", [True, False])
def test_int8_sq_engine_matches_the_network_on_reference_ops(tiny_llama_dir, tiny_engine_dir, tmp_path, per_token):
    """int8_sq with dynamic per-token activation scales (the default, alpha 0.5) and with one calibrated
    scale per activation tensor (``--no-per-token``, alpha searched): every int8_sq_linear call of the engine carries the
    choice (the engine equals the eager network on the reference), and it stays within int8_sq's error
    bound of the fp32 engine."""
    from kilnlm.builder.build import build_engine
    from kilnlm.runtime.manifest import read_manifest

    require_kernel("int8_sq")
    options = format_options("int8_sq", per_token=per_token)
    engine_dir = tmp_path / "engine"
    build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=engine_dir, **options))
    manifest = read_manifest(engine_dir)
    assert manifest.plugins["int8_sq_linear"] == PLUGIN_VERSIONS["int8_sq_linear"] == 3
    logits = engine_logits(engine_dir)

    network = eager_network(tiny_llama_dir, **options)
    from kilnlm.builder.network.layers import Int8SqLinear

    sq_linears = [m for m in network.modules() if isinstance(m, Int8SqLinear)]
    assert sq_linears and all(m.per_token is per_token for m in sq_linears)
    torch.testing.assert_close(logits, reference_logits(network, manifest), atol=REF_ATOL, rtol=0)
    fp32 = engine_logits(tiny_engine_dir)
    assert float(((logits - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max()) < FP32_REL_ERR["int8_sq"]


@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero-point"])
def test_int4_linears_take_under_0_3x_their_bf16_bytes(smollm2_hf_dir, tmp_path, zero_point):
    """int4_wo network of a tiny Llama wide enough for group size 128: every quantized linear's buffers
    (packed weight, scales, pre_quant_scale, zero points) against 2 bytes per weight; embedding / LM head
    stay bf16."""
    from kilnlm.builder.network.layers import Int4Linear

    ckpt = make_tiny_checkpoint(tmp_path / "wide", smollm2_hf_dir, "llama", hidden_size=128, intermediate_size=256,
                                head_dim=32)
    network = eager_network(ckpt, qformat="int4_wo", dtype="bfloat16", group_size=128, zero_point=zero_point)
    linears = [m for m in network.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 2 * 4  # per layer: qkv, o_proj, gate_up, down
    for m in linears:
        out_features, in_features = m.weight.shape[0], m.weight.shape[1] * 2
        packed_bytes = sum(b.numel() * b.element_size() for b in m.buffers())
        assert packed_bytes <= 0.3 * 2 * out_features * in_features, (packed_bytes, out_features, in_features)
        assert m.weight.dtype == torch.uint8 and m.weight_scale.dtype == torch.float16
        assert (m.zero_point is not None) == zero_point
    assert network.lm_head_weight.dtype == torch.bfloat16  # tied embedding / LM head: 16-bit


def test_int4_scales_are_stored_in_float16_only_where_they_fit():
    """float16 when every scale is 0 or a normal float16 (then within 2^-11 relative of the float32 scale),
    float32 as given otherwise: one scale below 2^-14 or above 65504 keeps the whole tensor float32."""
    from kilnlm.builder.network.layers import int4_engine_scales

    scales = torch.tensor([[0.0, 2.0**-14, 0.0123456], [1.0, 65504.0, 3.3e-3]])
    stored = int4_engine_scales(scales)
    assert stored.dtype == torch.float16
    assert ((stored.float() - scales).abs() <= 2.0**-11 * scales.abs()).all()
    for outlier in (2.0**-15, 65536.0, -1e-6, float("inf")):
        scales_out = scales.clone()
        scales_out[1, 2] = outlier
        stored = int4_engine_scales(scales_out)
        assert stored.dtype == torch.float32 and torch.equal(stored, scales_out)


@pytest.mark.parametrize("qformat,extra", [("int4_awq", {}), ("int8_sq", {}), ("int8_sq", {"per_token": False})],
                         ids=["int4_awq", "int8_sq", "int8_sq-per-tensor"])
def test_calibration_is_deterministic(tiny_llama_dir, qformat, extra):
    """Two quantizations of the same inputs give bit-identical weights, scales and folded norms.

    Compared on the network's buffers rather than on model.pt2: AOTInductor's package is not
    byte-reproducible (measured: two builds of the same network differ in ``.data/serialization_id``, a
    random id, and in a compile-command comment inductor appends to the generated C++ only when it
    compiled it rather than reusing its cache); its compiled code and weights are identical."""
    first = eager_network(tiny_llama_dir, **format_options(qformat, **extra)).state_dict()
    second = eager_network(tiny_llama_dir, **format_options(qformat, **extra)).state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_quantized_lm_head(tiny_llama_dir):
    """--quantize-lm-head (int8_wo): the LM head is an int8 linear and the tied embedding keeps a float copy
    of its own (``--dtype``, float32 here); the logits move by about int8's rounding error only."""
    from kilnlm.builder.network.layers import Int8Linear

    network = eager_network(tiny_llama_dir, **format_options("int8_wo", quantize_lm_head=True))
    assert isinstance(network.lm_head, Int8Linear) and network.lm_head.weight.shape == (49152, 64)
    assert network.embed_tokens.dtype == torch.float32 and network.lm_head_weight is None
    use_reference_ops(network)
    plain = eager_network(tiny_llama_dir, **format_options("int8_wo"))
    use_reference_ops(plain)
    inputs = make_engine_inputs([(PROMPTS[0], 0)], 16, 16)
    kv = torch.zeros(kv_cache_shape(2, 16, 16, 2, 16))
    with torch.no_grad():
        quantized_head, float_head = network(*inputs.as_args(kv.clone())), plain(*inputs.as_args(kv.clone()))
    assert float((quantized_head - float_head).norm() / float_head.norm()) < 0.03


def test_fp8_quantized_lm_head(tiny_llama_dir, tmp_path):
    """fp8 --quantize-lm-head: the tied LM head is an FP8 linear (one byte per weight, its own calibrated
    weight and input scales) beside a 16-bit embedding; the engine needs no kilnlm::gemm; the logits move by
    about E4M3's rounding only (measured on the tiny model: relative error 0.039; bound 0.05)."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.network.layers import Fp8Linear
    from kilnlm.runtime.manifest import read_manifest

    options = dict(TINY_LIMITS, qformat="fp8", calib_size=4, calib_max_seq_len=64, auto_quantize_bits=8)
    network = eager_network(tiny_llama_dir, **options, quantize_lm_head=True)
    assert isinstance(network.lm_head, Fp8Linear) and network.lm_head.weight.shape == (49152, 64)
    assert network.lm_head.weight.dtype == torch.float8_e4m3fn and float(network.lm_head.input_scale) > 0
    assert network.embed_tokens.dtype == torch.bfloat16 and network.lm_head_weight is None
    plain = eager_network(tiny_llama_dir, **options)
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], 16, 16)
    kv = torch.zeros(kv_cache_shape(2, len(PROMPTS) * 16, 16, 2, 16), dtype=torch.bfloat16)
    with torch.no_grad():
        quantized_head, float_head = network(*inputs.as_args(kv.clone())), plain(*inputs.as_args(kv.clone()))
    rel_err = (quantized_head - float_head).norm(dim=-1) / float_head.norm(dim=-1)
    print(f"\n[fp8 LM head] logits relative error {float(rel_err.max()):.4f}")
    assert float(rel_err.max()) < 0.05
    build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "engine", quantize_lm_head=True, **options))
    assert set(read_manifest(tmp_path / "engine").plugins) == {"paged_attention", "fp8_linear"}


def test_fp8_rowwise_scales_are_each_rows_amax(tiny_llama_dir):
    """fp8_rowwise from the weights alone: every decoder linear is an Fp8RowwiseLinear whose row o has scale
    ``max |w_o| / 448`` of the float weight (a fused QKV / gate-up's rows are its parts' rows, in order) and
    weights ``fp8(w / scale)``; an all-zero row gets scale 1."""
    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.network.layers import Fp8RowwiseLinear

    network = eager_network(tiny_llama_dir, **format_options("fp8_rowwise", auto_quantize_bits=8))
    state = load_checkpoint(tiny_llama_dir).state_dict
    layer = network.layers[1]
    p = "model.layers.1"
    for module, names in ((layer.attn.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                          (layer.attn.o_proj, ("self_attn.o_proj",)), (layer.mlp.gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                          (layer.mlp.down, ("mlp.down_proj",))):
        assert isinstance(module, Fp8RowwiseLinear)
        w = torch.cat([state[f"{p}.{n}.weight"].float() for n in names])
        scale = w.abs().amax(dim=1) / 448
        assert torch.equal(module.weight_scale, scale)
        assert torch.equal(module.weight.view(torch.uint8), (w / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    assert sum(isinstance(m, Fp8RowwiseLinear) for m in network.modules()) == 2 * 4 and network.lm_head is None
    quantized = Fp8RowwiseLinear.quantize(torch.cat([torch.zeros(1, 8), torch.full((1, 8), -3.0)]))
    assert torch.equal(quantized.weight_scale, torch.tensor([1.0, 3.0 / 448]))
    assert torch.equal(quantized.weight.float(), torch.tensor([[0.0] * 8, [-448.0] * 8]))


def test_fp8_rowwise_bfloat16_engine_with_quantized_lm_head(tiny_llama_dir, tiny_engine_dir, tmp_path, capsys):
    """``kilnlm build --qformat fp8 --use-fp8-rowwise --quantize-lm-head`` (TensorRT-LLM's spelling, default
    bfloat16 activations, no calibration text): the tied LM head is an FP8 rowwise linear beside a 16-bit
    embedding, the engine calls only paged_attention and fp8_rowwise_linear (through its C shim) and stays within fp8's error of
    the fp32 engine (measured 0.118). Not compared with the eager network here: inductor rounds the bfloat16
    norms and residuals at other points than eager mode, and a one-step change of a bfloat16 activation
    moves its row's FP8 rounding (measured: both 0.12-0.14 from fp32, 0.14 from each other); the float32
    registry walk above checks the engine against the reference ops."""
    from kilnlm.builder.network.layers import Fp8RowwiseLinear
    from kilnlm.runtime.manifest import read_manifest

    require_kernel("fp8_rowwise")
    engine_dir = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(engine_dir), "--quiet",
                            "--qformat", "fp8", "--use-fp8-rowwise", "--quantize-lm-head", "--auto-quantize-bits", "8",
                            "--max-seq-len", "256",
                            "--max-num-tokens", "256", "--max-batch-size", "8", "--tokens-per-block", "16")
    assert status == 0, err
    manifest = read_manifest(engine_dir)
    assert manifest.build.qformat == "fp8_rowwise" and manifest.build.dtype == "bfloat16"
    assert set(manifest.plugins) == {"paged_attention", "fp8_rowwise_linear"}
    with zipfile.ZipFile(engine_dir / "model.pt2") as package:  # every linear through the op's C shim
        (wrapper,) = [package.read(n).decode() for n in package.namelist() if n.endswith(".wrapper.cpp")]
    assert wrapper.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_fp8_rowwise_linear(") == 4 * 2 + 1  # + LM head
    assert "aoti_torch_proxy_executor_call_function(" not in wrapper
    network = eager_network(tiny_llama_dir, **dict(TINY_LIMITS, qformat="fp8_rowwise", quantize_lm_head=True,
                                                   auto_quantize_bits=8))
    assert isinstance(network.lm_head, Fp8RowwiseLinear) and network.lm_head.weight.shape == (49152, 64)
    assert network.embed_tokens.dtype == torch.bfloat16 and network.lm_head_weight is None
    logits = engine_logits(engine_dir)
    fp32 = engine_logits(tiny_engine_dir)
    assert float(((logits - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max()) < FP32_REL_ERR["fp8_rowwise"]


def test_int8_sq_quantized_lm_head(tiny_llama_dir, tiny_engine_dir, tmp_path):
    """int8_sq --no-per-token --quantize-lm-head: the (tied) LM head is a W8A8 int8_sq_linear with its own
    calibrated input scale, SmoothQuant's smoothing of its input folded into the final norm (no
    pre_quant_scale left); the engine needs no kilnlm::gemm, equals the eager network on the reference ops
    and stays within int8_sq's error bound of the fp32 engine. With per-token scales (the default) the head
    takes them too."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.network.layers import Int8SqLinear
    from kilnlm.runtime.manifest import read_manifest

    require_kernel("int8_sq")
    options = format_options("int8_sq", quantize_lm_head=True, per_token=False)
    network = eager_network(tiny_llama_dir, **options)
    head = network.lm_head
    assert isinstance(head, Int8SqLinear) and head.weight.shape == (49152, 64) and head.weight.dtype == torch.int8
    assert float(head.input_scale) > 0 and head.pre_quant_scale is None and not head.per_token
    assert network.embed_tokens.dtype == torch.float32 and network.lm_head_weight is None
    plain_norm = load_checkpoint(tiny_llama_dir).state_dict["model.norm.weight"]
    assert not torch.equal(network.norm.weight.float(), plain_norm.float())  # the head's smoothing, folded

    engine_dir = tmp_path / "engine"
    build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=engine_dir, **options))
    manifest = read_manifest(engine_dir)
    assert set(manifest.plugins) == {"paged_attention", "int8_sq_linear"}
    logits = engine_logits(engine_dir)
    torch.testing.assert_close(logits, reference_logits(network, manifest), atol=REF_ATOL, rtol=0)
    fp32 = engine_logits(tiny_engine_dir)
    assert float(((logits - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max()) < FP32_REL_ERR["int8_sq"]

    per_token = eager_network(tiny_llama_dir, **options | dict(per_token=True))
    assert isinstance(per_token.lm_head, Int8SqLinear) and per_token.lm_head.per_token


def test_int4_awq_quantized_lm_head_gets_zero_points(tiny_llama_dir):
    """--quantize-lm-head with int4_awq: the (tied) LM head is re-rounded with zero points from the
    embedding's weights and the final norm's folded AWQ scale, and the logits stay within int4_awq's error
    of the fp32 network."""
    from kilnlm.builder.network.layers import Int4Linear

    network = eager_network(tiny_llama_dir, **format_options("int4_awq", quantize_lm_head=True))
    assert isinstance(network.lm_head, Int4Linear) and network.lm_head.zero_point is not None
    use_reference_ops(network)
    reference = eager_network(tiny_llama_dir, **dict(TINY_LIMITS, qformat="fp32"))
    inputs = make_engine_inputs([(p, 0) for p in PROMPTS], 16, 16)
    kv = torch.zeros(kv_cache_shape(2, len(PROMPTS) * 16, 16, 2, 16))
    with torch.no_grad():
        logits, expected = network(*inputs.as_args(kv.clone())), reference(*inputs.as_args(kv.clone()))
    assert float(((logits - expected).norm(dim=-1) / expected.norm(dim=-1)).max()) < FP32_REL_ERR["int4_awq"]


def test_export_checkpoint_is_modelopts_unified_format(tiny_llama_dir, tmp_path, capsys):
    """`kilnlm build --export-checkpoint DIR` writes config.json with its quantization section,
    hf_quant_config.json and safetensors with packed weights and scales."""
    from safetensors import safe_open

    require_kernel("int4_awq")
    export = tmp_path / "export"
    status = main(["build", "--checkpoint", str(tiny_llama_dir), "--output", str(tmp_path / "engine"), "--quiet",
                   "--qformat", "int4_awq", "--group-size", "32", "--calib-size", "4", "--calib-max-seq-len", "64",
                   "--max-seq-len", "256", "--max-num-tokens", "256", "--export-checkpoint", str(export)])
    assert status == 0, capsys.readouterr().err
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "W4A16_AWQ"
    quant = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_AWQ" and quant["group_size"] == 32
    assert (export / "tokenizer.json").is_file()
    with safe_open(str(next(export.glob("*.safetensors"))), framework="pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        o_pre = f.get_tensor("model.layers.0.self_attn.o_proj.pre_quant_scale")
    assert q.dtype == torch.uint8 and q.shape == (64 // 2, 64)  # ModelOpt packs two output rows per byte
    assert scale.dtype == torch.float32 and scale.shape == (64, 64 // 32)
    assert o_pre.shape == (64,)
    # AWQ's q/k/v scale went into input_layernorm, so q/k/v carry none.
    assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in names
    assert "model.embed_tokens.weight" in names
    # int4_awq's default zero points: flagged in both sections, one int8 per group and output row
    assert quant["has_zero_point"] is True and config["quantization_config"]["has_zero_point"] is True
    assert {f"model.layers.{i}.{p}.weight_zero_point" for i in range(2) for p in ("self_attn.q_proj", "mlp.down_proj")} <= names
    with safe_open(str(next(export.glob("*.safetensors"))), framework="pt") as f:
        zero_point = f.get_tensor("model.layers.0.self_attn.q_proj.weight_zero_point")
    assert zero_point.dtype == torch.int8 and zero_point.shape == (64, 64 // 32)
    assert int(zero_point.min()) >= -8 and int(zero_point.max()) <= 7


def test_int4_zero_points_round_each_group_over_its_own_range():
    """quantize_int4_asymmetric: 16 levels over [min(w, 0), max(w, 0)] per group, every weight within half
    a step, the step never wider than symmetric int4's (amax / 7), zero points in [-8, 7], an all-zero
    group exact."""
    from kilnlm.builder.quantize_int import quantize_int4_asymmetric

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * 0.05 + torch.randn(48, 1, generator=gen) * 0.02  # groups off centre
    w[3, :32] = 0.0
    w[5, 32:64] = torch.rand(32, generator=gen) + 0.1  # all positive: zero at the bottom of the range
    q, scale, zero_point = quantize_int4_asymmetric(w, 32)
    assert q.dtype == zero_point.dtype == torch.int8 and q.shape == w.shape and scale.shape == zero_point.shape == (48, 4)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(zero_point.min()) >= -8 and int(zero_point.max()) <= 7
    dequantized = (q.float() - zero_point.float().repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    assert ((dequantized - w).abs() <= scale.repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all()
    amax = w.reshape(48, 4, 32).abs().amax(-1)
    assert ((scale <= amax / 7 * (1 + 1e-6)) | (amax == 0)).all()  # an all-zero group keeps scale 1
    assert torch.equal(dequantized[3, :32], torch.zeros(32)) and int(zero_point[5, 1]) == -8


def test_int4_awq_zero_points_by_default(tiny_llama_dir):
    """int4_awq rounds with zero points unless --no-zero-point; int4_wo only with --zero-point. With zero
    points the eager network stays closer to the float one than ModelOpt's symmetric rounding (the step of
    every group is at most symmetric's)."""
    from kilnlm.builder.network.layers import Int4Linear

    def int4_linears(network):
        return [m for m in network.modules() if isinstance(m, Int4Linear)]

    asymmetric = eager_network(tiny_llama_dir, **format_options("int4_awq"))
    symmetric = eager_network(tiny_llama_dir, **format_options("int4_awq", zero_point=False))
    assert all(m.zero_point is not None and m.zero_point.shape == m.weight_scale.shape for m in int4_linears(asymmetric))
    assert all(m.zero_point is None for m in int4_linears(symmetric))
    assert all(m.zero_point is None for m in int4_linears(eager_network(tiny_llama_dir, **format_options("int4_wo"))))
    assert all(m.zero_point is not None
               for m in int4_linears(eager_network(tiny_llama_dir, **format_options("int4_wo", zero_point=True))))
    reference = eager_network(tiny_llama_dir, **dict(TINY_LIMITS, qformat="fp32"))
    inputs = make_engine_inputs([(PROMPTS[0], 0)], 16, 16)
    kv = torch.zeros(kv_cache_shape(2, 16, 16, 2, 16))
    errors = {}
    with torch.no_grad():
        expected = reference(*inputs.as_args(kv.clone()))
        for name, network in (("asymmetric", asymmetric), ("symmetric", symmetric)):
            use_reference_ops(network)
            errors[name] = float((network(*inputs.as_args(kv.clone())) - expected).norm() / expected.norm())
    assert errors["asymmetric"] < errors["symmetric"], errors


def run_build(capsys, *args: str) -> tuple[int, str]:
    status = main(["build", *args])
    return status, capsys.readouterr().err


# ---- --auto-quantize-bits: ModelOpt's auto_quantize chooses, on calibration text, which decoder linears of an
# FP8 engine stay 16-bit (kilnlm.builder.auto_quantize); SmolLM2's quality with the formats' default budgets
# is measured in tests/builder/test_quality.py.
FUSED_GROUPS = (QKV_PROJS, (O_PROJ,), GATE_UP_PROJS, (DOWN_PROJ,))


def decoder_linears(checkpoint) -> dict[str, int]:
    """HF name -> weight count of every decoder linear of ``checkpoint``."""
    from kilnlm.builder.checkpoint import load_checkpoint

    state = load_checkpoint(checkpoint).state_dict
    return {k.removesuffix(".weight"): v.numel() for k, v in state.items()
            if k.startswith("model.layers.") and k.endswith("_proj.weight")}


def search_float_linears(checkpoint, qformat: str, bits: float) -> tuple[str, ...]:
    from kilnlm.builder.auto_quantize import search_float_linears as search
    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.config import resolve

    opts = resolve(BuildOptions(checkpoint=checkpoint, output=checkpoint / "unused",
                                **format_options(qformat, auto_quantize_bits=bits)))
    return search(load_checkpoint(checkpoint), opts.format, opts.calibration, bits)


def mean_bits(kept, linears: dict[str, int], weight_bits: int = 8) -> float:
    return weight_bits + (16 - weight_bits) * sum(linears[n] for n in kept) / sum(linears.values())


def test_modelopt_budget_counts_the_lm_head_at_16_bits():
    from kilnlm.builder.auto_quantize import modelopt_effective_bits

    assert modelopt_effective_bits(8.0, 100, 0) == 8.0
    assert modelopt_effective_bits(8.5, 300, 100) == (8.5 * 300 + 16 * 100) / 400
    assert modelopt_effective_bits(16.0, 300, 100) == 16.0


@pytest.mark.parametrize("qformat", ["fp8", "fp8_rowwise"])
def test_search_keeps_whole_fused_linears_within_the_budget(tiny_llama_dir, qformat):
    """At 10 bits (a quarter of the weights may stay 16-bit) the search keeps some linears, every part of a
    fused one or none, within the budget, the same ones on a second run; at 16 bits it keeps them all."""
    linears = decoder_linears(tiny_llama_dir)
    kept = search_float_linears(tiny_llama_dir, qformat, 10.0)
    assert kept and mean_bits(kept, linears) <= 10.0, kept
    assert kept == tuple(sorted(kept)) and set(kept) <= set(linears)
    for name in kept:
        layer = ".".join(name.split(".")[:3])  # model.layers.{i}
        group = next(g for g in FUSED_GROUPS if name.removeprefix(layer + ".") in g)
        assert {f"{layer}.{p}" for p in group} <= set(kept), f"{name} kept without its fused parts"
    assert search_float_linears(tiny_llama_dir, qformat, 10.0) == kept
    assert search_float_linears(tiny_llama_dir, qformat, 16.0) == tuple(sorted(linears))


@pytest.mark.parametrize("qformat", ["fp8", "fp8_rowwise"])
def test_engine_keeps_the_searched_linears_float(tiny_llama_dir, tmp_path, qformat):
    """The engine built at 10 bits: the searched linears are float linears (kilnlm::gemm) in the network and
    listed in the manifest's ``exclude_modules``, the rest in the format's op; the engine equals the
    network on the reference ops."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.network.layers import Linear
    from kilnlm.runtime.manifest import read_manifest

    require_kernel(qformat)
    options = format_options(qformat, auto_quantize_bits=10.0)
    build_engine(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "engine", **options))
    manifest = read_manifest(tmp_path / "engine")
    kept = search_float_linears(tiny_llama_dir, qformat, 10.0)
    assert manifest.build.exclude_modules == list(kept) and "gemm" in manifest.plugins
    network = eager_network(tiny_llama_dir, **options)
    assert network.float_linears == kept
    modules = dict(network.named_modules())
    fused = {"q_proj": "attn.qkv", "o_proj": "attn.o_proj", "gate_proj": "mlp.gate_up", "down_proj": "mlp.down"}
    linear_module = FORMATS[qformat].linear_module
    for i in range(2):
        for first, module in fused.items():
            name = f"model.layers.{i}.{'self_attn' if module.startswith('attn') else 'mlp'}.{first}"
            expected = Linear if name in kept else linear_module
            assert type(modules[f"layers.{i}.{module}"]) is expected, name
    torch.testing.assert_close(engine_logits(tmp_path / "engine"), reference_logits(network, manifest),
                               atol=REF_ATOL, rtol=0)


def test_no_search_at_the_formats_own_bits(tiny_llama_dir, monkeypatch):
    """``--auto-quantize-bits 8`` on an FP8 format: no search runs and every decoder linear is FP8."""
    import kilnlm.builder.auto_quantize as auto_quantize
    from kilnlm.builder.network.layers import Fp8RowwiseLinear

    def fail(*args, **kwargs):
        raise AssertionError("the search ran at --auto-quantize-bits 8")

    monkeypatch.setattr(auto_quantize, "search_float_linears", fail)
    network = eager_network(tiny_llama_dir, **format_options("fp8_rowwise", auto_quantize_bits=8))
    assert network.float_linears == () and sum(isinstance(m, Fp8RowwiseLinear) for m in network.modules()) == 2 * 4

@pytest.mark.parametrize("args, fragments", [
    (["--qformat", "int4_wo", "--group-size", "48"], ["--group-size 48 does not divide", "valid group sizes for this model: 16, 32, 64"]),
    (["--qformat", "int4_wo", "--calib-data", "x.txt"], ["--calib-data given but --qformat int4_wo does not calibrate"]),
    (["--qformat", "bf16", "--quantize-lm-head"], ["--quantize-lm-head works with fp8, fp8_rowwise, int4_awq",
                                                       "not --qformat bf16"]),
    (["--qformat", "int8_wo", "--group-size", "64"], ["--group-size applies to the int4 formats"]),
    (["--qformat", "int8_wo", "--per-token"], ["--per-token applies to --qformat int8_sq"]),
    (["--qformat", "fp8", "--per-token"], ["--per-token applies to --qformat int8_sq, not fp8"]),
    (["--qformat", "int8_wo", "--smoothquant-alpha", "0.5"], ["--smoothquant-alpha applies to --qformat fp8 / int8_sq"]),
    (["--qformat", "int8_wo", "--zero-point"], ["--zero-point / --no-zero-point apply to the int4 formats"]),
    (["--qformat", "int8_sq", "--smoothquant-alpha", "1.5"], ["--smoothquant-alpha 1.5: it must be within [0, 1]"]),
    (["--qformat", "fp8", "--export-checkpoint", "exp"], ["--export-checkpoint writes ModelOpt's unified checkpoint"]),
    (["--qformat", "int8_wo", "--use-fp8-rowwise"], ["--use-fp8-rowwise applies to --qformat fp8, not int8_wo"]),
    (["--qformat", "fp8", "--use-fp8-rowwise", "--calib-size", "4", "--auto-quantize-bits", "8"],
     ["--calib-size given but --qformat fp8_rowwise does not calibrate"]),
    (["--qformat", "int8_wo", "--auto-quantize-bits", "9"], ["--auto-quantize-bits applies to --qformat fp8 / fp8_rowwise"]),
    (["--qformat", "fp8", "--auto-quantize-bits", "4"], ["--auto-quantize-bits 4.0: it must be within [8, 16]"]),
    (["--qformat", "int8_sq", "--calib-data", "missing.txt"], ["--calib-data missing.txt does not exist"]),
])
def test_cli_refusals(tiny_llama_dir, tmp_path, capsys, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "engine"
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(out), "--quiet",
                            "--max-seq-len", "256", "--max-num-tokens", "256", *args)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kilnlm build: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("content, name, fragment", [
    ("", "empty.txt", "holds no text"),
    ('{"body": "x"}\n', "records.jsonl", 'no string "text" field'),
])
def test_cli_refuses_unusable_calibration_files(tiny_llama_dir, tmp_path, capsys, content, name, fragment):
    path = tmp_path / name
    path.write_text(content)
    status, err = run_build(capsys, "--checkpoint", str(tiny_llama_dir), "--output", str(tmp_path / "engine"),
                            "--qformat", "int4_awq", "--group-size", "32", "--calib-data", str(path))
    assert status == 2 and fragment in err and str(path) in err


def test_smoothquant_alpha_search_keeps_the_lowest_calibration_loss(tiny_llama_dir):
    """Without --smoothquant-alpha, a per-tensor int8_sq build quantizes with every alpha of the grid and keeps
    the model with the lowest loss on the calibration batches: the same alpha as each grid point quantized on
    its own and ranked here. calibration_loss is transformers' own mean next-token loss."""
    import copy

    import modelopt.torch.quantization as mtq

    from kilnlm.builder import quantize_int
    from kilnlm.builder.calibration import CalibrationConfig, calibration_batches, forward_loop
    from kilnlm.builder.checkpoint import float_model, load_checkpoint
    from kilnlm.builder.formats import SMOOTHQUANT_ALPHA_GRID

    ck = load_checkpoint(tiny_llama_dir)
    int8_sq = FORMATS["int8_sq"]
    batches = calibration_batches(ck.tokenizer, CalibrationConfig(num_samples=4, seq_len=64))
    loop = forward_loop(batches, "calibration", False)
    model = float_model(ck)
    with torch.no_grad():
        expected = float(model(batches[0], labels=batches[0]).loss)
    assert quantize_int.calibration_loss(model, batches[:1]) == pytest.approx(expected, abs=1e-5)

    losses = {}
    for alpha in SMOOTHQUANT_ALPHA_GRID:
        torch.manual_seed(0)
        recipe = quantize_int.modelopt_recipe(int8_sq, 128, False, alpha)
        losses[alpha] = quantize_int.calibration_loss(mtq.quantize(copy.deepcopy(model), recipe, loop), batches)
    assert len({round(loss, 6) for loss in losses.values()}) > 1, losses  # the alphas give different models
    alpha, quantized = quantize_int.search_smoothquant_alpha(model, int8_sq, False, batches, loop)
    assert alpha == min(losses, key=losses.get), losses
    assert quantize_int.calibration_loss(quantized, batches) == pytest.approx(losses[alpha], abs=1e-6)
