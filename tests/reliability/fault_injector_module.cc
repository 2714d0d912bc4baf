// fault_injector: the test-only fault injector (offload_core/fault_injection.h) for Python
// tests. Importing it installs the injector in ckpt_offload._C's hook point (the capsule
// _C._fault_hook); the shipped extension carries the hook points only.
//
//   fault_injector.fail_next("copy", 2)   # the next 2 device copies fail
//   fault_injector.clear_faults()
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "offload_core/fault_injection.h"

namespace py = pybind11;

namespace ckpt_offload::faults {
namespace {

Fault ParseFault(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Fault::kCount); ++i) {
    auto fault = static_cast<Fault>(i);
    if (name == Name(fault)) return fault;
  }
  throw py::value_error("fault must be 'host_allocation', 'copy' or 'event' (got '" + name + "')");
}

}  // namespace
}  // namespace ckpt_offload::faults

PYBIND11_MODULE(fault_injector, m) {
  namespace faults = ckpt_offload::faults;
  m.doc() = "Test-only fault injection for ckpt_offload._C";
  py::object hook = py::module_::import("ckpt_offload._C").attr("_fault_hook");
  void* slot = PyCapsule_GetPointer(hook.ptr(), "ckpt_offload.fault_hook");
  if (slot == nullptr) throw py::error_already_set();
  static_cast<std::atomic<faults::Injector>*>(slot)->store(&faults::ConsumePending,
                                                           std::memory_order_release);
  m.def(
      "fail_next",
      [](const std::string& fault, int64_t count) {
        faults::FailNext(faults::ParseFault(fault), count);
      },
      py::arg("fault"), py::arg("count") = 1, "The next `count` operations of kind `fault` fail.");
  m.def("clear_faults", &faults::ClearAll, "Cancels every pending failure.");
}
