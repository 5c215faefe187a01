// C entry points of the kilnlm ops for compiled engines: AOTInductor calls an op listed in
// aot_inductor.custom_ops_to_c_shims as a plain C function, aoti_torch_cpu_<op>, instead of through its
// proxy executor (a boxed call through the dispatcher, ~2 us per call measured on SmolLM2's decode step,
// 151 calls of it). kilnlm.plugins.schema.c_shim_declaration writes each declaration from the op's schema,
// in the convention of torch's generated shims: Tensor -> AtenTensorHandle, Tensor? -> AtenTensorHandle*
// (nullptr for None), int -> int64_t, float -> double, bool -> int32_t, then the returned tensor as
// AtenTensorHandle* ret0. Each op's .cpp defines its shim next to its dispatcher registration.
//
// The engine's .so resolves these symbols when it is loaded, so kilnlm.plugins.cpu makes the kernels
// library's symbols global first. A kernel's exception becomes AOTI_TORCH_FAILURE with its message kept
// in torch's per-thread shim exception state, which torch's runner puts in the error it raises.

#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <optional>
#include <utility>

#define KILN_C_SHIM extern "C" AOTI_TORCH_EXPORT AOTITorchError

namespace kiln_shim {

inline const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}

inline std::optional<at::Tensor> optional_tensor(AtenTensorHandle* handle) {
  return torch::aot_inductor::pointer_to_optional<at::Tensor>(handle);
}

// Runs op() (returning an at::Tensor) and hands its result to the engine as a new handle in *ret0.
template <class Op>
AOTITorchError call(AtenTensorHandle* ret0, Op&& op) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret0 = torch::aot_inductor::new_tensor_handle(op()); });
}

}  // namespace kiln_shim
