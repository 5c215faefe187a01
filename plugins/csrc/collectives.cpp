// kilnlm::all_reduce and kilnlm::all_gather, CPU kernels (schemas: kilnlm/plugins/schema.py): Megatron-style
// tensor parallelism's two collectives, run over the process's tensor-parallel group through c10d (gloo on
// CPU; a GPU target binds the same schemas to NCCL).
//
// The group: kilnlm.plugins.set_tensor_parallel_group(group) hands its name (ProcessGroup.group_name) to
// set_tensor_parallel_group_name below, and each call resolves that name in c10d's group registry
// (GroupRegistry.hpp; torch.distributed registers every group it creates, the default one included, under
// its group_name, and unregisters it when destroy_process_group destroys it). The kernels keep no
// reference to the group: a destroyed group is an error naming the op, not a dangling pointer.
//
// Each call blocks until the collective completes (work->wait()). The group's own timeout applies (the
// one given to init_process_group / new_group): a peer that exited makes gloo fail at once ("Connection
// closed by peer"), one that never joins makes it fail after the timeout; never a hang. Every failure is
// rethrown as a c10::Error whose message starts with the op's name; the C shims turn it into
// AOTI_TORCH_FAILURE with the message kept (c_shim.h).

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "c_shim.h"

namespace kiln_collectives {

namespace {

std::mutex group_mutex;
std::string group_name;  // empty: no tensor-parallel group set in this process

c10::intrusive_ptr<c10d::ProcessGroup> tensor_parallel_group(const char* op) {
  std::string name;
  {
    std::lock_guard<std::mutex> lock(group_mutex);
    name = group_name;
  }
  TORCH_CHECK(!name.empty(), op, ": no tensor-parallel group is set in this process: create it with "
              "torch.distributed (init_process_group / new_group) and call "
              "kilnlm.plugins.set_tensor_parallel_group(group) before running the engine");
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception& exc) {
    TORCH_CHECK(false, op, ": the tensor-parallel group '", name, "' is no longer registered (destroyed?): "
                "call kilnlm.plugins.set_tensor_parallel_group with a live group (", exc.what(), ")");
  }
}

// Runs the collective of fn (returning its Work) and waits for it; any failure becomes an error naming op.
template <class Fn>
void run(const char* op, Fn&& fn) {
  try {
    fn()->wait();
  } catch (const c10::Error& exc) {
    TORCH_CHECK(false, op, ": the collective failed: ", exc.what_without_backtrace());
  } catch (const std::exception& exc) {
    TORCH_CHECK(false, op, ": the collective failed: ", exc.what());
  }
}

void check_input(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU kernel): x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
}

}  // namespace

void set_tensor_parallel_group_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(group_mutex);
  group_name = name;
}

// y = sum of x over the group's ranks, in x's dtype (gloo adds bfloat16 in bfloat16, one rounding per
// addition: with 2 ranks, the float32 sum rounded once). x: any shape; y: a new tensor of x's shape.
at::Tensor all_reduce_cpu(const at::Tensor& x) {
  constexpr const char* op = "kilnlm::all_reduce";
  check_input(op, x);
  const auto group = tensor_parallel_group(op);
  std::vector<at::Tensor> tensors{x.clone(at::MemoryFormat::Contiguous)};  // reduced in place
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  run(op, [&] { return group->allreduce(tensors, options); });
  return tensors[0];
}

// x [rows, cols] -> y [rows, tp_size * cols]: y[:, r * cols:(r + 1) * cols] is rank r's x.
at::Tensor all_gather_cpu(const at::Tensor& x, int64_t tp_size) {
  constexpr const char* op = "kilnlm::all_gather";
  check_input(op, x);
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, cols], got ", x.sizes());
  const auto group = tensor_parallel_group(op);
  TORCH_CHECK(group->getSize() == tp_size, op, ": the engine was compiled for tp_size=", tp_size,
              " but the tensor-parallel group '", group->getGroupName(), "' has ", group->getSize(),
              " ranks: run it with a group of ", tp_size, " ranks");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor input = x.contiguous();
  at::Tensor gathered = at::empty({tp_size * rows, cols}, x.options());  // [tp_size * rows, cols], rank-major
  run(op, [&] { return group->all_gather_single(gathered, input); });
  return gathered.view({tp_size, rows, cols}).permute({1, 0, 2}).reshape({rows, tp_size * cols});
}

}  // namespace kiln_collectives

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) {
  m.impl("all_reduce", &kiln_collectives::all_reduce_cpu);
  m.impl("all_gather", &kiln_collectives::all_gather_cpu);
}

KILN_C_SHIM aoti_torch_cpu_all_reduce(AtenTensorHandle x, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] { return kiln_collectives::all_reduce_cpu(tensor(x)); });
}

KILN_C_SHIM aoti_torch_cpu_all_gather(AtenTensorHandle x, int64_t tp_size, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] { return kiln_collectives::all_gather_cpu(tensor(x), tp_size); });
}
