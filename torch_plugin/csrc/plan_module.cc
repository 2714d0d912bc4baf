// ckpt_offload._plan: the offload planner (offload_core/planner.h) for Python, without torch.
//
// Contract
// - run(args) takes offload_plan's flags (argv without the program name) and returns exactly
//   what offload_plan prints for them: the table, the JSON line with --json, or the usage
//   text with --help. The flags, their checks and every figure are the planner's own.
// - A bad flag raises ValueError with the planner's message (it names the flag); a failure
//   of planning itself raises RuntimeError. offload_plan exits 2 and 1 for those.
// - The simulation runs without the GIL.
// - choose_numa_node(pci_bus_id) is the engine's own choice of NUMA node for a GPU's pinned
//   memory (offload_core/numa.h), for `python -m ckpt_offload.doctor`: (node or None, reason).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "offload_core/numa.h"
#include "offload_core/planner.h"

namespace py = pybind11;

namespace {

std::string Run(const std::vector<std::string>& args) {
  namespace planner = ckpt_offload::planner;
  const absl::StatusOr<planner::PlanRequest> request = planner::ParsePlanArgs(args);
  if (!request.ok()) throw py::value_error(std::string(request.status().message()));
  if (request->help) return planner::PlanUsage();
  absl::StatusOr<planner::Plan> plan;
  {
    py::gil_scoped_release release;
    plan = planner::MakePlan(request->input);
  }
  if (!plan.ok()) throw std::runtime_error(std::string(plan.status().message()));
  return request->json ? planner::FormatPlanJson(request->input, *plan)
                       : planner::FormatPlanTable(request->input, *plan);
}

}  // namespace

PYBIND11_MODULE(_plan, m) {
  m.doc() = "The offload planner (offload_core/planner.h); no torch needed.";
  m.def("run", &Run, py::arg("args"),
        "offload_plan's output for these flags; ValueError names a bad flag.");
  m.def("usage", &ckpt_offload::planner::PlanUsage, "offload_plan's --help text.");
  m.def("preset_names", &ckpt_offload::planner::PresetNames, "The --preset names.");
  m.def(
      "choose_numa_node",
      [](const std::string& pci_bus_id, const std::string& sysfs_root) {
        const ckpt_offload::numa::NumaChoice choice =
            ckpt_offload::numa::ChooseNumaNode(pci_bus_id, sysfs_root);
        return py::make_tuple(
            choice.node.has_value() ? py::object(py::int_(*choice.node)) : py::object(py::none()),
            choice.reason);
      },
      py::arg("pci_bus_id"),
      py::arg("sysfs_root") = std::string(ckpt_offload::numa::kDefaultSysfsRoot),
      "The engine's NUMA node for the GPU at pci_bus_id: (node or None, reason).");
}
