"""Export the fused network to ONNX: the first half of the ``tensorrt`` target, and a portable artifact.

The same network the ``cpu`` target compiles (:mod:`kilnlm.builder.network`, its quantization included) is
captured with ``torch.export`` and translated by torch's ONNX exporter, with one translation per kilnlm
plugin op (:func:`translation_table`):

- ``gemm``: ``Gemm(x, weight, bias, transB=1)``;
- ``fp8_linear``: x through ``QuantizeLinear`` / ``DequantizeLinear`` to ``float8e4m3fn`` with the static
  ``input_scale``, the weight as ``DequantizeLinear(float8e4m3fn weight, weight_scale)`` (per tensor, or per
  output channel for fused parts), then ``Gemm``: TensorRT's explicit-quantization form of FP8;
- ``fp8_rowwise_linear``: the same with a per-token scale computed in the graph (``ReduceMax(Abs(x)) / 448``,
  1 for an all-zero row) on axis 0, and per-channel weight scales;
- ``int4_linear``: ``DequantizeLinear`` of an ``INT4 [out, in]`` weight, blocked along the input dimension
  (``block_size`` = group size, opset 21), with float32 scales and, for asymmetric groups, ``INT4`` zero
  points; AWQ's ``pre_quant_scale`` as a ``Mul`` before the ``Gemm``;
- ``int8_linear``: ``DequantizeLinear`` of the int8 weight per output channel, then ``Gemm``;
- ``int8_sq_linear``: int8 ``QuantizeLinear`` / ``DequantizeLinear`` of the (smoothed) activations with the
  static per-tensor scale (or per-token scales, ``ReduceMax(Abs(x)) / 127``), weight as for int8_linear;
- ``paged_attention``: one ``paged_attention`` node per layer in kilnlm's plugin domain (:data:`PLUGIN_DOMAIN`,
  schema :func:`register_onnx_schemas`), carrying the plugin's attributes (``layer_idx``, ``scale``) and
  TensorRT's plugin-lookup attributes (``plugin_namespace``, ``plugin_version``).

Quantized linears compute ``x_dq @ w_dq.T`` in float32 (activations in bfloat16 are cast to float32 first and
the result cast back), where the CPU kernels compute ``(x_q @ w_q.T) * scales``: the same products up to
float32 rounding.

The paged KV pool is one tensor ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
mutated in place in the engine ABI (:mod:`kilnlm.runtime.abi`); ONNX graphs are functional, so each layer's
slice is a graph input ``past_key_value_{l}`` ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
and the pool after that layer's KV write a graph output ``present_key_value_{l}`` of the same shape
(TensorRT-LLM's names). A runtime binds both to the layer's slice of its one pool (``kv_cache[l]`` is
contiguous), which the attention plugin updates in place; the attention node's second output aliases its
fourth input.

The model's inputs are the ABI's (``input_ids`` ... ``logits_indices``) then the per-layer pools; its outputs
``logits [num_logits, vocab_size] float32`` then the per-layer pools. Dynamic dimensions: ``num_tokens``,
``num_seqs`` (``cu_seqlens_q`` has ``num_seqs + 1`` rows), ``num_logits`` and ``num_blocks``.
Weights are stored outside the protobuf (``model.onnx.data``), as every model over 2 GB must be.
"""

from __future__ import annotations

import logging
import operator
import time
from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.builder.network.layers import FP8_E4M3_MAX
from kilnlm.runtime.abi import INPUT_NAMES
from kilnlm.runtime.manifest import BuildConfig, ModelConfig

log = logging.getLogger(__name__)

ONNX_OPSET = 21  # blocked (block_size) and 4-bit DequantizeLinear; float8 Q/DQ since 19
PLUGIN_DOMAIN = "kilnlm"  # the ONNX domain of kilnlm's plugin nodes, and their TensorRT plugin namespace
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
INT8_MAX = 127.0


def past_key_value_name(layer_idx: int) -> str:
    """The graph input holding layer ``layer_idx``'s KV pool (TensorRT-LLM's name)."""
    return f"past_key_value_{layer_idx}"


def present_key_value_name(layer_idx: int) -> str:
    """The graph output holding layer ``layer_idx``'s KV pool after its KV write (TensorRT-LLM's name)."""
    return f"present_key_value_{layer_idx}"


# ---- the plugin node's ONNX schema -------------------------------------------------------------------------

def _paged_attention_inference(ctx) -> None:
    """Shape inference of ``kilnlm.paged_attention``: output 0 is q's type and shape, output 1 the pool's."""
    ctx.set_output_type(0, ctx.get_input_type(0))
    ctx.set_output_type(1, ctx.get_input_type(3))


def register_onnx_schemas() -> None:
    """Register the ONNX schema of ``kilnlm.paged_attention`` (version 1 of :data:`PLUGIN_DOMAIN`) with the
    ``onnx`` package, so the exporter, ``onnx.checker`` (full check) and shape inference know the node.
    Idempotent.

    Inputs: q ``[T, num_heads, head_dim]`` T; k, v ``[T, num_kv_heads, head_dim]`` T (before RoPE);
    past_key_value ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` TKV (this layer's pool);
    positions ``[T]`` int64; inv_freq ``[head_dim // 2]`` float32; cu_seqlens_q ``[B+1]`` int32; seq_lens_kv
    ``[B]`` int32; block_tables ``[B, max_blocks_per_seq]`` int32; slot_mapping ``[T]`` int64; kv_scale
    ``[2]`` float32 (optional, an 8-bit pool's k and v scales). Outputs: ``[T, num_heads, head_dim]`` T and
    present_key_value (the pool after the KV write, aliasing past_key_value). Attributes: ``layer_idx``,
    ``scale`` (softmax scale), ``plugin_namespace``, ``plugin_version``. The numerics are those of
    ``kilnlm::paged_attention`` (:mod:`kilnlm.plugins.schema`)."""
    import onnx
    from onnx.defs import OpSchema

    try:
        onnx.defs.get_schema("paged_attention", 1, PLUGIN_DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    param = OpSchema.FormalParameter
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [param("q", "T"), param("k", "T"), param("v", "T"), param("past_key_value", "TKV"),
              param("positions", "tensor(int64)"), param("inv_freq", "tensor(float)"),
              param("cu_seqlens_q", "tensor(int32)"), param("seq_lens_kv", "tensor(int32)"),
              param("block_tables", "tensor(int32)"), param("slot_mapping", "tensor(int64)"),
              param("kv_scale", "tensor(float)", param_option=optional)]
    attr = OpSchema.Attribute
    schema = OpSchema(
        "paged_attention", PLUGIN_DOMAIN, 1,
        "kilnlm's paged attention plugin: RoPE, KV write into the layer's paged pool, causal GQA attention "
        "over a packed batch of context chunks and generation tokens (kilnlm.plugins.schema).",
        inputs=inputs, outputs=[param("output", "T"), param("present_key_value", "TKV")],
        type_constraints=[("T", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)"], "activations"),
                          ("TKV", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)", "tensor(float8e4m3fn)",
                                   "tensor(int8)"], "the KV pool")],
        attributes=[attr("layer_idx", OpSchema.AttrType.INT, "the decoder layer"),
                    attr("scale", OpSchema.AttrType.FLOAT, "softmax scale, head_dim ** -0.5"),
                    attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=False),
                    attr("plugin_version", OpSchema.AttrType.STRING, "the plugin's version", required=False)],
    )
    schema.set_type_and_shape_inference_function(_paged_attention_inference)
    onnx.defs.register_schema(schema)


# ---- a functional paged attention for the exporter ----------------------------------------------------------

_EXPORT_LIB = torch.library.Library("kilnlm_onnx", "DEF")
_EXPORT_LIB.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, int layer_idx, Tensor positions, "
    "Tensor inv_freq, Tensor cu_seqlens_q, Tensor seq_lens_kv, Tensor block_tables, Tensor slot_mapping, "
    "float scale, Tensor? kv_scale=None) -> (Tensor, Tensor)"
)


@torch.library.register_fake("kilnlm_onnx::paged_attention")
def _paged_attention_functional_fake(q, k, v, kv_cache, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(kv_cache)


def functionalize_attention(exported: torch.export.ExportedProgram) -> int:
    """Rewrite ``exported``'s graph in place so each ``kilnlm::paged_attention`` (which mutates the KV pool,
    captured by ``torch.export`` as ``auto_functionalized_v2``, a higher-order op ONNX cannot express) is a
    call of the functional ``kilnlm_onnx::paged_attention`` returning ``(output, pool after the write)``,
    the form of the ONNX node. Returns the number of calls rewritten."""
    attention = torch.ops.kilnlm.paged_attention.default
    arg_names = [a.name for a in attention._schema.arguments]
    graph = exported.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.auto_functionalized_v2 or node.args[0] is not attention:
            continue
        kwargs = dict(node.kwargs)
        bases = kwargs.pop("_all_bases")
        pool = bases[kwargs.pop("_kv_cache_base_index")]
        if any(key.startswith("_kv_cache_") for key in kwargs):  # the pool passed as a view of another tensor
            raise BuildError("the ONNX export found the KV pool passed to paged_attention as a view: report this "
                             "as a kilnlm bug")
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.kilnlm_onnx.paged_attention.default,
                                       tuple(pool if name == "kv_cache" else kwargs[name] for name in arg_names))
        values = [None, None]
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise BuildError(f"unexpected use of paged_attention's result in the exported graph ({user.target}): "
                                 "report this as a kilnlm bug")
            values[user.args[1]] = user.meta.get("val")
            user.args = (call, user.args[1])
        call.meta = dict(node.meta)
        call.meta["val"] = tuple(values)
        graph.erase_node(node)
        rewritten += 1
    graph.lint()
    exported.graph_module.recompile()
    return rewritten


# ---- translations of kilnlm's ops ---------------------------------------------------------------------------

def translation_table(plugin_versions: dict[str, int]) -> dict:
    """ONNX translations (onnxscript, traced) of every kilnlm op, for ``torch.onnx.export``'s
    ``custom_translation_table``. ``plugin_versions``: the versions the node attributes record."""
    import onnxscript
    from onnxscript import ir
    from onnxscript import opset21 as op

    plugin = onnxscript.values.Opset(PLUGIN_DOMAIN, 1)
    FLOAT = ir.DataType.FLOAT

    def as_float(x):
        return x if x.dtype == FLOAT else op.Cast(x, to=FLOAT)

    def like(y, x):
        return y if x.dtype == FLOAT else op.Cast(y, to=x.dtype)

    def gemm(x, weight, bias):
        if bias is None:
            return op.Gemm(x, weight, transB=1)
        return op.Gemm(x, weight, bias, transB=1)

    def dequantized_gemm(x32, weight_dq, bias, x):
        return like(gemm(x32, weight_dq, None if bias is None else as_float(bias)), x)

    def per_channel_dq(weight, weight_scale):
        """The weight dequantized per output channel (a 1-D scale) or per tensor (a 0-dim one)."""
        if len(weight_scale.shape) == 1:
            return op.DequantizeLinear(weight, weight_scale, axis=0)
        return op.DequantizeLinear(weight, weight_scale)

    def fake_quantized(x32, scale, zero):
        """x through Q/DQ onto ``zero``'s type with a per-tensor (0-dim) ``scale``."""
        return op.DequantizeLinear(op.QuantizeLinear(x32, scale, zero), scale)

    def fake_quantized_per_token(x32, scale, output_dtype):
        """x through Q/DQ onto ``output_dtype`` with one scale per row (``[T]``, axis 0; no zero point)."""
        return op.DequantizeLinear(op.QuantizeLinear(x32, scale, axis=0, output_dtype=output_dtype), scale, axis=0)

    def per_token_scale(x32, qmax):
        """``max_c |x[t, c]| / qmax`` per row, 1 where that is 0 or NaN."""
        scale = op.Div(op.ReduceMax(op.Abs(x32), op.Constant(value_ints=[1]), keepdims=0), op.Constant(value_float=qmax))
        return op.Where(op.Greater(scale, op.Constant(value_float=0.0)), scale, op.Constant(value_float=1.0))

    def zero(dtype: ir.DataType):
        """A 0-dim zero point of ``dtype`` (the type QuantizeLinear quantizes onto)."""
        return op.Constant(value=ir.tensor(0, dtype=dtype))

    def fp8_linear(x, weight, weight_scale, input_scale, bias):
        x32 = fake_quantized(as_float(x), input_scale, zero(ir.DataType.FLOAT8E4M3FN))
        return dequantized_gemm(x32, per_channel_dq(weight, weight_scale), bias, x)

    def fp8_rowwise_linear(x, weight, weight_scale, bias):
        x32 = as_float(x)
        x32 = fake_quantized_per_token(x32, per_token_scale(x32, FP8_E4M3_MAX), ir.DataType.FLOAT8E4M3FN)
        return dequantized_gemm(x32, per_channel_dq(weight, weight_scale), bias, x)

    def int8_linear(x, weight, weight_scale, bias):
        return dequantized_gemm(as_float(x), per_channel_dq(weight, weight_scale), bias, x)

    def int8_sq_linear(x, weight, weight_scale, input_scale, pre_quant_scale=None, bias=None, per_token=False):
        x32 = as_float(x) if pre_quant_scale is None else op.Mul(as_float(x), pre_quant_scale)
        if per_token:
            x32 = fake_quantized_per_token(x32, per_token_scale(x32, INT8_MAX), ir.DataType.INT8)
        else:
            x32 = fake_quantized(x32, input_scale, zero(ir.DataType.INT8))
        return dequantized_gemm(x32, per_channel_dq(weight, weight_scale), bias, x)

    def int4_linear(x, weight, weight_scale, pre_quant_scale, bias, group_size, weight_zero_point=None):
        # weight arrives as the engine's packed uint8 [out, in // 2]: _retype_int4 makes it INT4 [out, in].
        scale = as_float(weight_scale)
        if weight_zero_point is None:
            weight_dq = op.DequantizeLinear(weight, scale, axis=1, block_size=group_size)
        else:
            weight_dq = op.DequantizeLinear(weight, scale, weight_zero_point, axis=1, block_size=group_size)
        x32 = as_float(x) if pre_quant_scale is None else op.Mul(as_float(x), pre_quant_scale)
        return dequantized_gemm(x32, weight_dq, bias, x)

    def paged_attention(q, k, v, kv_cache, layer_idx, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables,
                        slot_mapping, scale, kv_scale=None):
        inputs = [q, k, v, kv_cache, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping]
        if kv_scale is not None:
            inputs.append(kv_scale)
        return plugin.paged_attention(*inputs, layer_idx=layer_idx, scale=scale, plugin_namespace=PLUGIN_DOMAIN,
                                      plugin_version=str(plugin_versions["paged_attention"]), _outputs=2)

    ops = torch.ops.kilnlm
    return {ops.gemm.default: gemm, ops.fp8_linear.default: fp8_linear,
            ops.fp8_rowwise_linear.default: fp8_rowwise_linear, ops.int4_linear.default: int4_linear,
            ops.int8_linear.default: int8_linear, ops.int8_sq_linear.default: int8_sq_linear,
            torch.ops.kilnlm_onnx.paged_attention.default: paged_attention}


# ---- passes over the exported ONNX model ----------------------------------------------------------------

def _retype_int4(model) -> int:
    """Make the weights and zero points of every blocked 4-bit ``DequantizeLinear`` INT4 initializers: the
    engine's packed uint8 ``[out, in // 2]`` weight (low nibble first, ONNX's INT4 packing order, so the bytes
    are unchanged) becomes ``INT4 [out, in]``; int8 zero points in [-8, 7] become INT4 of the same shape.
    Returns the number of nodes retyped. Raises :class:`BuildError` when a DequantizeLinear with a
    block size does not read initializers."""
    import numpy as np
    from onnxscript import ir

    retyped = 0
    for node in model.graph:
        block_size = node.attributes.get("block_size")
        if node.op_type != "DequantizeLinear" or node.domain != "" or block_size is None or block_size.as_int() == 0:
            continue
        weight = node.inputs[0]
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        if weight.const_value is None or (zero_point is not None and zero_point.const_value is None):
            raise BuildError(f"int4 DequantizeLinear {node.name} does not read initializers: report this as a kilnlm bug")
        if weight.const_value.dtype == ir.DataType.UINT8:
            packed = weight.const_value.numpy()
            values = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
            values[:, 0::2] = (packed & 0x0F).astype(np.int8)
            values[:, 1::2] = (packed >> 4).astype(np.int8)
            values = np.where(values > 7, values - 16, values).astype(np.int8)
            weight.const_value = ir.Tensor(values, dtype=ir.DataType.INT4, name=weight.name)
            weight.type = ir.TensorType(ir.DataType.INT4)
            weight.shape = ir.Shape(values.shape)
            node.outputs[0].shape = ir.Shape(values.shape)  # the exporter recorded the packed shape
        if zero_point is not None and zero_point.const_value.dtype == ir.DataType.INT8:
            zero_point.const_value = ir.Tensor(zero_point.const_value.numpy(), dtype=ir.DataType.INT4, name=zero_point.name)
            zero_point.type = ir.TensorType(ir.DataType.INT4)
        retyped += 1
    return retyped


def _split_kv_pool(model, num_layers: int) -> None:
    """Replace the one KV-pool input, threaded through every attention node, by per-layer graph inputs
    ``past_key_value_{l}`` and outputs ``present_key_value_{l}`` (see the module docstring). Raises
    :class:`BuildError` when the graph does not have one attention node per layer reading the pool."""
    from onnxscript import ir

    graph = model.graph
    attention = [node for node in graph if node.domain == PLUGIN_DOMAIN and node.op_type == "paged_attention"]
    pool = graph.inputs[-1]
    if len(attention) != num_layers or attention[0].inputs[3] is not pool:
        raise BuildError(f"the exported graph has {len(attention)} attention nodes for {num_layers} layers: report "
                         "this as a kilnlm bug")
    layer_shape = ir.Shape(list(pool.shape)[1:])
    old_outputs = [value for value in graph.outputs if value.producer() in attention]
    past = []
    for node in attention:
        layer = node.attributes["layer_idx"].as_int()
        value = ir.Value(name=past_key_value_name(layer), type=pool.type, shape=layer_shape)
        node.replace_input_with(3, value)
        node.outputs[1].name = present_key_value_name(layer)
        node.outputs[1].shape = layer_shape
        past.append(value)
    for value in old_outputs:
        graph.outputs.remove(value)
    graph.outputs.extend(node.outputs[1] for node in attention)
    graph.inputs.pop()
    graph.inputs.extend(past)
    if pool.uses():
        raise BuildError("the exported graph reads the KV pool outside the attention nodes: report this as a kilnlm bug")


def _name_dynamic_dims(model) -> None:
    """Name the graph inputs' and outputs' dynamic dimensions after the ABI's (``num_tokens``, ``num_seqs``,
    ``num_logits``, ``num_blocks``) instead of the exporter's symbols."""
    from onnxscript import ir

    names = {}
    by_input = {"input_ids": (0, "num_tokens"), "seq_lens_kv": (0, "num_seqs"), "logits_indices": (0, "num_logits"),
                past_key_value_name(0): (1, "num_blocks")}
    values = {value.name: value for value in (*model.graph.inputs, *model.graph.outputs)}
    for input_name, (axis, dim_name) in by_input.items():
        symbol = values[input_name].shape[axis]
        if isinstance(symbol, ir.SymbolicDim) and symbol.value is not None:
            names[symbol.value] = dim_name
    names.update({f"{symbol} + 1": "num_seqs + 1" for symbol, name in list(names.items()) if name == "num_seqs"})
    for value in values.values():
        if value.shape is None:
            continue
        value.shape = ir.Shape([ir.SymbolicDim(names.get(dim.value, dim.value)) if isinstance(dim, ir.SymbolicDim) else dim
                                for dim in value.shape])


def check_onnx_model(model_path: Path) -> None:
    """``onnx.checker`` (full check, which runs strict shape inference) over ``model_path`` with its
    external weights. Raises :class:`BuildError` with the checker's first line."""
    import onnx

    register_onnx_schemas()
    try:
        onnx.checker.check_model(str(model_path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise BuildError(f"the exported {model_path.name} fails onnx.checker: {str(exc).splitlines()[0]}") from exc


def export_onnx(network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype, out_dir: Path,
                plugin_versions: dict[str, int]) -> list[Path]:
    """Export ``network`` (activations in ``dtype``) for the limits of ``build`` to ``out_dir / model.onnx``
    and its weights ``out_dir / model.onnx.data`` (see the module docstring), check it with
    ``onnx.checker`` and return both paths. ``plugin_versions``: what the plugin nodes record. Raises
    :class:`BuildError` when the export fails or its result does not check."""
    from kilnlm.builder.targets.cpu import dynamic_shapes, example_inputs

    register_onnx_schemas()
    network = network.eval()
    args = example_inputs(model, build, dtype)
    log.info("exporting the network to ONNX (opset %d, torch.export + torch.onnx)", ONNX_OPSET)
    t0 = time.perf_counter()
    for chatty in ("onnxscript", "onnx_ir"):  # their optimizer passes log every rewrite at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        with torch.no_grad():
            exported = torch.export.export(network, args, dynamic_shapes=dynamic_shapes(build), strict=False)
            exported = exported.run_decompositions({})
        functionalize_attention(exported)
        program = torch.onnx.export(exported, args, dynamo=True, custom_translation_table=translation_table(plugin_versions),
                                    opset_version=ONNX_OPSET, input_names=[*INPUT_NAMES, "kv_cache"],
                                    output_names=["logits"], optimize=True, verbose=False)
    except BuildError:
        raise
    except Exception as exc:  # the exporter raises many types; report them as one build error
        raise BuildError(f"the ONNX export failed for {model.architecture}: {str(exc).splitlines()[0]}") from exc
    onnx_model = program.model
    _retype_int4(onnx_model)
    _split_kv_pool(onnx_model, model.num_layers)
    _name_dynamic_dims(onnx_model)
    out_dir = Path(out_dir)
    model_path = out_dir / MODEL_FILE
    program.save(str(model_path), external_data=True)
    check_onnx_model(model_path)
    log.info("exported %s in %.1f s (%.1f MB of weights)", model_path.name, time.perf_counter() - t0,
             (out_dir / WEIGHTS_FILE).stat().st_size / 1e6)
    return [model_path, out_dir / WEIGHTS_FILE]

