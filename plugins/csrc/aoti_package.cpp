// torch.classes.kilnlm.AotiPackage: a loaded AOTInductor engine package whose forward runs with the
// Python GIL released.
//
// torch._inductor.aoti_load_package's runner (torch 2.13) calls the compiled model while holding the GIL,
// so for the whole of every forward (3-10 ms for SmolLM2 on CPU) no other Python thread of the process
// runs: not the threads that submit requests and stream responses (the executor's clients, the Triton
// Python backend's), nor a metrics or health endpoint. Calling a TorchScript custom class method from
// Python releases the GIL around the C++ call, so this class only wraps torch's own loader
// (torch::inductor::AOTIModelPackageLoader, the one aoti_load_package uses: same extraction of the
// package into a temporary directory, removed when the object is destroyed) and exposes its flat-tensor
// run.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kiln_aoti {

struct AotiPackage : torch::CustomClassHolder {
  explicit AotiPackage(const std::string& package_path)
      : loader_(std::make_unique<torch::inductor::AOTIModelPackageLoader>(package_path)) {}

  // The compiled forward over its flattened inputs; returns its flattened outputs. Errors (a c10::Error
  // from the model or a kernel) reach Python as RuntimeError.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) { return loader_->run(inputs); }

  // [begin, end) addresses spanned by the model's CPU constants (its weights), for
  // kilnlm.runtime.memory.advise_huge_pages; [0, 0] when it has none.
  std::vector<int64_t> constants_span() {
    uintptr_t begin = UINTPTR_MAX, end = 0;
    for (const auto& entry : loader_->get_runner()->extract_constants_map(/*use_inactive=*/false)) {
      const at::Tensor& t = entry.second;
      if (!t.defined() || !t.device().is_cpu() || t.nbytes() == 0) continue;
      const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
      begin = std::min(begin, first);
      end = std::max(end, first + t.nbytes());
    }
    if (end == 0) return {0, 0};
    return {static_cast<int64_t>(begin), static_cast<int64_t>(end)};
  }

 private:
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

}  // namespace kiln_aoti

TORCH_LIBRARY_FRAGMENT(kilnlm, m) {
  m.class_<kiln_aoti::AotiPackage>("AotiPackage")
      .def(torch::init<std::string>())
      .def("run", &kiln_aoti::AotiPackage::run)
      .def("constants_span", &kiln_aoti::AotiPackage::constants_span);
}
