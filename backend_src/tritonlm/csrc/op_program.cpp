// Op programs: the dispatcher ops of one model step, recorded once with their arguments and
// replayed from C++ with no Python in between (engine/op_programs.py records them). On CPU this
// is what a CUDA graph is for a GPU: a decode step's few hundred small ops cost their own time
// only, not the interpreter's per op. Every argument tensor stays the one recorded, so a replay
// reads what the caller copied into the step's input tensors and writes where the recorded run
// wrote; a functional op's fresh result is copied into the tensor the recorded run returned,
// which the later ops (and the caller) hold.
#include <ATen/ScalarOps.h>
#include <ATen/TensorIterator.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstring>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace tritonlm {
namespace {

// A Python number where the schema takes a Tensor (`x * 2`: dispatch modes see the 2 unwrapped),
// wrapped as the argument parser wraps it, so type promotion treats it as a scalar again.
py::tuple wrap_numbers(const c10::FunctionSchema& schema, const py::tuple& args) {
  py::tuple wrapped(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const py::handle arg = args[i];
    const bool number = PyFloat_Check(arg.ptr()) || PyLong_Check(arg.ptr());
    if (number && i < schema.arguments().size() &&
        schema.arguments()[i].type()->kind() == c10::TypeKind::TensorType) {
      auto tensor = c10::scalar_to_tensor(torch::jit::toIValue(arg, c10::NumberType::get()).toScalar());
      tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
      wrapped[i] = py::cast(tensor);
    } else {
      wrapped[i] = arg;
    }
  }
  return wrapped;
}

struct RecordedOp {
  c10::OperatorHandle op;
  torch::jit::Stack arguments;
  std::vector<std::optional<at::Tensor>> results;  // where each replay's results go
};

// A replay's fresh result into the tensor its recording returned: a memcpy where both are plain
// contiguous CPU tensors of one dtype, small enough that copy_ would not split the copy among
// threads (a batch-1 step's few hundred results: copy_'s dispatch and TensorIterator averaged
// 1.5 us each in torch.profiler, 0.4 ms of a 9 ms int4 SmolLM2 step on Zen 3), else copy_.
void copy_into(const at::Tensor& target, const at::Tensor& result) {
  const bool plain = target.layout() == at::kStrided && result.layout() == at::kStrided &&
                     target.is_cpu() && result.is_cpu() && !target.is_quantized() &&
                     target.scalar_type() == result.scalar_type() && !result.is_conj() &&
                     !result.is_neg() && target.is_contiguous() && result.is_contiguous();
  if (plain && result.numel() < at::internal::GRAIN_SIZE) {
    if (result.nbytes() > 0 && target.data_ptr() != result.data_ptr())
      std::memcpy(target.data_ptr(), result.data_ptr(), result.nbytes());
    return;
  }
  target.copy_(result);
}

class OpProgram {
 public:
  void add(const std::string& name, const std::string& overload, const py::tuple& args,
           const py::dict& kwargs, const std::vector<std::optional<at::Tensor>>& results) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(results.size() == schema.returns().size(), "op program: ", name, " returns ",
                schema.returns().size(), " values, ", results.size(), " recorded");
    for (const auto& ret : schema.returns()) {
      TORCH_CHECK(ret.type()->kind() != c10::TypeKind::ListType, "op program: ", name,
                  " returns a list, which a replay cannot copy into place");
    }
    auto stack = torch::jit::createStackForSchema(
        schema, torch::jit::tuple_slice(wrap_numbers(schema, args)), py::reinterpret_borrow<py::kwargs>(kwargs),
        std::nullopt);
    ops_.push_back({op, std::move(stack), results});
  }

  void replay() {
    c10::InferenceMode inference;  // the recorded tensors are inference tensors
    for (auto& recorded : ops_) {
      torch::jit::Stack stack = recorded.arguments;
      recorded.op.callBoxed(stack);
      for (size_t i = 0; i < recorded.results.size(); ++i) {
        const auto& target = recorded.results[i];
        if (!target || !stack[i].isTensor() || stack[i].toTensor().is_same(*target)) continue;
        const auto& result = stack[i].toTensor();
        TORCH_CHECK(result.sizes() == target->sizes(), "op program: ",
                    recorded.op.schema().name(), " returned ", result.sizes(),
                    " where its recording returned ", target->sizes());
        copy_into(*target, result);
      }
    }
  }

  size_t size() const { return ops_.size(); }

  // Takes as this program's own the storages of its tensors that lie at `addresses` (the fresh
  // results of its recording); returns the bytes they need in an arena.
  int64_t adopt_results(const std::vector<int64_t>& addresses) {
    std::unordered_set<int64_t> wanted(addresses.begin(), addresses.end());
    auto adopt = [&](const at::Tensor& t) {
      if (!t.defined() || !t.has_storage()) return;
      c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      const auto address = reinterpret_cast<int64_t>(storage->data());
      if (wanted.erase(address) == 0) return;  // not a fresh result, or adopted already
      owned_.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
    };
    for (const auto& recorded : ops_) {
      for (const auto& value : recorded.arguments) {
        if (value.isTensor()) {
          adopt(value.toTensor());
        } else if (value.isTensorList()) {
          for (const at::Tensor& t : value.toTensorList().vec()) adopt(t);
        } else if (value.isOptionalTensorList()) {
          for (const auto& t : value.toOptionalTensorList().vec())
            if (t) adopt(*t);
        }
      }
      for (const auto& result : recorded.results)
        if (result) adopt(*result);
    }
    int64_t bytes = 0;
    for (const auto& storage : owned_) bytes += aligned(storage->nbytes());
    return bytes;
  }

  // Moves the adopted storages into `arena` (their contents too where `with_contents`), one
  // after another from its start: programs that never run at once share one arena, as CUDA
  // graphs share a pool. The caller keeps the arena alive while the program lives.
  void place_results(const at::Tensor& arena, bool with_contents) {
    auto* base = static_cast<char*>(arena.data_ptr());
    int64_t offset = 0;
    for (const auto& storage : owned_) {
      const int64_t bytes = storage->nbytes();
      TORCH_CHECK(offset + aligned(bytes) <= arena.nbytes(), "op program: an arena of ",
                  arena.nbytes(), " bytes is too small for its results");
      if (with_contents && bytes > 0 && storage->data() != base + offset)
        std::memmove(base + offset, storage->data(), bytes);
      storage->set_data_ptr_noswap(at::DataPtr(base + offset, arena.device()));
      offset += aligned(bytes);
    }
  }

 private:
  static int64_t aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

  std::vector<RecordedOp> ops_;
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> owned_;  // in arena order
};

}  // namespace

void bind_op_program(py::module_& m) {
  py::class_<OpProgram>(m, "OpProgram",
                        "Dispatcher ops recorded with their arguments, replayed in order")
      .def(py::init<>())
      .def("add", &OpProgram::add,
           "Appends op name.overload (e.g. aten::index, Tensor) called with args and kwargs; "
           "results: per returned value the tensor a replay copies it into (None: dropped)",
           py::arg("name"), py::arg("overload"), py::arg("args"), py::arg("kwargs"),
           py::arg("results"))
      .def("replay", &OpProgram::replay, "Runs every op in order, without the GIL",
           py::call_guard<py::gil_scoped_release>())
      .def("adopt_results", &OpProgram::adopt_results,
           "Takes the storages of the recorded tensors at these data addresses (the recording's "
           "fresh results) as the program's own; returns the bytes they need in an arena",
           py::arg("addresses"))
      .def("place_results", &OpProgram::place_results,
           "Moves the adopted storages into the start of arena (a uint8 tensor the caller keeps "
           "alive), with their contents if asked; programs that never run at once can share one",
           py::arg("arena"), py::arg("with_contents"))
      .def("__len__", &OpProgram::size);
}

}  // namespace tritonlm
