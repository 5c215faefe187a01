"""Run an exported ``model.onnx`` with ONNX Runtime on CPU: the proof that the export is the network.

ONNX Runtime runs every standard node; the ``kilnlm.paged_attention`` plugin nodes run kilnlm's CPU
attention kernel (``torch.ops.kilnlm.paged_attention``) as an onnxruntime-extensions Python custom op, and the
TensorRT lowering's ``paged_kv_write`` / ``paged_attention_core`` nodes
(:mod:`kilnlm.builder.targets.tensorrt_lowering`) run their plain-torch references. The
engine ABI stays the runtime's: :meth:`OnnxRuntimeModel.forward` takes :class:`~kilnlm.runtime.abi.EngineInputs`
and the one paged pool, feeds each layer's slice as ``past_key_value_{l}`` and copies ``present_key_value_{l}``
back into it.

Limits: float32 activations and a float32 pool (onnxruntime-extensions' Python ops declare one type per
input, and NumPy has no bfloat16 or float8); every output of a Python op is copied through a Python list,
so a forward costs about a millisecond per 10k pool elements per layer: small pools only. This is a
verification path, not a serving backend.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.onnx_export import PLUGIN_DOMAIN, past_key_value_name, present_key_value_name
from kilnlm.plugins.reference import paged_attention_core_reference, paged_kv_write_reference
from kilnlm.runtime.abi import EngineInputs

_registered = False
_op_errors: list[BaseException] = []  # raised inside the plugin node; an exception must not cross ORT's C++ frames


def _register_attention_op() -> str:
    """Register the Python implementation of the attention node with onnxruntime-extensions (once per
    process) and return the custom-op library to load into a session."""
    global _registered
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    if not _registered:
        f32, i32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64

        @onnx_op(op_type="paged_attention", inputs=[f32, f32, f32, f32, i64, f32, i32, i32, i32, i64], outputs=[f32, f32],
                 attrs={"layer_idx": i64, "scale": PyCustomOpDef.dt_float, "plugin_namespace": PyCustomOpDef.dt_string,
                        "plugin_version": PyCustomOpDef.dt_string})
        def paged_attention(q, k, v, past_key_value, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables,
                            slot_mapping, **attrs):
            pool = torch.from_numpy(past_key_value.copy()).unsqueeze(0)  # [1, 2, blocks, tpb, Hkv, D]
            try:
                out = torch.ops.kilnlm.paged_attention(
                    torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), pool, 0, torch.from_numpy(positions),
                    torch.from_numpy(inv_freq), torch.from_numpy(cu_seqlens_q), torch.from_numpy(seq_lens_kv),
                    torch.from_numpy(block_tables), torch.from_numpy(slot_mapping), float(attrs["scale"]))
            except Exception as exc:  # an exception escaping here aborts the process: report it after run()
                _op_errors.append(exc)
                out = torch.full(q.shape, float("nan"))
            return out.numpy(), pool[0].numpy()

        # The TensorRT lowering's two plugin nodes (kilnlm.builder.targets.tensorrt_lowering), as their references.
        @onnx_op(op_type="paged_kv_write", inputs=[f32, f32, f32, f32, i64, f32, f32], outputs=[f32],
                 attrs={"plugin_namespace": PyCustomOpDef.dt_string, "plugin_version": PyCustomOpDef.dt_string,
                        "aot": PyCustomOpDef.dt_int64})
        def paged_kv_write(k, v, cos, sin, slot_mapping, past_key_value, kv_scale, **attrs):  # float32 pool: no scale
            pool = torch.from_numpy(past_key_value.copy())
            try:
                paged_kv_write_reference(torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(cos),
                                         torch.from_numpy(sin), torch.from_numpy(slot_mapping), pool)
            except Exception as exc:  # see paged_attention
                _op_errors.append(exc)
            return pool.numpy()

        @onnx_op(op_type="paged_attention_core", inputs=[f32, f32, f32, f32, i32, i32, i32, f32], outputs=[f32],
                 attrs={"scale": PyCustomOpDef.dt_float, "plugin_namespace": PyCustomOpDef.dt_string,
                        "plugin_version": PyCustomOpDef.dt_string, "aot": PyCustomOpDef.dt_int64})
        def paged_attention_core(q, cos, sin, key_value, block_tables, cu_seqlens_q, seq_lens_kv, kv_scale, **attrs):
            try:
                out = paged_attention_core_reference(
                    torch.from_numpy(q), torch.from_numpy(cos), torch.from_numpy(sin), torch.from_numpy(key_value),
                    torch.from_numpy(block_tables), torch.from_numpy(cu_seqlens_q), torch.from_numpy(seq_lens_kv),
                    float(attrs["scale"]))
            except Exception as exc:  # see paged_attention
                _op_errors.append(exc)
                out = torch.full(q.shape, float("nan"))
            return out.numpy()

        _registered = True
    return get_library_path()


class OnnxRuntimeModel:
    """An exported model in an ONNX Runtime CPU session (see the module docstring).

    ``model_path``: ``model.onnx`` with its external weights beside it. Raises :class:`BuildError` when the
    model's activations or pool are not float32."""

    def __init__(self, model_path: str | Path):
        import onnx
        import onnxruntime as ort
        from onnxruntime_extensions import default_opset_domain

        from kilnlm.plugins import load_cpu_kernels

        load_cpu_kernels()  # the plugin node's implementation
        library = _register_attention_op()
        model = onnx.load(str(model_path))  # weights included: the session is built from bytes
        pools = [value for value in model.graph.input if value.name.startswith("past_key_value_")]
        if any(value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT for value in pools):
            raise BuildError(f"{model_path}: ONNX Runtime runs the attention plugin here on a float32 pool only")
        contrib = default_opset_domain()  # where onnxruntime-extensions' Python ops live
        for node in model.graph.node:
            if node.domain == PLUGIN_DOMAIN:
                node.domain = contrib
        for opset in model.opset_import:
            if opset.domain == PLUGIN_DOMAIN:
                opset.domain = contrib
        options = ort.SessionOptions()
        options.register_custom_ops_library(library)
        options.intra_op_num_threads = torch.get_num_threads()
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.num_layers = len(pools)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_logits, vocab_size] float32`` of one packed batch; ``kv_cache`` (the ABI's one pool,
        ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` float32) is updated as the
        engine would update it."""
        feed = {name: getattr(inputs, name).numpy() for name in EngineInputs.__dataclass_fields__}
        feed.update({past_key_value_name(layer): kv_cache[layer].numpy() for layer in range(self.num_layers)})
        names = ["logits", *(present_key_value_name(layer) for layer in range(self.num_layers))]
        _op_errors.clear()
        logits, *pools = self.session.run(names, feed)
        if _op_errors:
            raise BuildError(f"the attention plugin node failed in ONNX Runtime: {_op_errors[0]}") from _op_errors[0]
        for layer, pool in enumerate(pools):
            kv_cache[layer].copy_(torch.from_numpy(pool))
        return torch.from_numpy(logits)
