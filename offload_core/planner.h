// Offload planner: predicts what activation offload buys and costs for a model shape that
// need not fit on this machine.
//
// What it computes for one training step (one GPU; every GPU of a data-parallel job does the
// same)
// - Bytes: the saved hidden state of a checkpointed layer is batch * seq * hidden * dtype
//   bytes. Offloading all but the last keep_last layers saves that many bytes per offloaded
//   layer on the GPU and needs them in host memory (per GPU, and per node for
//   gpus_per_node GPUs).
// - Compute: only the dense weight matmuls, 2 FLOPs per parameter per token, at a sustained
//   tflops. Forward per layer F = 2 * params_per_layer * tokens / (tflops * 1e12). Backward
//   per layer is 2F for the backward proper plus 1F to recompute the checkpointed layer.
//   Not counted: attention's score and context matmuls (about 2 * seq^2 * hidden FLOPs per
//   layer and sequence with a causal mask, which dominates at very long sequences unless
//   --attention_flops adds it), embeddings and the LM head, optimizer, communication. With
//   less compute counted, less transfer hides behind it: the exposed figure is pessimistic.
// - Transfer: D2H + H2D bytes at the given per-direction bandwidths (both directions at
//   once share the bidirectional cap), and the exposed, non-overlapped part of them, found
//   by running the engine's real schedule (OffloadEngine on SimDevice) for the step.
// - Host limit (when host RAM or a limit is given): the engine stops offloading once its
//   host limit is reached and keeps the remaining tensors on the GPU. The plan says how
//   many of the offloaded layers fit under the limit; the other figures assume all do.
//
// The simulation moves real bytes, so it runs on stand-ins: every layer's bytes are scaled
// down by one factor and every bandwidth by the same factor, which leaves each copy's time
// (bytes / bandwidth) unchanged.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_PLANNER_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_PLANNER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt_offload::planner {

enum class DType { kBf16, kFp16, kFp32 };
const char* DTypeName(DType dtype);
size_t DTypeBytes(DType dtype);

// A decoder-only transformer layer stack (Llama-style: GQA attention, SwiGLU MLP).
struct ModelShape {
  std::string name = "custom";
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;  // MLP intermediate size
  int64_t heads = 0;
  int64_t kv_heads = 0;
};

// The preset names, e.g. "llama-70b".
std::vector<std::string> PresetNames();
// absl::NotFoundError (naming the known presets) for an unknown name.
absl::StatusOr<ModelShape> Preset(const std::string& name);

// Weights of one layer: Q and O (hidden x hidden), K and V (hidden x kv_heads * head_dim),
// three SwiGLU projections (hidden x ffn), two RMSNorm scales.
int64_t ParamsPerLayer(const ModelShape& shape);

struct PlanInput {
  ModelShape model;  // model.name labels the output (--name, or the preset's)
  int64_t seq = 4096;
  int64_t batch = 1;
  DType dtype = DType::kBf16;
  double tflops = 700;           // sustained dense TFLOP/s per GPU
  bool attention_flops = false;  // also count causal attention matmuls (see above)
  double d2h_gbps = 55;          // 1 GB/s = 1e9 bytes/s
  double h2d_gbps = 55;
  double bidir_gbps = 97;
  int64_t gpus_per_node = 8;
  size_t host_ram_bytes = 0;           // per node; 0: not given
  size_t host_memory_limit_bytes = 0;  // per GPU; 0: the engine's default (see below)
  int keep_last = 1;
  int prefetch_depth = 1;
  int max_inflight_d2h_groups = 2;
};

// Checks every field; the error names the command-line flag that sets it.
absl::Status ValidatePlanInput(const PlanInput& input);

// The host limit per GPU the engine chooses by default on a node with `host_ram_bytes` of
// RAM and `local_ranks` processes: half of RAM split across them (the rule of
// ckpt_offload.config.parse_host_memory_limit(None)).
size_t DefaultHostMemoryLimit(size_t host_ram_bytes, int64_t local_ranks);

// A byte count as the host flags take it: an integer of bytes or a number with a unit
// (B, KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024; any case),
// e.g. "2TiB", "512GB", "1.5TiB". The error names `flag`.
absl::StatusOr<size_t> ParseByteSize(const std::string& flag, const std::string& value);

// What offload_plan was asked for.
struct PlanRequest {
  PlanInput input;
  bool json = false;
  bool help = false;
};

// Parses the flags (argv without the program name): --flag=value or --flag value; bools
// also as a bare --flag. Shape flags override the preset's values; without --preset every
// shape flag is required. --name labels the model. Every error names the flag, e.g.
//   --seq must be a positive integer, got 'abc'
absl::StatusOr<PlanRequest> ParsePlanArgs(const std::vector<std::string>& args);
// The --help text.
std::string PlanUsage();

struct Plan {
  // Shape arithmetic.
  int64_t params_per_layer = 0;
  int64_t tokens = 0;  // batch * seq
  int64_t offloaded_layers = 0;
  size_t bytes_per_layer = 0;  // saved hidden state of one layer
  size_t gpu_bytes_saved = 0;  // offloaded_layers * bytes_per_layer
  size_t host_bytes_per_gpu = 0;
  size_t host_bytes_per_node = 0;
  // Host limit per GPU: the input's, or the default for host_ram_bytes; 0 when neither
  // was given. layers_within_host_limit: offloaded layers that fit under it (all of them
  // when no limit is known); the engine keeps the rest on the GPU.
  size_t host_limit_per_gpu = 0;
  int64_t layers_within_host_limit = 0;

  // Analytic times, seconds per step unless named per layer.
  double forward_s_per_layer = 0;
  double backward_s_per_layer = 0;  // backward proper + recompute
  double compute_s = 0;
  double d2h_s = 0;   // every offload copy alone at d2h bandwidth
  double h2d_s = 0;   // every restore alone at h2d bandwidth
  double pcie_s = 0;  // d2h_s + h2d_s

  // From the simulated schedule.
  double step_s = 0;                    // simulated step: compute + exposed
  double exposed_s = 0;                 // step_s - compute_s: every stall the offload caused
  double backward_wait_s = 0;           // of which: compute stream waiting on restores
  double engine_exposed_wait_s = 0;     // the engine's own measure of backward_wait_s
  size_t peak_engine_device_bytes = 0;  // sources not yet released + unacquired restores
  size_t sim_bytes_per_layer = 0;       // the stand-in size the simulation moved
};

// Computes the plan (runs the simulation). Errors: invalid input, or an engine failure.
absl::StatusOr<Plan> MakePlan(const PlanInput& input);

// A short aligned table, and one JSON object, both ending in a newline.
std::string FormatPlanTable(const PlanInput& input, const Plan& plan);
std::string FormatPlanJson(const PlanInput& input, const Plan& plan);

}  // namespace ckpt_offload::planner

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_PLANNER_H_
