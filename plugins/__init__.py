"""kilnlm.plugins: custom ops the engine calls (paged attention, the float and quantized GEMMs, the
tensor-parallel collectives).

Importing this package declares the op schemas (``schema.py``). ``load_cpu_kernels()`` builds (once,
cached) and loads the C++ CPU kernels that the CPU target's compiled engines call; ``reference.py``
holds the plain-torch oracles; ``set_tensor_parallel_group()`` (``collectives.py``) says over which
torch.distributed group the collectives run. Imports neither kilnlm.builder nor kilnlm.runtime.
"""

from kilnlm.plugins.collectives import set_tensor_parallel_group, tensor_parallel_group
from kilnlm.plugins.cpu import KernelBuildError, load_cpu_kernels
from kilnlm.plugins.reference import (
    KV_CACHE_QMAX,
    all_gather_reference,
    all_reduce_reference,
    apply_rope_reference,
    fitting_kv_scale,
    fp8_linear_reference,
    fp8_rowwise_linear_reference,
    fp8_token_scales_reference,
    gemm_reference,
    int4_linear_reference,
    int8_linear_reference,
    int8_sq_linear_reference,
    pack_int4,
    paged_attention_reference,
    quantize_fp8_reference,
    quantize_int8_reference,
    quantize_kv_pool_reference,
    quantize_kv_reference,
    unpack_int4,
)
from kilnlm.plugins.schema import PLUGIN_ACCEPTED_VERSIONS, PLUGIN_VERSIONS

__all__ = [
    "KV_CACHE_QMAX",
    "KernelBuildError",
    "load_cpu_kernels",
    "PLUGIN_ACCEPTED_VERSIONS",
    "PLUGIN_VERSIONS",
    "all_gather_reference",
    "all_reduce_reference",
    "apply_rope_reference",
    "fitting_kv_scale",
    "fp8_linear_reference",
    "fp8_rowwise_linear_reference",
    "fp8_token_scales_reference",
    "gemm_reference",
    "int4_linear_reference",
    "int8_linear_reference",
    "int8_sq_linear_reference",
    "pack_int4",
    "paged_attention_reference",
    "quantize_fp8_reference",
    "quantize_int8_reference",
    "quantize_kv_pool_reference",
    "quantize_kv_reference",
    "set_tensor_parallel_group",
    "tensor_parallel_group",
    "unpack_int4",
]
