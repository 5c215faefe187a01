// kilnlm's AotiPackage: a loaded AOTInductor engine package whose forward runs with the Python GIL
// released. The kernels library is a Python extension module for this class (kilnlm.plugins.cpu imports
// it) and for set_tensor_parallel_group_name, which kilnlm.plugins.set_tensor_parallel_group calls
// (collectives.cpp); the kernels themselves register with the dispatcher (TORCH_LIBRARY_IMPL) as before.
//
// torch._inductor.aoti_load_package's runner (torch 2.13) calls the compiled model while holding the GIL,
// so for the whole of every forward (3-10 ms for SmolLM2 on CPU) no other Python thread of the process
// runs: not the threads that submit requests and stream responses (the executor's clients, the Triton
// Python backend's), nor a metrics or health endpoint. This class wraps torch's own loader
// (torch::inductor::AOTIModelPackageLoader, the one aoti_load_package uses: same extraction of the
// package into a temporary directory, removed when the object is destroyed) and exposes its flat-tensor
// run with the GIL released.
//
// A pybind11 class, not a TorchScript custom class (torch.classes): calling a custom class method from
// Python goes through TorchScript's method lookup and a schema-checked argument stack, where pybind11
// converts the tensor list directly: ~50-60 us less per forward call (docs/performance.md).

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/extension.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kiln_aoti {

class AotiPackage {
 public:
  explicit AotiPackage(const std::string& package_path)
      : loader_(std::make_unique<torch::inductor::AOTIModelPackageLoader>(package_path)) {}

  // The compiled forward over its flattened inputs; returns its flattened outputs. Errors (a c10::Error
  // from the model or a kernel) reach Python as RuntimeError; a kilnlm op's message crosses its C shim
  // in torch's per-thread shim exception state (c_shim.h), which torch's runner puts in its error.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) { return loader_->run(inputs); }

  // AOTInductor's CPU model copies its constants into one std::malloc'd blob (torch 2.13, model_base.h
  // RAII_cpuMalloc), each at a 64-byte offset inside it; glibc returns a large block 16 bytes past a page
  // boundary, so every weight row of 64-byte multiples starts 16 bytes into a cache line, and a 64-byte
  // load of it touches two lines. This moves the constants into one buffer aligned to 2 MiB (huge pages
  // from the first touch, MADV_HUGEPAGE), each at a 64-byte boundary, through AOTInductor's own weight
  // swap (the inactive constant buffer, user-managed tensors, swap, free of the old blob). Returns the
  // bytes moved, 0 when every constant already starts on a 64-byte boundary, or -1 when one is not a
  // plain contiguous CPU tensor (then nothing changes).
  int64_t realign_constants() {
    constexpr size_t kAlign = 64, kHugePage = size_t{2} << 20;
    auto* runner = loader_->get_runner();
    const auto by_fqn = runner->extract_constants_map(/*use_inactive=*/false);
    const auto fqns = runner->getConstantNamesToOriginalFQNs();
    size_t total = 0;
    bool misaligned = false;
    for (const auto& [name, fqn] : fqns) {
      const auto it = by_fqn.find(fqn);
      if (it == by_fqn.end()) return -1;
      const at::Tensor& t = it->second;
      if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.storage_offset() != 0) return -1;
      misaligned = misaligned || reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlign != 0;
      total += (t.nbytes() + kAlign - 1) / kAlign * kAlign;
    }
    if (!misaligned || total == 0) return 0;
    const size_t size = (total + kHugePage - 1) / kHugePage * kHugePage;
    void* buffer = std::aligned_alloc(kHugePage, size);
    TORCH_CHECK(buffer != nullptr, "kilnlm: could not allocate ", size, " bytes for the engine's weights");
    constants_buffer_.reset(buffer);
    madvise(buffer, size, MADV_HUGEPAGE);  // a hint: without transparent huge pages the copy still aligns
    // The copy in 2 MiB pieces over the process's threads: most of its time is the kernel faulting in the
    // buffer's fresh huge pages, which runs in parallel (271 MB on the Zen 4 VM, alternating: one thread
    // 0.49-0.96 s, two 0.36-0.44 s).
    struct Piece {
      const uint8_t* src;
      uint8_t* dst;
      size_t bytes;
    };
    std::vector<Piece> pieces;
    size_t offset = 0;
    for (const auto& [name, fqn] : fqns) {
      const at::Tensor& t = by_fqn.at(fqn);
      auto* dst = static_cast<uint8_t*>(buffer) + offset;
      const auto* src = static_cast<const uint8_t*>(t.data_ptr());
      for (size_t done = 0; done < t.nbytes(); done += kHugePage) {
        pieces.push_back({src + done, dst + done, std::min(kHugePage, t.nbytes() - done)});
      }
      realigned_.emplace(name, at::from_blob(dst, t.sizes(), t.strides(), t.options()));
      offset += (t.nbytes() + kAlign - 1) / kAlign * kAlign;
    }
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    });
    runner->update_constant_buffer(realigned_, /*use_inactive=*/true, /*validate_full_updates=*/true,
                                   /*user_managed=*/true);
    runner->swap_constant_buffer();
    runner->free_inactive_constant_buffer();
    return static_cast<int64_t>(total);
  }

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
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  // Declared before loader_, so destroyed after it: the model's constants live here after realign_constants.
  std::unique_ptr<void, FreeDeleter> constants_buffer_;
  std::unordered_map<std::string, at::Tensor> realigned_;  // the model holds pointers to these tensors
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

}  // namespace kiln_aoti

namespace kiln_collectives {
void set_tensor_parallel_group_name(const std::string& name);  // collectives.cpp
}  // namespace kiln_collectives

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<kiln_aoti::AotiPackage>(m, "AotiPackage")
      // Loading and realigning release the GIL too: the executor parses the tokenizer meanwhile.
      .def(pybind11::init<std::string>(), pybind11::arg("package_path"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run", &kiln_aoti::AotiPackage::run, pybind11::arg("inputs"),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("constants_span", &kiln_aoti::AotiPackage::constants_span)
      .def("realign_constants", &kiln_aoti::AotiPackage::realign_constants,
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_tensor_parallel_group_name", &kiln_collectives::set_tensor_parallel_group_name,
        pybind11::arg("group_name"),
        "The c10d group name (ProcessGroup.group_name) of the process's tensor-parallel group, which "
        "kilnlm::all_reduce / all_gather resolve on every call; empty: none.");
}
