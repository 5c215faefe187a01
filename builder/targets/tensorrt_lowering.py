"""The ONNX export lowered for TensorRT: each ``kilnlm.paged_attention`` node becomes TensorRT-sized pieces.

A TensorRT plugin with an ahead-of-time implementation (``tensorrt.plugin.aot_impl``) launches one compiled
kernel, and kilnlm's attention is two launches with a dependency between them (the new tokens' K/V must be in
the pool before any query reads it). So before TensorRT parses the export, each attention node is rewritten
as standard ONNX for the RoPE tables and two plugin nodes, one kernel each::

    positions, inv_freq --Cast, Unsqueeze, Mul--> freqs [T, D/2] --Cos / Sin--> cos, sin  (once per network)
    paged_kv_write(k, v, cos, sin, slot_mapping, past_key_value_l, kv_scale) -> present_key_value_l
    paged_attention_core(q, cos, sin, present_key_value_l, block_tables, cu_seqlens_q, seq_lens_kv, kv_scale)
        -> output                                             (attribute: scale, the softmax scale)

``kv_scale`` is always an input (a TensorRT plugin has a fixed input list): an 8-bit pool's layer scales, or
one shared constant ``[1, 1]`` that a 16-bit pool's kernels never read.

``present_key_value_l`` aliases ``past_key_value_l`` (the plugin writes the pool in place; TensorRT's
aliased plugin I/O), and the attention node reads it, which orders the two kernels. The numerics are those
of :func:`kilnlm.plugins.reference.paged_kv_write_reference` and
:func:`~kilnlm.plugins.reference.paged_attention_core_reference`, whose composition is the reference of
``kilnlm::paged_attention``; their GPU kernels are :mod:`kilnlm.plugins.tensorrt_plugins`'.

Everything else in the graph is unchanged. The lowered model passes ``onnx.checker`` (full check) with the
two schemas registered here, and ONNX Runtime runs it (:mod:`kilnlm.builder.targets.onnx_runtime`), which is
how CI checks the lowering without TensorRT.
"""

from __future__ import annotations

from pathlib import Path

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.onnx_export import PLUGIN_DOMAIN, check_onnx_model
from kilnlm.plugins.tensorrt_plugins import TENSORRT_LOOKUP_VERSION

LOWERED_SUFFIX = ".trt.onnx"  # <model>.trt.onnx (+ .data): the lowered model, an intermediate of the plan build


def register_lowered_schemas() -> None:
    """Register the ONNX schemas of ``kilnlm.paged_kv_write`` and ``kilnlm.paged_attention_core`` (version 1
    of :data:`~kilnlm.builder.targets.onnx_export.PLUGIN_DOMAIN`) with the ``onnx`` package, for
    ``onnx.checker`` and shape inference. Idempotent.

    ``paged_kv_write``: k, v ``[T, num_kv_heads, head_dim]`` T; cos, sin ``[T, head_dim // 2]`` float32;
    slot_mapping ``[T]`` int64; past_key_value ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
    TKV; kv_scale ``[2]`` float32 (read for 8-bit pools only) -> present_key_value (past_key_value's type and shape, aliasing it).
    ``paged_attention_core``: q ``[T, num_heads, head_dim]`` T; cos, sin; key_value (the pool after the
    write) TKV; block_tables ``[B, max_blocks_per_seq]``, cu_seqlens_q ``[B+1]``, seq_lens_kv ``[B]`` int32;
    kv_scale -> output (q's type and shape). Attribute ``scale`` (float, the softmax scale); both
    take ``plugin_namespace`` and ``plugin_version`` (TensorRT's plugin lookup keys) and ``aot`` (1: the
    parser uses the plugin's ``tensorrt.plugin.aot_impl``, the kernels embedded in the plan)."""
    import onnx
    from onnx.defs import OpSchema

    try:
        onnx.defs.get_schema("paged_attention_core", 1, PLUGIN_DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    param, attr = OpSchema.FormalParameter, OpSchema.Attribute
    types = [("T", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)"], "activations"),
             ("TKV", ["tensor(float)", "tensor(bfloat16)", "tensor(float16)", "tensor(float8e4m3fn)", "tensor(int8)"],
              "the KV pool")]
    lookup = [attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=False),
              attr("plugin_version", OpSchema.AttrType.STRING, "the plugin's version", required=False),
              attr("aot", OpSchema.AttrType.INT, "1: TensorRT's ONNX parser takes the AOT implementation",
                   required=False)]
    tables = [param("cos", "tensor(float)"), param("sin", "tensor(float)")]
    scale = param("kv_scale", "tensor(float)")

    def like_input(index: int):
        def infer(ctx) -> None:
            ctx.set_output_type(0, ctx.get_input_type(index))
        return infer

    write = OpSchema(
        "paged_kv_write", PLUGIN_DOMAIN, 1,
        "The KV write of kilnlm's paged attention: RoPE on k, k and v written into the layer's pool at "
        "slot_mapping (kilnlm.plugins.reference.paged_kv_write_reference); the output aliases the pool.",
        inputs=[param("k", "T"), param("v", "T"), *tables, param("slot_mapping", "tensor(int64)"),
                param("past_key_value", "TKV"), scale],
        outputs=[param("present_key_value", "TKV")], type_constraints=types, attributes=lookup)
    write.set_type_and_shape_inference_function(like_input(5))
    core = OpSchema(
        "paged_attention_core", PLUGIN_DOMAIN, 1,
        "Causal GQA attention of a packed batch over the layer's paged pool after its KV write "
        "(kilnlm.plugins.reference.paged_attention_core_reference).",
        inputs=[param("q", "T"), *tables, param("key_value", "TKV"), param("block_tables", "tensor(int32)"),
                param("cu_seqlens_q", "tensor(int32)"), param("seq_lens_kv", "tensor(int32)"), scale],
        outputs=[param("output", "T")], type_constraints=types,
        attributes=[attr("scale", OpSchema.AttrType.FLOAT, "softmax scale, head_dim ** -0.5"), *lookup])
    core.set_type_and_shape_inference_function(like_input(0))
    onnx.defs.register_schema(write)
    onnx.defs.register_schema(core)


def lower_attention(model) -> int:
    """Rewrite ``model`` (an ``onnx_ir`` model of the export) in place as the module docstring shows.
    Returns the number of attention nodes lowered. Raises :class:`BuildError` when a node does not have
    the export's inputs (a model from another kilnlm version)."""
    from onnxscript import ir

    graph = model.graph
    attention = [node for node in graph if node.domain == PLUGIN_DOMAIN and node.op_type == "paged_attention"]
    if not attention:
        raise BuildError("the model has no kilnlm.paged_attention node: is it a kilnlm --target onnx export?")
    tables: dict[tuple[int, int], tuple] = {}  # (id(positions), id(inv_freq)) -> (cos, sin)
    unit_scale = None  # the [1, 1] kv_scale of 16-bit pools, made once
    lookup = {"plugin_namespace": PLUGIN_DOMAIN, "plugin_version": TENSORRT_LOOKUP_VERSION, "aot": 1}
    for node in attention:
        if len(node.inputs) not in (10, 11):
            raise BuildError(f"{node.name}: kilnlm.paged_attention with {len(node.inputs)} inputs (10 or 11 expected): "
                             "re-export the model with this kilnlm")
        q, k, v, past, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, *kv_scale = node.inputs
        key = (id(positions), id(inv_freq))
        new_nodes = []
        if key not in tables:
            axes = ir.node("Constant", [], attributes={"value": ir.tensor([1], dtype=ir.DataType.INT64)})
            as_float = ir.node("Cast", [positions], attributes={"to": ir.DataType.FLOAT})
            column = ir.node("Unsqueeze", [as_float.outputs[0], axes.outputs[0]])
            freqs = ir.node("Mul", [column.outputs[0], inv_freq])
            cos, sin = ir.node("Cos", [freqs.outputs[0]]), ir.node("Sin", [freqs.outputs[0]])
            cos.outputs[0].name, sin.outputs[0].name = "rope_cos", "rope_sin"
            new_nodes += [axes, as_float, column, freqs, cos, sin]
            tables[key] = (cos.outputs[0], sin.outputs[0])
        cos, sin = tables[key]
        if not kv_scale:
            if unit_scale is None:
                unit_scale = ir.node("Constant", [], attributes={"value": ir.tensor([1.0, 1.0], dtype=ir.DataType.FLOAT)})
                unit_scale.outputs[0].name = "unit_kv_scale"
                new_nodes.append(unit_scale)
            kv_scale = [unit_scale.outputs[0]]
        write = ir.node("paged_kv_write", [k, v, cos, sin, slot_mapping, past, *kv_scale], domain=PLUGIN_DOMAIN,
                        attributes=lookup,
                        name=f"{node.name}/paged_kv_write")
        core = ir.node("paged_attention_core", [q, cos, sin, write.outputs[0], block_tables, cu_seqlens_q, seq_lens_kv,
                                                *kv_scale], domain=PLUGIN_DOMAIN,
                       attributes={"scale": node.attributes["scale"].as_float(), **lookup},
                       name=f"{node.name}/paged_attention_core")
        graph.insert_before(node, [*new_nodes, write, core])
        output, present = node.outputs
        write.outputs[0].name, write.outputs[0].shape, write.outputs[0].type = present.name, present.shape, present.type
        core.outputs[0].shape, core.outputs[0].type = output.shape, output.type
        for index, value in enumerate(graph.outputs):
            if value is present:
                graph.outputs[index] = write.outputs[0]
        ir.convenience.replace_all_uses_with([output, present], [core.outputs[0], write.outputs[0]])
        graph.remove(node, safe=True)
    model.opset_imports[PLUGIN_DOMAIN] = 1
    return len(attention)


def lower_onnx_file(model_path: Path, out_path: Path | None = None) -> Path:
    """Lower the export at ``model_path`` (with its external weights) into ``out_path`` (default:
    ``model_path`` with :data:`LOWERED_SUFFIX`) and its own weights file beside it, checked with
    ``onnx.checker``. Returns ``out_path``. Raises :class:`BuildError`."""
    from onnxscript import ir

    model_path = Path(model_path)
    out_path = Path(out_path) if out_path is not None else model_path.with_name(model_path.stem + LOWERED_SUFFIX)
    register_lowered_schemas()
    model = ir.load(str(model_path))
    lower_attention(model)
    ir.save(model, str(out_path), external_data=out_path.name + ".data")
    check_onnx_model(out_path)
    return out_path


__all__ = ["LOWERED_SUFFIX", "lower_attention", "lower_onnx_file", "register_lowered_schemas"]
