// ckpt_offload._C: the offloader and its saved-tensor hooks, bound with pybind11. The hooks
// are C++ (pack/unpack run no Python code per tensor).
#include <torch/extension.h>

#include <string>

#include "offload_core/device.h"
#include "offload_core/fault_injection.h"
#include "torch_plugin/csrc/tensor_offloader.h"

namespace py = pybind11;

namespace ckpt_offload::torch_plugin {
namespace {

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

faults::Fault ParseFault(const std::string& name) {
  for (int i = 0; i < static_cast<int>(faults::Fault::kCount); ++i) {
    auto fault = static_cast<faults::Fault>(i);
    if (name == faults::Name(fault)) return fault;
  }
  throw py::value_error("fault must be 'host_allocation', 'copy' or 'event' (got '" + name +
                        "')");
}

py::dict StatsDict(const OffloaderStats& s) {
  py::dict d;
  const EngineStats& e = s.engine;
  d["offloaded_tensors"] = e.offloaded_tensors;
  d["offloaded_bytes"] = e.offloaded_bytes;
  d["restored_tensors"] = e.restored_tensors;
  d["restored_bytes"] = e.restored_bytes;
  d["kept_resident_tensors"] = e.kept_resident_tensors;
  d["prefetched_tensors"] = e.prefetched_tensors;
  d["exposed_wait_ms"] = e.exposed_wait_ms;
  d["cap_fallbacks"] = e.cap_fallbacks;
  d["reclaimed_tensors"] = e.reclaimed_tensors;
  d["groups"] = e.groups;
  d["device_held_bytes"] = e.device_held_bytes;
  d["peak_device_held_bytes"] = e.peak_device_held_bytes;
  d["host_reserved_bytes"] = e.arena.reserved_bytes;
  d["host_live_bytes"] = e.arena.live_bytes;
  d["host_peak_bytes"] = e.arena.peak_live_bytes;
  d["host_live_blocks"] = e.arena.live_blocks;
  d["pinned_allocations"] = e.arena.backend_allocations;
  d["pinned_allocation_seconds"] = e.arena.backend_alloc_seconds;
  d["host_cap_rejections"] = e.arena.cap_rejections;
  d["host_backend_failures"] = e.arena.backend_failures;
  d["packed_tensors"] = s.packed_tensors;
  d["skipped_tensors"] = s.skipped_tensors;
  d["shared_storage_hits"] = s.shared_storage_hits;
  d["head_offloaded_tensors"] = e.eager_offloaded_tensors;
  d["head_offloaded_bytes"] = e.eager_offloaded_bytes;
  d["head_restored_tensors"] = e.eager_restored_tensors;
  d["head_restored_bytes"] = e.eager_restored_bytes;
  d["head_kept_tensors"] = s.head_kept_tensors;
  d["head_cap_fallbacks"] = e.eager_cap_fallbacks;
  return d;
}

}  // namespace
}  // namespace ckpt_offload::torch_plugin

PYBIND11_MODULE(_C, m) {
  using namespace ckpt_offload::torch_plugin;
  m.doc() = "ckpt_offload native engine: pinned host arena, transfer scheduler, hooks";

  py::class_<PackedTensor, std::shared_ptr<PackedTensor>>(m, "PackedTensor")
      .def_property_readonly("shape", [](const PackedTensor& p) { return p.sizes; })
      .def_property_readonly("stride", [](const PackedTensor& p) { return p.strides; });

  py::class_<TensorOffloader, std::shared_ptr<TensorOffloader>>(m, "Offloader")
      .def(py::init([](int keep_last, int prefetch_depth, int64_t min_offload_bytes,
                       uint64_t host_memory_limit, const std::string& backend,
                       const std::string& scope, int max_inflight_d2h_groups,
                       bool offload_head) {
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
      .def("begin_group", &TensorOffloader::BeginGroup, py::arg("inputs"))
      .def("end_group", &TensorOffloader::EndGroup)
      .def(
          "pack",
          [](TensorOffloader& self, py::object obj) -> py::object {
            // Tensor subclasses (nn.Parameter, including DeepSpeed ZeRO-3 partitioned ones,
            // FSDP2's DTensor, ...) are someone else's memory to manage: leave them alone.
            // They can still trigger the restore of head tensors saved before them.
            if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
              self.PackForeign(THPVariable_Unpack(obj.ptr()));
              return obj;
            }
            auto packed = self.Pack(THPVariable_Unpack(obj.ptr()));
            if (!packed) return obj;
            return py::cast(std::move(packed));
          },
          py::arg("tensor"))
      .def(
          "unpack",
          [](TensorOffloader& self, py::object obj) -> py::object {
            if (!py::isinstance<PackedTensor>(obj)) {
              if (THPVariable_Check(obj.ptr())) self.UnpackKept(THPVariable_Unpack(obj.ptr()));
              return obj;
            }
            return py::cast(self.Unpack(obj.cast<const PackedTensor&>()));
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
      .def_property_readonly("has_engine", &TensorOffloader::has_engine);

  m.def("cuda_support_compiled", &ckpt_offload::CudaSupportCompiled);
  m.def(
      "_testing_fail_next",
      [](const std::string& fault, int64_t count) {
        ckpt_offload::faults::FailNext(ParseFault(fault), count);
      },
      py::arg("fault"), py::arg("count") = 1,
      "Test hook: the next `count` operations of kind `fault` fail.");
  m.def("_testing_clear_faults", &ckpt_offload::faults::ClearAll);
}
