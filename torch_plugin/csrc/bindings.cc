// ckpt_offload._C: the offloader and its saved-tensor hooks, bound with pybind11. The hooks
// are C++ (pack/unpack run no Python code per tensor).
#include <torch/extension.h>
#include <torch/version.h>

#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "offload_core/device.h"
#include "offload_core/fault_hooks.h"
#include "torch_plugin/csrc/tensor_offloader.h"

namespace py = pybind11;

namespace ckpt_offload::torch_plugin {
namespace {

// What pack returns for a Python tensor subclass (nn.Parameter, DTensor, ...): the object
// itself when it is a leaf, else its detach() (no grad_fn: see tensor_offloader.h), and
// autograd's version check.
struct KeptObject {
  py::object held;
  VersionCheck version;
};

// Collects the C++ warnings (TORCH_WARN) raised during one call and issues them through
// Python's `warnings` afterwards, so filters, pytest.warns and logging see them; without
// it they would go to stderr only. The handler is the calling thread's (GIL held).
class PythonWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { warnings_.push_back(warning); }

  // Throws error_already_set when a filter turned a warning into an exception.
  void Issue() {
    for (const c10::Warning& warning : warnings_) {
      PyObject* category = std::holds_alternative<c10::Warning::DeprecationWarning>(warning.type())
                               ? PyExc_DeprecationWarning
                               : PyExc_UserWarning;
      if (PyErr_WarnEx(category, warning.msg().c_str(), 1) != 0) {
        warnings_.clear();
        throw py::error_already_set();
      }
    }
    warnings_.clear();
  }

 private:
  std::vector<c10::Warning> warnings_;
};

template <typename Fn>
auto WithPythonWarnings(Fn&& fn) {
  PythonWarnings warnings;
  if constexpr (std::is_void_v<decltype(fn())>) {
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      fn();
    }
    warnings.Issue();
  } else {
    auto result = [&] {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      return fn();
    }();
    warnings.Issue();
    return result;
  }
}

Backend ParseBackend(const std::string& name) {
  if (name == "cuda") return Backend::kCuda;
  if (name == "host") return Backend::kHost;
  throw py::value_error("backend must be 'cuda' or 'host' (got '" + name + "')");
}

Scope ParseScope(const std::string& name) {
  if (name == "checkpoint_inputs") return Scope::kCheckpointInputs;
  if (name == "all") return Scope::kAll;
  throw py::value_error("scope must be 'checkpoint_inputs' or 'all' (got '" + name + "')");
}

// The figures of Offloader.stats(), in order: the one list of stat keys. Each entry is
// X(key, the value in OffloaderStats `s`); ckpt_offload.STAT_KEYS is read from _C.STAT_KEYS.
#define CKPT_OFFLOAD_STATS(X)                                        \
  X(offloaded_tensors, s.engine.offloaded_tensors)                   \
  X(offloaded_bytes, s.engine.offloaded_bytes)                       \
  X(restored_tensors, s.engine.restored_tensors)                     \
  X(restored_bytes, s.engine.restored_bytes)                         \
  X(kept_resident_tensors, s.engine.kept_resident_tensors)           \
  X(prefetched_tensors, s.engine.prefetched_tensors)                 \
  X(exposed_wait_ms, s.engine.exposed_wait_ms)                       \
  X(cap_fallbacks, s.engine.cap_fallbacks)                           \
  X(reclaimed_tensors, s.engine.reclaimed_tensors)                   \
  X(groups, s.engine.groups)                                         \
  X(device_held_bytes, s.engine.device_held_bytes)                   \
  X(peak_device_held_bytes, s.engine.peak_device_held_bytes)         \
  X(host_reserved_bytes, s.engine.arena.reserved_bytes)              \
  X(host_live_bytes, s.engine.arena.live_bytes)                      \
  X(host_peak_bytes, s.engine.arena.peak_live_bytes)                 \
  X(host_live_blocks, s.engine.arena.live_blocks)                    \
  X(pinned_allocations, s.engine.arena.backend_allocations)          \
  X(pinned_allocation_seconds, s.engine.arena.backend_alloc_seconds) \
  X(host_cap_rejections, s.engine.arena.cap_rejections)              \
  X(host_backend_failures, s.engine.arena.backend_failures)          \
  X(packed_tensors, s.packed_tensors)                                \
  X(skipped_tensors, s.skipped_tensors)                              \
  X(shared_storage_hits, s.shared_storage_hits)                      \
  X(head_offloaded_tensors, s.engine.eager_offloaded_tensors)        \
  X(head_offloaded_bytes, s.engine.eager_offloaded_bytes)            \
  X(head_restored_tensors, s.engine.eager_restored_tensors)          \
  X(head_restored_bytes, s.engine.eager_restored_bytes)              \
  X(head_kept_tensors, s.head_kept_tensors)                          \
  X(head_cap_fallbacks, s.engine.eager_cap_fallbacks)

py::dict StatsDict(const OffloaderStats& s) {
  py::dict d;
#define CKPT_OFFLOAD_STAT_ITEM(key, value) d[#key] = value;
  CKPT_OFFLOAD_STATS(CKPT_OFFLOAD_STAT_ITEM)
#undef CKPT_OFFLOAD_STAT_ITEM
  return d;
}

py::tuple StatKeys() {
#define CKPT_OFFLOAD_STAT_KEY(key, value) #key,
  static constexpr const char* kKeys[] = {CKPT_OFFLOAD_STATS(CKPT_OFFLOAD_STAT_KEY)};
#undef CKPT_OFFLOAD_STAT_KEY
  py::tuple keys(std::size(kKeys));
  for (size_t i = 0; i < std::size(kKeys); ++i) keys[i] = py::str(kKeys[i]);
  return keys;
}

}  // namespace
}  // namespace ckpt_offload::torch_plugin

PYBIND11_MODULE(_C, m) {
  using namespace ckpt_offload::torch_plugin;
  m.doc() = "ckpt_offload native engine: pinned host arena, transfer scheduler, hooks";

  py::class_<PackedTensor, std::shared_ptr<PackedTensor>>(m, "PackedTensor")
      .def_property_readonly("shape", [](const PackedTensor& p) { return p.sizes; })
      .def_property_readonly("stride", [](const PackedTensor& p) { return p.strides; });
  py::class_<KeptTensor, std::shared_ptr<KeptTensor>>(m, "KeptTensor");
  py::class_<KeptObject>(m, "KeptObject");

  py::class_<TensorOffloader, std::shared_ptr<TensorOffloader>>(m, "Offloader")
      .def(py::init([](int keep_last, int prefetch_depth, int64_t min_offload_bytes,
                       uint64_t host_memory_limit, const std::string& backend,
                       const std::string& scope, int max_inflight_d2h_groups, bool offload_head) {
             OffloaderConfig config;
             config.keep_last = keep_last;
             config.prefetch_depth = prefetch_depth;
             config.min_offload_bytes = min_offload_bytes;
             config.host_memory_limit = host_memory_limit;
             config.backend = ParseBackend(backend);
             config.scope = ParseScope(scope);
             config.max_inflight_d2h_groups = max_inflight_d2h_groups;
             config.offload_head = offload_head;
             auto made = TensorOffloader::Create(config);
             if (!made.ok()) throw py::value_error(std::string(made.status().message()));
             return *made;
           }),
           py::arg("keep_last"), py::arg("prefetch_depth"), py::arg("min_offload_bytes"),
           py::arg("host_memory_limit"), py::arg("backend"), py::arg("scope"),
           py::arg("max_inflight_d2h_groups") = 2, py::arg("offload_head") = true)
      .def(
          "begin_group",
          [](TensorOffloader& self, const std::vector<at::Tensor>& inputs) {
            WithPythonWarnings([&] { self.BeginGroup(inputs); });
          },
          py::arg("inputs"))
      .def("end_group", [](TensorOffloader& self) { WithPythonWarnings([&] { self.EndGroup(); }); })
      .def(
          "pack",
          [](TensorOffloader& self, py::object obj) -> py::object {
            return WithPythonWarnings([&]() -> py::object {
              // Tensor subclasses (nn.Parameter, including DeepSpeed ZeRO-3 partitioned
              // ones, FSDP2's DTensor, ...) are someone else's memory to manage: left
              // alone. They can still trigger the restore of head tensors saved before them.
              if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
                const at::Tensor& tensor = THPVariable_Unpack(obj.ptr());
                py::object held = obj;
                if (!tensor.is_leaf() || tensor.is_view()) held = obj.attr("detach")();
                if (!THPVariable_Check(held.ptr())) {
                  throw py::type_error("ckpt_offload: detach() of a saved " +
                                       std::string(Py_TYPE(obj.ptr())->tp_name) +
                                       " returned no tensor");
                }
                self.PackForeign(tensor, THPVariable_Unpack(held.ptr()));
                return py::cast(KeptObject{std::move(held), VersionCheck(tensor)});
              }
              SavedTensor saved = self.Pack(THPVariable_Unpack(obj.ptr()));
              if (saved.packed) return py::cast(std::move(saved.packed));
              return py::cast(std::move(saved.kept));
            });
          },
          py::arg("tensor"))
      .def(
          "pack_into_group",
          [](TensorOffloader& self, const at::Tensor& tensor, bool keep_restore) -> py::object {
            return WithPythonWarnings([&]() -> py::object {
              SavedTensor saved = self.PackIntoGroup(tensor, keep_restore);
              if (saved.packed) return py::cast(std::move(saved.packed));
              return py::cast(std::move(saved.kept));
            });
          },
          py::arg("tensor"), py::arg("keep_restore") = false)
      .def(
          "unpack",
          [](TensorOffloader& self, py::object obj) -> py::object {
            return WithPythonWarnings([&]() -> py::object {
              if (py::isinstance<PackedTensor>(obj)) {
                return py::cast(self.Unpack(obj.cast<const PackedTensor&>()));
              }
              if (py::isinstance<KeptTensor>(obj)) {
                return py::cast(self.UnpackKept(obj.cast<const KeptTensor&>()));
              }
              if (py::isinstance<KeptObject>(obj)) {
                const KeptObject& kept = obj.cast<const KeptObject&>();
                const at::Tensor& tensor = THPVariable_Unpack(kept.held.ptr());
                kept.version.Verify(tensor.sizes(), tensor.scalar_type(), tensor.device());
                self.NoteUnpackForeign(tensor);
                return kept.held;
              }
              if (THPVariable_Check(obj.ptr())) return obj;  // not made by pack
              throw py::type_error("ckpt_offload: unpack got a " +
                                   std::string(Py_TYPE(obj.ptr())->tp_name) +
                                   ", which pack did not make");
            });
          },
          py::arg("packed"))
      .def(
          "ineligible_reason",
          [](const TensorOffloader& self, py::object obj) -> std::string {
            if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
              return "nn.Parameter or other tensor subclass (e.g. DTensor)";
            }
            return self.IneligibleReason(THPVariable_Unpack(obj.ptr()));
          },
          py::arg("tensor"))
      .def("begin_step", &TensorOffloader::BeginStep)
      .def("reset", &TensorOffloader::Reset)
      .def("synchronize", &TensorOffloader::Synchronize)
      .def("stats", [](const TensorOffloader& self) { return StatsDict(self.stats()); })
      .def("reset_stats", &TensorOffloader::ResetStats)
      .def("set_host_memory_limit", &TensorOffloader::SetHostMemoryLimit, py::arg("bytes"))
      .def("set_prefetch_on_acquire", &TensorOffloader::SetPrefetchOnAcquire, py::arg("on"))
      .def("prefetch_ahead", &TensorOffloader::PrefetchAhead)
      .def(
          "reserve_host",
          [](TensorOffloader& self, uint64_t bytes) {
            const absl::Status status = self.ReserveHost(bytes);
            if (!status.ok()) {
              throw std::runtime_error("ckpt_offload: reserving " + std::to_string(bytes) +
                                       " bytes of host pool: " + status.ToString());
            }
          },
          py::arg("bytes"))
      .def_property_readonly("has_engine", &TensorOffloader::has_engine);

  m.def("cuda_support_compiled", &ckpt_offload::CudaSupportCompiled);
  m.attr("STAT_KEYS") = StatKeys();
  // The torch these sources were compiled against: the package compares it with the torch
  // it runs with (ckpt_offload/_native.py).
  m.attr("BUILT_WITH_TORCH") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                               std::to_string(TORCH_VERSION_MINOR) + "." +
                               std::to_string(TORCH_VERSION_PATCH);
  // The fault hook point (offload_core/fault_hooks.h), for the test-only injector module of
  // tests/reliability; this extension installs nothing there.
  m.attr("_fault_hook") = py::reinterpret_steal<py::object>(
      PyCapsule_New(&ckpt_offload::faults::injector, "ckpt_offload.fault_hook", nullptr));
}
