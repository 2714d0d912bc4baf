// offload_plan: predicts activation offload for a model shape (see planner.h).
//
//   bazel run //offload_core:offload_plan -- --preset=llama-70b --seq=131072
//
// Exit status: 0 on success, 2 for a bad flag (the message names it), 1 when planning
// itself failed.
#include <cstdio>
#include <string>
#include <vector>

#include "offload_core/planner.h"

int main(int argc, char** argv) {
  using ckpt_offload::planner::FormatPlanJson;
  using ckpt_offload::planner::FormatPlanTable;
  using ckpt_offload::planner::MakePlan;
  using ckpt_offload::planner::ParsePlanArgs;
  using ckpt_offload::planner::PlanUsage;

  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto request = ParsePlanArgs(args);
  if (!request.ok()) {
    std::fprintf(stderr, "offload_plan: %s\n(--help lists the flags)\n",
                 std::string(request.status().message()).c_str());
    return 2;
  }
  if (request->help) {
    std::fputs(PlanUsage().c_str(), stdout);
    return 0;
  }
  const auto plan = MakePlan(request->input);
  if (!plan.ok()) {
    std::fprintf(stderr, "offload_plan: %s\n", std::string(plan.status().message()).c_str());
    return 1;
  }
  const std::string text = request->json ? FormatPlanJson(request->input, *plan)
                                         : FormatPlanTable(request->input, *plan);
  std::fputs(text.c_str(), stdout);
  return 0;
}
