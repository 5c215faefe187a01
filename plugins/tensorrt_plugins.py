"""kilnlm's TensorRT plugins, through TensorRT's Python plugin API (``tensorrt.plugin``, TensorRT >= 10.12).

The TensorRT target lowers each ``kilnlm.paged_attention`` node into two plugin nodes
(:mod:`kilnlm.builder.targets.tensorrt_lowering`); this module registers both in the ``kilnlm`` namespace,
each with a shape-and-type description (``tensorrt.plugin.register``) and an ahead-of-time implementation
(``tensorrt.plugin.aot_impl``) that returns the Triton kernel of :func:`kilnlm.plugins.gpu.tensorrt_kernels`
compiled to PTX for the build's GPU, with its launch grid and integer arguments as TensorRT shape
expressions. TensorRT embeds the PTX in the plan, so the serialized engine carries its kernels and runs
without Python or Triton at inference::

    kilnlm::paged_kv_write(k, v, cos, sin, slot_mapping, past_key_value, kv_scale) -> present_key_value
        (aliases past_key_value: TensorRT's aliased plugin I/O, PreviewFeature.ALIASED_PLUGIN_IO_10_03)
        grid (T,), extra args (num_blocks,)
    kilnlm::paged_attention_core(q, cos, sin, key_value, block_tables, cu_seqlens_q, seq_lens_kv, kv_scale;
                                 scale: float) -> output like q
        grid (T // (64 // group) + B, num_kv_heads), extra args (num_blocks, B)

The head counts, head_dim, tokens_per_block and block_tables' width are static dimensions of the engine and
become the kernels' constexprs; T, B and num_blocks are dynamic. ONNX's plugin lookup attributes
(``plugin_namespace``, ``plugin_version`` = :data:`TENSORRT_LOOKUP_VERSION`, ``aot``) are not fields of these
plugins.

Written against TensorRT's documented API and the Python sources of its ``tensorrt.plugin`` module; no
machine here has TensorRT, so this module has not run (docs/targets.md says what was verified where).
Importing it needs nothing; :func:`register_tensorrt_plugins` imports tensorrt and Triton.
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin reads the decorated functions' annotations
# as objects (inspect.signature), and string annotations would fail its validation.
import threading

# The version tensorrt.plugin gives every plugin it registers (its creators report "1" whatever the definition):
# the ``plugin_version`` an ONNX node must carry for TensorRT's parser to find the plugin. Changes to kilnlm's
# kernels are versioned by kilnlm.plugins.schema.TENSORRT_PLUGIN_VERSIONS, which the manifest records.
TENSORRT_LOOKUP_VERSION = "1"

_LOCK = threading.Lock()
_REGISTERED: list[int] = []  # the arch the plugins were registered for (TensorRT keeps one registration)


def _static(desc, axis: int) -> int:
    """A static dimension of a plugin tensor (its shape expression is a constant). Raises ValueError."""
    expr = desc.shape_expr[axis]
    if not expr.is_constant():
        raise ValueError(f"kilnlm TensorRT plugin: dimension {axis} of a {len(desc.shape_expr)}-d input must be "
                         "static (the engine's head counts, head_dim and block size are build-time constants)")
    return expr.constant_value()


def register_tensorrt_plugins(arch: int) -> None:
    """Register ``kilnlm::paged_kv_write`` and ``kilnlm::paged_attention_core`` with TensorRT's plugin
    registry, their AOT implementations compiling for ``GPUTarget("cuda", arch, 32)`` (``arch`` = 10 * major
    + minor of the build GPU's compute capability, e.g. 90). Idempotent for one arch. Raises ImportError
    without tensorrt (>= 10.12, which has ``tensorrt.plugin.aot_impl``) or Triton, and RuntimeError when
    asked for a second arch in one process."""
    from typing import Tuple, Union

    import tensorrt as trt
    import tensorrt.plugin as trtp

    from kilnlm.plugins.gpu import AttentionShape, tensorrt_kernels

    with _LOCK:
        if _REGISTERED:
            if _REGISTERED[0] != arch:
                raise RuntimeError(f"kilnlm's TensorRT plugins are registered for sm_{_REGISTERED[0]} in this "
                                   f"process; build for sm_{arch} in another process")
            return
        formats = {trt.float32: "float32", trt.bfloat16: "bfloat16", trt.fp8: "fp8", trt.int8: "int8"}

        def shape_of(q_or_k, k, pool) -> AttentionShape:
            for desc in (q_or_k, pool):
                if desc.dtype not in formats:
                    raise ValueError(f"kilnlm TensorRT plugin: unsupported tensor type {desc.dtype}")
            return AttentionShape(num_heads=_static(q_or_k, 1), num_kv_heads=_static(k, 1), head_dim=_static(k, 2),
                                  tokens_per_block=_static(pool, 2), act_dtype=formats[q_or_k.dtype],
                                  kv_format=formats[pool.dtype])

        def launch(kernel, num_tokens, num_seqs, extra: list):
            compiled = kernel.compile(arch)
            params = trtp.KernelLaunchParams()
            grid_x, grid_y = kernel.grid(num_tokens, num_seqs)
            params.grid_x, params.grid_y = grid_x, grid_y
            params.block_x = compiled["num_warps"] * 32
            params.shared_mem = compiled["shared_bytes"]
            args = trtp.SymIntExprs(len(extra))
            for index, expr in enumerate(extra):
                args[index] = trtp.SymInt32(expr)
            return compiled["name"], compiled["ptx"], params, args

        @trtp.register("kilnlm::paged_kv_write")
        def paged_kv_write_desc(k: trtp.TensorDesc, v: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
                                slot_mapping: trtp.TensorDesc, past_key_value: trtp.TensorDesc,
                                kv_scale: trtp.TensorDesc) -> trtp.TensorDesc:
            return past_key_value.aliased()

        @trtp.aot_impl("kilnlm::paged_kv_write")
        def paged_kv_write_aot(k: trtp.TensorDesc, v: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
                               slot_mapping: trtp.TensorDesc, past_key_value: trtp.TensorDesc,
                               kv_scale: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc], tactic: int
                               ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
            kernel = tensorrt_kernels(shape_of(k, k, past_key_value), 1.0, 1)["paged_kv_write"]
            return launch(kernel, k.shape_expr[0], None, [past_key_value.shape_expr[1]])

        @trtp.register("kilnlm::paged_attention_core")
        def paged_attention_core_desc(q: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
                                      key_value: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                                      cu_seqlens_q: trtp.TensorDesc, seq_lens_kv: trtp.TensorDesc,
                                      kv_scale: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
            return q.like()

        @trtp.aot_impl("kilnlm::paged_attention_core")
        def paged_attention_core_aot(q: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
                                     key_value: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                                     cu_seqlens_q: trtp.TensorDesc, seq_lens_kv: trtp.TensorDesc,
                                     kv_scale: trtp.TensorDesc, scale: float, outputs: Tuple[trtp.TensorDesc],
                                     tactic: int
                                     ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
            # key_value [2, num_blocks, tokens_per_block, num_kv_heads, head_dim]: axis 3 is num_kv_heads
            shape = AttentionShape(num_heads=_static(q, 1), num_kv_heads=_static(key_value, 3),
                                   head_dim=_static(q, 2), tokens_per_block=_static(key_value, 2),
                                   act_dtype=formats[q.dtype], kv_format=formats[key_value.dtype])
            kernel = tensorrt_kernels(shape, scale, _static(block_tables, 1))["paged_attention_core"]
            num_seqs = seq_lens_kv.shape_expr[0]
            return launch(kernel, q.shape_expr[0], num_seqs, [key_value.shape_expr[1], num_seqs])

        del paged_kv_write_desc, paged_kv_write_aot, paged_attention_core_desc, paged_attention_core_aot  # registered
        _REGISTERED.append(arch)


__all__ = ["TENSORRT_LOOKUP_VERSION", "register_tensorrt_plugins"]
