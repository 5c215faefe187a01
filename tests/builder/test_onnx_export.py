"""``kilnlm build --target onnx``: the exported graph is the network.

The export is checked as a model (``onnx.checker`` full check, shape inference, the plugin node's attributes,
the standard Q/DQ of every quantized format) and run with ONNX Runtime on CPU, kilnlm's CPU attention kernel
as the plugin node (:mod:`kilnlm.builder.targets.onnx_runtime`), against the CPU engine of the same build.
"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch
from conftest import TINY_ENGINE_LIMITS, build_test_engine

from factories import greedy_generate, make_engine_inputs

from kilnlm.builder.targets.onnx_export import PLUGIN_DOMAIN, check_onnx_model
from kilnlm.builder.targets.onnx_runtime import OnnxRuntimeModel
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.runtime.engine import Engine
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import read_manifest

TINY_GROUP_SIZE = 32  # divides the tiny Llama's hidden (64) and intermediate sizes


@pytest.fixture(scope="module")
def onnx_export(tiny_llama_dir, tmp_path_factory):
    """``onnx_export(qformat, **options) -> Path``: the tiny Llama exported with ``--target onnx`` and the tiny
    engine's limits (built once per module and format)."""
    built = {}

    def get(qformat: str = "fp32", **options):
        key = (qformat, *sorted(options.items()))
        if key not in built:
            if qformat.startswith("int4"):
                options = {"group_size": TINY_GROUP_SIZE, **options}
            out = tmp_path_factory.mktemp("onnx") / f"tiny_{qformat}"
            built[key] = build_test_engine(tiny_llama_dir, out, qformat=qformat, dtype="float32", target="onnx",
                                           **TINY_ENGINE_LIMITS, **options)
        return built[key]

    return get


def load_graph(export_dir) -> onnx.ModelProto:
    return onnx.load(str(export_dir / "model.onnx"), load_external_data=False)


def dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_export_is_a_checked_model_with_one_plugin_node_per_layer(onnx_export):
    export_dir = onnx_export("fp32")
    manifest = read_manifest(export_dir)
    assert manifest.build.target == "onnx" and manifest.engine_file == "model.onnx"
    assert {"model.onnx", "model.onnx.data"} <= set(manifest.files)
    check_onnx_model(export_dir / "model.onnx")  # full check: strict shape inference over the whole graph

    graph = load_graph(export_dir).graph
    model = manifest.model
    attention = [node for node in graph.node if node.domain == PLUGIN_DOMAIN]
    assert [node.op_type for node in attention] == ["paged_attention"] * model.num_layers
    for layer, node in enumerate(attention):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["layer_idx"] == layer and attrs["scale"] == pytest.approx(model.head_dim**-0.5)
        assert attrs["plugin_namespace"] == b"kilnlm"
        assert attrs["plugin_version"] == str(PLUGIN_VERSIONS["paged_attention"]).encode()
        assert node.input[3] == f"past_key_value_{layer}" and node.output[1] == f"present_key_value_{layer}"

    inputs = {value.name: dims(value) for value in graph.input}
    pool = [2, "num_blocks", manifest.build.tokens_per_block, model.num_kv_heads, model.head_dim]
    assert inputs == {"input_ids": ["num_tokens"], "positions": ["num_tokens"], "cu_seqlens_q": ["num_seqs + 1"],
                      "seq_lens_kv": ["num_seqs"], "block_tables": ["num_seqs", manifest.build.max_blocks_per_seq],
                      "slot_mapping": ["num_tokens"], "logits_indices": ["num_logits"],
                      **{f"past_key_value_{layer}": pool for layer in range(model.num_layers)}}
    outputs = {value.name: dims(value) for value in graph.output}
    assert outputs == {"logits": ["num_logits", model.vocab_size],
                       **{f"present_key_value_{layer}": pool for layer in range(model.num_layers)}}


def test_the_runtime_refuses_to_serve_an_export(onnx_export):
    with pytest.raises(EngineError, match="no 'onnx' backend"):
        Engine.load(onnx_export("fp32"), trusted_keys=None)


def assert_matches_the_engine_on_two_packed_steps(ort_model, engine):
    """ONNX Runtime's logits and KV pools equal the compiled CPU engine's within 1e-4 over two steps: two
    contexts (37 and 5 tokens), then a generation token of each beside a new 40-token context."""
    build = engine.manifest.build
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq
    steps = [make_engine_inputs([(list(range(100, 137)), 0), (list(range(300, 305)), 0)], tpb, max_blocks),
             make_engine_inputs([([7], 37), ([9], 5), (list(range(500, 540)), 0)], tpb, max_blocks)]
    kv_engine = engine.allocate_kv_cache(3 * max_blocks)
    kv_onnx = kv_engine.clone()
    for inputs in steps:
        expected = engine.forward(inputs, kv_engine)
        torch.testing.assert_close(ort_model.forward(inputs, kv_onnx), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(kv_onnx, kv_engine, atol=1e-4, rtol=0)


def test_onnx_runtime_matches_the_cpu_engine_on_a_packed_mixed_batch(onnx_export, tiny_engine_dir):
    """fp32: ONNX Runtime's logits and KV pools equal the compiled CPU engine's within 1e-4 over two steps,
    the second packing generation tokens of two sequences with a new context."""
    assert_matches_the_engine_on_two_packed_steps(OnnxRuntimeModel(onnx_export("fp32") / "model.onnx"),
                                                  Engine.load(tiny_engine_dir, trusted_keys=None))


def test_tensorrt_lowering_is_the_same_network(onnx_export, tiny_engine_dir, tmp_path):
    """The TensorRT target's lowering (each attention node -> RoPE tables in standard ONNX, a paged_kv_write
    node whose output is the layer's present_key_value and a paged_attention_core node reading it) checks,
    and ONNX Runtime running it (the two nodes as their references) gives the CPU engine's logits and pools
    within 1e-4 over the same two packed steps as the export itself."""
    from kilnlm.builder.targets.tensorrt_lowering import lower_onnx_file

    lowered = lower_onnx_file(onnx_export("fp32") / "model.onnx", tmp_path / "model.trt.onnx")
    graph = onnx.load(str(lowered), load_external_data=False).graph
    engine = Engine.load(tiny_engine_dir, trusted_keys=None)
    num_layers = engine.manifest.model.num_layers
    ops = Counter((node.domain, node.op_type) for node in graph.node)
    assert ops[(PLUGIN_DOMAIN, "paged_attention")] == 0
    assert ops[(PLUGIN_DOMAIN, "paged_kv_write")] == ops[(PLUGIN_DOMAIN, "paged_attention_core")] == num_layers
    assert ops[("", "Cos")] == ops[("", "Sin")] == 1  # one RoPE table for the whole network
    writes = [node for node in graph.node if node.op_type == "paged_kv_write"]
    for layer, node in enumerate(writes):
        assert node.input[5] == f"past_key_value_{layer}" and node.output[0] == f"present_key_value_{layer}"
    for node in graph.node:
        if node.domain == PLUGIN_DOMAIN:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            # TensorRT's parser looks a tensorrt.plugin definition up by namespace and version "1" (the version
            # its creators report), and takes the AOT implementation where aot is 1
            assert (attrs["plugin_namespace"], attrs["plugin_version"], attrs["aot"]) == (b"kilnlm", b"1", 1)
    readers = {name for node in graph.node if node.op_type == "paged_attention_core" for name in node.input}
    assert {f"present_key_value_{layer}" for layer in range(num_layers)} <= readers  # the write orders the read
    assert [value.name for value in graph.output] == ["logits", *(f"present_key_value_{l}" for l in range(num_layers))]

    assert_matches_the_engine_on_two_packed_steps(OnnxRuntimeModel(lowered), engine)


# qformat -> (op type, element type of its first input or zero point) every linear of the format exports as
QDQ_OF_FORMAT = {
    "fp8": [("QuantizeLinear", onnx.TensorProto.FLOAT8E4M3FN), ("DequantizeLinear", onnx.TensorProto.FLOAT8E4M3FN)],
    "fp8_rowwise": [("QuantizeLinear", onnx.TensorProto.FLOAT8E4M3FN), ("DequantizeLinear", onnx.TensorProto.FLOAT8E4M3FN)],
    "int4_awq": [("DequantizeLinear", onnx.TensorProto.INT4)],
    "int4_wo": [("DequantizeLinear", onnx.TensorProto.INT4)],
    "int8_wo": [("DequantizeLinear", onnx.TensorProto.INT8)],
    "int8_sq": [("QuantizeLinear", onnx.TensorProto.INT8), ("DequantizeLinear", onnx.TensorProto.INT8)],
}


def element_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {init.name: init.data_type for init in graph.initializer}
    for node in graph.node:  # Constant nodes (zero points the optimizer kept as constants)
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.name == "value":
                types[node.output[0]] = attr.t.data_type
    inferred = onnx.shape_inference.infer_shapes(onnx.ModelProto(graph=graph, opset_import=[
        onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid(PLUGIN_DOMAIN, 1)], ir_version=10))
    for value in inferred.graph.value_info:
        types.setdefault(value.name, value.type.tensor_type.elem_type)
    return types


@pytest.mark.parametrize("qformat", sorted(QDQ_OF_FORMAT))
def test_quantized_formats_export_as_standard_qdq_and_run(qformat, onnx_export, tiny_llama_dir):
    """Each quantized linear is standard Q/DQ of the format's type (blocked 4-bit DequantizeLinear with the
    group size for int4, with INT4 zero points for int4_awq), no kilnlm op but attention remains, the model
    checks, and ONNX Runtime's greedy tokens equal the eager network's (the same kilnlm kernels the CPU
    engine runs) for a prompt."""
    from kilnlm.builder.build import build_network
    from kilnlm.builder.checkpoint import load_checkpoint
    from kilnlm.builder.config import BuildOptions, resolve
    from kilnlm.builder.network.llama import model_config_from_hf

    export_dir = onnx_export(qformat)
    check_onnx_model(export_dir / "model.onnx")
    manifest = read_manifest(export_dir)
    graph = load_graph(export_dir).graph
    num_linears = 4 * manifest.model.num_layers - len(manifest.build.exclude_modules)  # fp8_rowwise keeps some in float
    ops = Counter((node.domain, node.op_type) for node in graph.node)
    assert {domain for domain, _ in ops} == {"", PLUGIN_DOMAIN} and ops[(PLUGIN_DOMAIN, "paged_attention")] == manifest.model.num_layers
    types = element_types(graph)

    def quantized_type(node: onnx.NodeProto) -> int | None:
        """Q: its output_dtype, else its zero point's type; DQ: its quantized input's."""
        if node.op_type == "DequantizeLinear":
            return types.get(node.input[0])
        output_dtype = next((a.i for a in node.attribute if a.name == "output_dtype" and a.i), None)
        return output_dtype or (types.get(node.input[2]) if len(node.input) > 2 else None)

    for op_type, element_type in QDQ_OF_FORMAT[qformat]:
        typed = [n for n in graph.node if n.op_type == op_type and quantized_type(n) == element_type]
        assert len(typed) >= num_linears, f"{qformat}: {len(typed)} {op_type} of type {element_type} for {num_linears} linears"
    if qformat.startswith("int4"):
        blocked = [n for n in graph.node if n.op_type == "DequantizeLinear" and
                   any(a.name == "block_size" and a.i == TINY_GROUP_SIZE for a in n.attribute)]
        assert len(blocked) == num_linears
        with_zero_points = [n for n in blocked if len(n.input) > 2 and types.get(n.input[2]) == onnx.TensorProto.INT4]
        assert len(with_zero_points) == (num_linears if qformat == "int4_awq" else 0)

    options = resolve(BuildOptions(checkpoint=tiny_llama_dir, output=export_dir.parent / "unused", qformat=qformat,
                                   dtype="float32", **TINY_ENGINE_LIMITS,
                                   **({"group_size": TINY_GROUP_SIZE} if qformat.startswith("int4") else {})))
    checkpoint = load_checkpoint(tiny_llama_dir)
    network = build_network(options, checkpoint, model_config_from_hf(checkpoint.config)).eval()
    ort_model = OnnxRuntimeModel(export_dir / "model.onnx")
    build = manifest.build

    class Eager:  # the network behind greedy_generate's engine interface
        def __init__(self, forward):
            self.manifest, self.forward = manifest, forward

        def allocate_kv_cache(self, num_blocks):
            model = manifest.model
            return torch.zeros(model.num_layers, 2, num_blocks, build.tokens_per_block, model.num_kv_heads, model.head_dim)

    def eager_forward(inputs, kv_cache):
        with torch.no_grad():
            return network(*inputs.as_args(kv_cache))

    prompt = [1, 9519, 28, 314, 1345, 42, 7, 11]
    assert greedy_generate(Eager(ort_model.forward), prompt, 8, []) == greedy_generate(Eager(eager_forward), prompt, 8, [])


# ---- SmolLM2: exports of the real model's first layers (``smollm2_truncated_dir``: its weights, shapes and
# vocabulary) against CPU engines of the same build (float32 activations: ONNX Runtime runs the attention plugin
# on float32 only) -------------------------------------------------------------------------------------------
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
                   "Once upon a time, in a small village,", "The three primary colors are"]
SMOLLM2_POOL_BLOCKS = 2  # 64 tokens: prompt + continuation fit, and ONNX Runtime copies little per layer


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_format_engine):
    """``smollm2_pair(qformat) -> (Engine, OnnxRuntimeModel)``: the truncated SmolLM2's float32-activation CPU
    engine of ``qformat`` and its ``--target onnx`` export, both built from the checkpoint with the same options
    (the ``smollm2_format_engine`` factory's)."""

    def get(qformat: str):
        engine = Engine.load(smollm2_format_engine(qformat, truncated=True, dtype="float32"), trusted_keys=None)
        export_dir = smollm2_format_engine(qformat, truncated=True, dtype="float32", target="onnx")
        return engine, OnnxRuntimeModel(export_dir / "model.onnx")

    return get


class _Exported:
    """An export behind greedy_generate's engine interface, with its CPU engine's manifest."""

    def __init__(self, engine, ort_model):
        self.manifest, self.forward, self.allocate_kv_cache = engine.manifest, ort_model.forward, engine.allocate_kv_cache


def test_smollm2_int4_awq_export_gives_the_cpu_engines_greedy_tokens(smollm2_pair, hf_tokenizer):
    """int4_awq quantizes weights only: the export's blocked INT4 DequantizeLinear gives the engine's weights
    exactly, so 16 greedy tokens of every prompt are the engine's."""
    engine, ort_model = smollm2_pair("int4_awq")
    for prompt in SMOLLM2_PROMPTS:
        ids = hf_tokenizer(prompt)["input_ids"]
        expected = greedy_generate(engine, ids, 16, [], num_blocks=SMOLLM2_POOL_BLOCKS)
        assert greedy_generate(_Exported(engine, ort_model), ids, 16, [], num_blocks=SMOLLM2_POOL_BLOCKS) == expected, prompt


def test_smollm2_fp8_export_agrees_with_the_cpu_engine_teacher_forced(smollm2_pair, hf_tokenizer):
    """fp8 quantizes activations to 3 mantissa bits, so a one-ulp float32 difference upstream (ONNX Runtime's
    Sigmoid * x against torch's SiLU) can flip one element's rounding, and the flip grows layer by layer:
    measured on the whole model and these prompts, layer 0-4 outputs equal the engine's within 1e-5 and the
    first difference (2.5e-5) appears at layer 5's down_proj; the CPU engine against its own eager network (the
    same kernels, inductor's float fusion) shows the same spread where a flip happens (median max |logit
    difference| 1.8). Exact greedy equality is therefore not a property fp8 has, and the test checks what
    serving needs instead, teacher-forced on the engine's 24-token greedy continuations: the export picks the
    engine's token wherever the engine's top-2 margin is at least 1.5 logits, and on at least 85% of all
    positions (measured on the whole model: every disagreement at a margin below 0.7, 93% agreement; on the
    first 6 layers this test builds, 123 of 125 positions on an AMD Zen 3)."""
    engine, ort_model = smollm2_pair("fp8")
    build, model = engine.manifest.build, engine.manifest.model
    agreed = positions = 0
    for prompt in SMOLLM2_PROMPTS:
        ids = hf_tokenizer(prompt)["input_ids"]
        sequence = ids + greedy_generate(engine, ids, 24, [], num_blocks=SMOLLM2_POOL_BLOCKS)
        inputs = make_engine_inputs([(sequence, 0)], build.tokens_per_block, build.max_blocks_per_seq)
        inputs.logits_indices = torch.arange(len(ids) - 1, len(sequence), dtype=torch.int64)
        expected = engine.forward(inputs, engine.allocate_kv_cache(SMOLLM2_POOL_BLOCKS))
        actual = ort_model.forward(inputs, engine.allocate_kv_cache(SMOLLM2_POOL_BLOCKS))
        assert actual.shape == expected.shape == (len(sequence) - len(ids) + 1, model.vocab_size)
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= 1.5
        same = actual.argmax(-1) == expected.argmax(-1)
        assert same[clear].all(), f"{prompt!r}: the export's token differs where the engine's margin is >= 1.5"
        agreed += int(same.sum())
        positions += len(same)
    print(f"\n[onnx] the fp8 export agrees with the engine on {agreed} of {positions} positions")
    assert agreed >= 0.85 * positions, f"the export agrees with the engine on {agreed} of {positions} positions"
