// Offload planner: see planner.h for what is modelled.
#include "offload_core/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "offload_core/engine.h"
#include "offload_core/sim_device.h"
#include "offload_core/status_macros.h"

namespace ckpt_offload::planner {
namespace {

// Bounds that keep the simulation small and the byte arithmetic exact.
constexpr int64_t kMaxLayers = 100000;
constexpr size_t kMaxBytes = size_t{1} << 62;
// Stand-in bytes for the whole simulated step, split across layers, and the per-layer
// bounds (the arena's block alignment at the low end).
constexpr size_t kSimBudgetBytes = size_t{32} << 20;
constexpr size_t kSimMinBytesPerLayer = 256;
constexpr size_t kSimMaxBytesPerLayer = size_t{256} << 10;

absl::Status FlagError(const std::string& flag, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", what));
}

// a * b, or false on overflow past kMaxBytes.
bool MulBounded(size_t a, size_t b, size_t* out) {
  if (a != 0 && b > kMaxBytes / a) return false;
  *out = a * b;
  return true;
}

// --- Flag values ---------------------------------------------------------------------

absl::StatusOr<int64_t> ParsePositiveInt(const std::string& flag, const std::string& value) {
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed <= 0) {
    return FlagError(flag, absl::StrCat("must be a positive integer, got '", value, "'"));
  }
  return parsed;
}

absl::StatusOr<int> ParseNonNegativeInt(const std::string& flag, const std::string& value) {
  int parsed = 0;  // SimpleAtoi into int also rejects values past INT_MAX
  if (!absl::SimpleAtoi(value, &parsed) || parsed < 0) {
    return FlagError(flag, absl::StrCat("must be a non-negative integer, got '", value, "'"));
  }
  return parsed;
}

absl::StatusOr<double> ParsePositiveNumber(const std::string& flag, const std::string& value) {
  double parsed = 0;
  if (!absl::SimpleAtod(value, &parsed) || !std::isfinite(parsed) || parsed <= 0) {
    return FlagError(flag, absl::StrCat("must be a positive number, got '", value, "'"));
  }
  return parsed;
}

absl::StatusOr<bool> ParseBool(const std::string& flag, const std::string& value) {
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  return FlagError(flag, absl::StrCat("must be true or false, got '", value, "'"));
}

absl::StatusOr<DType> ParseDType(const std::string& value) {
  if (value == "bf16") return DType::kBf16;
  if (value == "fp16") return DType::kFp16;
  if (value == "fp32") return DType::kFp32;
  return FlagError("dtype", absl::StrCat("must be one of bf16, fp16, fp32, got '", value, "'"));
}

// Every flag offload_plan knows, and whether it takes a value.
enum class FlagKind { kValue, kBool };
const std::map<std::string, FlagKind>& KnownFlags() {
  static const auto* flags = new std::map<std::string, FlagKind>{
      {"preset", FlagKind::kValue},
      {"layers", FlagKind::kValue},
      {"hidden", FlagKind::kValue},
      {"ffn", FlagKind::kValue},
      {"heads", FlagKind::kValue},
      {"kv_heads", FlagKind::kValue},
      {"seq", FlagKind::kValue},
      {"batch", FlagKind::kValue},
      {"dtype", FlagKind::kValue},
      {"tflops", FlagKind::kValue},
      {"d2h_gbps", FlagKind::kValue},
      {"h2d_gbps", FlagKind::kValue},
      {"bidir_gbps", FlagKind::kValue},
      {"gpus_per_node", FlagKind::kValue},
      {"keep_last", FlagKind::kValue},
      {"prefetch_depth", FlagKind::kValue},
      {"max_inflight_d2h_groups", FlagKind::kValue},
      {"name", FlagKind::kValue},
      {"host_ram", FlagKind::kValue},
      {"host_memory_limit", FlagKind::kValue},
      {"attention_flops", FlagKind::kBool},
      {"json", FlagKind::kBool},
      {"help", FlagKind::kBool},
  };
  return *flags;
}

// --- Simulation ----------------------------------------------------------------------

// Restore buffers come from the simulated device; sources stay with the caller.
class StandInClient : public OffloadEngine::Client {
 public:
  explicit StandInClient(SimDevice* sim) : sim_(sim) {}
  void ReleaseSource(EntryId, SourceToken) override {}
  absl::StatusOr<void*> AllocateRestore(EntryId, size_t bytes) override {
    return sim_->AllocateDeviceBuffer(bytes);
  }
  void DropRestore(EntryId, void* data) override { sim_->FreeDeviceBuffer(data); }

 private:
  SimDevice* sim_;
};

struct SimOutcome {
  double step_us = 0;
  double compute_us = 0;
  double blocked_us = 0;
  double engine_exposed_wait_us = 0;
  size_t peak_held_layers_bytes = 0;  // in stand-in bytes
  size_t sim_bytes_per_layer = 0;
};

// One step of the engine's schedule on stand-in bytes (see planner.h).
absl::StatusOr<SimOutcome> SimulateStep(const PlanInput& input, size_t bytes_per_layer,
                                        double forward_us, double backward_us) {
  const int64_t layers = input.model.layers;
  size_t sim_bytes = kSimBudgetBytes / static_cast<size_t>(layers);
  sim_bytes = std::clamp(sim_bytes, kSimMinBytesPerLayer, kSimMaxBytesPerLayer);
  sim_bytes = std::min(sim_bytes / kSimMinBytesPerLayer * kSimMinBytesPerLayer, bytes_per_layer);
  // Bytes and bandwidths shrink by the same factor: every copy takes as long as the real one.
  const double scale = static_cast<double>(sim_bytes) / static_cast<double>(bytes_per_layer);
  SimDeviceOptions sim_options;
  sim_options.d2h_gbps = input.d2h_gbps * scale;
  sim_options.h2d_gbps = input.h2d_gbps * scale;
  sim_options.bidir_gbps = input.bidir_gbps * scale;

  SimDevice sim(sim_options);
  const StreamHandle compute = sim.CreateStream();
  StandInClient client(&sim);
  EngineOptions engine_options;
  engine_options.keep_last = input.keep_last;
  engine_options.prefetch_depth = input.prefetch_depth;
  engine_options.max_inflight_d2h_groups = input.max_inflight_d2h_groups;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<OffloadEngine> engine,
                        OffloadEngine::Create(&sim, &client, engine_options));

  std::vector<void*> sources(layers, nullptr);
  std::vector<void*> consumed;
  auto free_all = [&] {
    engine.reset();  // Reset()s: every copy drained
    for (void* data : consumed) sim.FreeDeviceBuffer(data);
    for (void* data : sources) sim.FreeDeviceBuffer(data);
  };
  auto run = [&]() -> absl::Status {
    std::vector<EntryId> entries(layers, 0);
    for (int64_t layer = 0; layer < layers; ++layer) {
      CKPT_ASSIGN_OR_RETURN(GroupId group, engine->BeginGroup(compute));
      sources[layer] = sim.AllocateDeviceBuffer(sim_bytes);
      CKPT_ASSIGN_OR_RETURN(OffloadEngine::Offer offer,
                            engine->OfferEntry(group, sources[layer], sim_bytes,
                                               /*source=*/0, compute));
      entries[layer] = offer.entry;
      sim.Compute(compute, forward_us, {{sources[layer], sim_bytes}});
    }
    for (int64_t layer = layers - 1; layer >= 0; --layer) {
      CKPT_ASSIGN_OR_RETURN(OffloadEngine::Acquired acquired,
                            engine->Acquire(entries[layer], compute));
      void* data = acquired.resident ? sources[layer] : acquired.device_data;
      if (!acquired.resident) consumed.push_back(data);
      sim.Compute(compute, backward_us, {{data, sim_bytes}});
      engine->Discard(entries[layer]);
    }
    CKPT_RETURN_IF_ERROR(sim.SynchronizeAll());
    return engine->Synchronize();
  };
  absl::Status status = run();
  if (!status.ok()) {
    free_all();
    return status;
  }
  const std::vector<SimDevice::Hazard> hazards = sim.hazards();
  if (!hazards.empty()) {
    // The engine broke its own contract: no figure from this run can be trusted.
    const std::string detail = hazards.front().detail;
    free_all();
    return absl::InternalError(
        absl::StrCat("the simulated schedule has ", hazards.size(), " hazard(s), first: ", detail));
  }
  SimOutcome outcome;
  const EngineStats stats = engine->stats();
  outcome.step_us = sim.host_time_us();
  outcome.compute_us = sim.compute_us(compute);
  outcome.blocked_us = sim.blocked_us(compute);
  outcome.engine_exposed_wait_us = stats.exposed_wait_ms * 1e3;
  outcome.peak_held_layers_bytes = stats.peak_device_held_bytes;
  outcome.sim_bytes_per_layer = sim_bytes;
  free_all();
  return outcome;
}

// --- Formatting ----------------------------------------------------------------------

std::string FormatBytes(size_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 6) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string FormatSeconds(double seconds) {
  // Below a nanosecond is floating-point residue of a zero.
  if (std::fabs(seconds) < 1e-9) return "0 s";
  if (seconds >= 1) return absl::StrFormat("%.2f s", seconds);
  if (seconds >= 1e-3) return absl::StrFormat("%.2f ms", seconds * 1e3);
  return absl::StrFormat("%.2f us", seconds * 1e6);
}

std::string FormatNumber(double value) { return absl::StrFormat("%.9g", value); }

std::string Percent(double part, double whole) {
  return absl::StrFormat("%.1f%%", whole > 0 ? 100 * part / whole : 0.0);
}

}  // namespace

// --- Model shapes --------------------------------------------------------------------

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
    case DType::kFp32:
      return "fp32";
  }
  return "unknown";
}

size_t DTypeBytes(DType dtype) { return dtype == DType::kFp32 ? 4 : 2; }

// --- Host memory ---------------------------------------------------------------------

size_t DefaultHostMemoryLimit(size_t host_ram_bytes, int64_t local_ranks) {
  return host_ram_bytes / 2 / static_cast<size_t>(std::max<int64_t>(local_ranks, 1));
}

absl::StatusOr<size_t> ParseByteSize(const std::string& flag, const std::string& value) {
  static const auto* units = new std::map<std::string, double>{
      {"", 1},
      {"b", 1},
      {"kb", 1e3},
      {"mb", 1e6},
      {"gb", 1e9},
      {"tb", 1e12},
      {"kib", 1024.0},
      {"mib", 1048576.0},
      {"gib", 1073741824.0},
      {"tib", 1099511627776.0},
  };
  const auto bad = [&] {
    return FlagError(flag, absl::StrCat("must be a byte count such as 2TiB, 512GB or 1000000, "
                                        "got '",
                                        value, "'"));
  };
  size_t digits = 0;
  while (digits < value.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(value[digits])) || value[digits] == '.')) {
    ++digits;
  }
  const std::string number = value.substr(0, digits);
  const auto unit = units->find(absl::AsciiStrToLower(value.substr(digits)));
  double parsed = 0;
  if (number.empty() || unit == units->end() || !absl::SimpleAtod(number, &parsed)) {
    return bad();
  }
  const double bytes = parsed * unit->second;
  if (!std::isfinite(bytes) || bytes < 1 || bytes > static_cast<double>(kMaxBytes)) return bad();
  return static_cast<size_t>(bytes);
}

namespace {
const std::vector<ModelShape>& Presets() {
  static const auto* presets = new std::vector<ModelShape>{
      {"llama-1b", 16, 2048, 8192, 32, 8},
      {"llama-8b", 32, 4096, 14336, 32, 8},
      {"llama-70b", 80, 8192, 28672, 64, 8},
  };
  return *presets;
}
}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const ModelShape& shape : Presets()) names.push_back(shape.name);
  return names;
}

absl::StatusOr<ModelShape> Preset(const std::string& name) {
  for (const ModelShape& shape : Presets()) {
    if (shape.name == name) return shape;
  }
  return absl::NotFoundError(absl::StrCat(
      "--preset must be one of ", absl::StrJoin(PresetNames(), ", "), ", got '", name, "'"));
}

int64_t ParamsPerLayer(const ModelShape& shape) {
  const int64_t head_dim = shape.hidden / shape.heads;
  const int64_t kv_width = shape.kv_heads * head_dim;
  const int64_t attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv_width;
  const int64_t mlp = 3 * shape.hidden * shape.ffn;
  const int64_t norms = 2 * shape.hidden;
  return attention + mlp + norms;
}

// --- Input ---------------------------------------------------------------------------

absl::Status ValidatePlanInput(const PlanInput& input) {
  const ModelShape& model = input.model;
  const std::pair<const char*, int64_t> positive[] = {
      {"layers", model.layers},     {"hidden", model.hidden},
      {"ffn", model.ffn},           {"heads", model.heads},
      {"kv_heads", model.kv_heads}, {"seq", input.seq},
      {"batch", input.batch},       {"gpus_per_node", input.gpus_per_node},
  };
  for (const auto& [flag, value] : positive) {
    if (value <= 0) return FlagError(flag, absl::StrCat("must be positive, got ", value));
  }
  if (model.layers > kMaxLayers) {
    return FlagError("layers",
                     absl::StrCat("must be at most ", kMaxLayers, ", got ", model.layers));
  }
  if (model.hidden % model.heads != 0) {
    return FlagError("hidden", absl::StrCat("(", model.hidden, ") must be a multiple of --heads (",
                                            model.heads, ")"));
  }
  if (model.heads % model.kv_heads != 0) {
    return FlagError("heads", absl::StrCat("(", model.heads, ") must be a multiple of --kv_heads (",
                                           model.kv_heads, ")"));
  }
  // The parameter count must fit in int64 (hidden * ffn is its largest term).
  if (model.hidden > (int64_t{1} << 24) || model.ffn > (int64_t{1} << 26)) {
    return FlagError(model.hidden > (int64_t{1} << 24) ? "hidden" : "ffn",
                     "is too large for this planner");
  }
  const std::pair<const char*, double> rates[] = {
      {"tflops", input.tflops},
      {"d2h_gbps", input.d2h_gbps},
      {"h2d_gbps", input.h2d_gbps},
      {"bidir_gbps", input.bidir_gbps},
  };
  for (const auto& [flag, value] : rates) {
    if (!std::isfinite(value) || value <= 0) {
      return FlagError(flag, absl::StrCat("must be a positive number, got ", value));
    }
  }
  if (input.keep_last < 0) {
    return FlagError("keep_last", absl::StrCat("must be >= 0, got ", input.keep_last));
  }
  if (input.keep_last > model.layers) {
    return FlagError("keep_last", absl::StrCat("must be at most --layers (", model.layers,
                                               "), got ", input.keep_last));
  }
  if (input.prefetch_depth < 0) {
    return FlagError("prefetch_depth", absl::StrCat("must be >= 0, got ", input.prefetch_depth));
  }
  if (input.max_inflight_d2h_groups < 1) {
    return FlagError("max_inflight_d2h_groups",
                     absl::StrCat("must be >= 1, got ", input.max_inflight_d2h_groups));
  }
  size_t bytes = 0;
  if (!MulBounded(static_cast<size_t>(input.seq), static_cast<size_t>(input.batch), &bytes) ||
      !MulBounded(bytes, static_cast<size_t>(model.hidden), &bytes) ||
      !MulBounded(bytes, DTypeBytes(input.dtype), &bytes) ||
      !MulBounded(bytes, static_cast<size_t>(model.layers), &bytes) ||
      !MulBounded(bytes, static_cast<size_t>(input.gpus_per_node), &bytes)) {
    return FlagError("seq",
                     "x --batch x --hidden x dtype bytes x --layers x --gpus_per_node "
                     "is too large to count in bytes");
  }
  const std::pair<const char*, size_t> host_sizes[] = {
      {"host_ram", input.host_ram_bytes},
      {"host_memory_limit", input.host_memory_limit_bytes},
  };
  for (const auto& [flag, value] : host_sizes) {
    if (value > kMaxBytes) {
      return FlagError(flag, absl::StrCat("must be at most 2^62 bytes, got ", value));
    }
  }
  return absl::OkStatus();
}

std::string PlanUsage() {
  return absl::StrCat(
      "usage: offload_plan [--preset=NAME] [shape flags] [step flags] [--json]\n"
      "\n"
      "Predicts activation offload for one training step on one GPU: hidden-state bytes,\n"
      "GPU memory saved, host memory needed, PCIe time, and the transfer time left exposed\n"
      "by the engine's schedule (simulated).\n"
      "\n"
      "  --preset=NAME             one of ",
      absl::StrJoin(PresetNames(), ", "), "\n",
      "  --layers --hidden --ffn --heads --kv_heads\n"
      "                            model shape (override the preset; required without one)\n"
      "  --seq=N                   sequence length (default 4096)\n"
      "  --batch=N                 sequences per GPU (default 1)\n"
      "  --dtype=bf16|fp16|fp32    activation dtype (default bf16)\n"
      "  --tflops=X                sustained dense TFLOP/s per GPU (default 700)\n"
      "  --attention_flops         also count causal attention matmuls in compute\n"
      "  --d2h_gbps --h2d_gbps --bidir_gbps\n"
      "                            PCIe GB/s per direction and both at once (55/55/97)\n"
      "  --gpus_per_node=N         for host bytes per node (default 8)\n"
      "  --host_ram=SIZE           host RAM per node, e.g. 2TiB: adds the share offload needs\n"
      "                            and the engine's default host limit per GPU\n"
      "  --host_memory_limit=SIZE  host limit per GPU (default: half of --host_ram per GPU)\n"
      "  --name=TEXT               the model's label in the output\n"
      "  --keep_last=N             layers kept on the GPU at the end of forward (default 1)\n"
      "  --prefetch_depth=N        layers restored ahead in backward (default 1)\n"
      "  --max_inflight_d2h_groups=N  layers copying out at once (default 2)\n"
      "  --json                    print one JSON object instead of the table\n");
}

absl::StatusOr<PlanRequest> ParsePlanArgs(const std::vector<std::string>& args) {
  // Pass 1: split into flag -> raw value (the last occurrence wins).
  std::map<std::string, std::string> values;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h") {
      values["help"] = "true";
      continue;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (flags look like --name=value)"));
    }
    const size_t equals = arg.find('=');
    const std::string name =
        arg.substr(2, equals == std::string::npos ? std::string::npos : equals - 2);
    auto known = KnownFlags().find(name);
    if (known == KnownFlags().end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (equals != std::string::npos) {
      values[name] = arg.substr(equals + 1);
    } else if (known->second == FlagKind::kBool) {
      values[name] = "true";
    } else if (i + 1 < args.size()) {
      values[name] = args[++i];
    } else {
      return FlagError(name, "needs a value");
    }
  }

  PlanRequest request;
  if (values.count("help") > 0) {
    CKPT_ASSIGN_OR_RETURN(request.help, ParseBool("help", values["help"]));
    if (request.help) return request;
  }

  // Pass 2: the preset first, then everything that overrides or adds to it.
  PlanInput& input = request.input;
  if (values.count("preset") > 0) {
    CKPT_ASSIGN_OR_RETURN(input.model, Preset(values["preset"]));
  }
  const std::pair<const char*, int64_t*> shape_flags[] = {
      {"layers", &input.model.layers},     {"hidden", &input.model.hidden},
      {"ffn", &input.model.ffn},           {"heads", &input.model.heads},
      {"kv_heads", &input.model.kv_heads},
  };
  bool shape_overridden = false;
  for (const auto& [flag, field] : shape_flags) {
    if (auto it = values.find(flag); it != values.end()) {
      CKPT_ASSIGN_OR_RETURN(*field, ParsePositiveInt(flag, it->second));
      shape_overridden = true;
    }
  }
  if (shape_overridden && values.count("preset") > 0) {
    input.model.name = absl::StrCat(input.model.name, " (modified)");
  }
  if (auto it = values.find("name"); it != values.end()) {
    if (it->second.empty()) return FlagError("name", "must not be empty");
    input.model.name = it->second;
  }
  if (auto it = values.find("host_ram"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.host_ram_bytes, ParseByteSize("host_ram", it->second));
  }
  if (auto it = values.find("host_memory_limit"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.host_memory_limit_bytes,
                          ParseByteSize("host_memory_limit", it->second));
  }
  if (auto it = values.find("seq"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.seq, ParsePositiveInt("seq", it->second));
  }
  if (auto it = values.find("batch"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.batch, ParsePositiveInt("batch", it->second));
  }
  if (auto it = values.find("gpus_per_node"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.gpus_per_node, ParsePositiveInt("gpus_per_node", it->second));
  }
  if (auto it = values.find("dtype"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.dtype, ParseDType(it->second));
  }
  const std::pair<const char*, double*> number_flags[] = {
      {"tflops", &input.tflops},
      {"d2h_gbps", &input.d2h_gbps},
      {"h2d_gbps", &input.h2d_gbps},
      {"bidir_gbps", &input.bidir_gbps},
  };
  for (const auto& [flag, field] : number_flags) {
    if (auto it = values.find(flag); it != values.end()) {
      CKPT_ASSIGN_OR_RETURN(*field, ParsePositiveNumber(flag, it->second));
    }
  }
  if (auto it = values.find("keep_last"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.keep_last, ParseNonNegativeInt("keep_last", it->second));
  }
  if (auto it = values.find("prefetch_depth"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.prefetch_depth, ParseNonNegativeInt("prefetch_depth", it->second));
  }
  if (auto it = values.find("max_inflight_d2h_groups"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(int64_t inflight,
                          ParsePositiveInt("max_inflight_d2h_groups", it->second));
    if (inflight > std::numeric_limits<int>::max()) {
      return FlagError("max_inflight_d2h_groups",
                       absl::StrCat("must be a positive integer, got '", it->second, "'"));
    }
    input.max_inflight_d2h_groups = static_cast<int>(inflight);
  }
  if (auto it = values.find("attention_flops"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(input.attention_flops, ParseBool("attention_flops", it->second));
  }
  if (auto it = values.find("json"); it != values.end()) {
    CKPT_ASSIGN_OR_RETURN(request.json, ParseBool("json", it->second));
  }
  // Missing shape flags are reported only after every given value checked out: a bad
  // value is the more useful message.
  if (values.count("preset") == 0) {
    for (const auto& [flag, field] : shape_flags) {
      if (values.count(flag) == 0) return FlagError(flag, "is required without --preset");
    }
  }
  CKPT_RETURN_IF_ERROR(ValidatePlanInput(input));
  return request;
}

// --- Plan ----------------------------------------------------------------------------

absl::StatusOr<Plan> MakePlan(const PlanInput& input) {
  CKPT_RETURN_IF_ERROR(ValidatePlanInput(input));
  const ModelShape& model = input.model;
  Plan plan;
  plan.params_per_layer = ParamsPerLayer(model);
  plan.tokens = input.batch * input.seq;
  plan.offloaded_layers = model.layers - input.keep_last;
  plan.bytes_per_layer = static_cast<size_t>(plan.tokens) * static_cast<size_t>(model.hidden) *
                         DTypeBytes(input.dtype);
  plan.gpu_bytes_saved = static_cast<size_t>(plan.offloaded_layers) * plan.bytes_per_layer;
  plan.host_bytes_per_gpu = plan.gpu_bytes_saved;
  plan.host_bytes_per_node = plan.host_bytes_per_gpu * static_cast<size_t>(input.gpus_per_node);
  plan.host_limit_per_gpu = input.host_memory_limit_bytes > 0
                                ? input.host_memory_limit_bytes
                                : DefaultHostMemoryLimit(input.host_ram_bytes, input.gpus_per_node);
  plan.layers_within_host_limit =
      plan.host_limit_per_gpu == 0
          ? plan.offloaded_layers
          : std::min<int64_t>(plan.offloaded_layers,
                              static_cast<int64_t>(plan.host_limit_per_gpu / plan.bytes_per_layer));

  double forward_flops =
      2.0 * static_cast<double>(plan.params_per_layer) * static_cast<double>(plan.tokens);
  if (input.attention_flops) {
    // QK^T and attention x V: 4 * seq^2 * hidden per sequence, halved by the causal mask.
    forward_flops += 2.0 * static_cast<double>(input.batch) * static_cast<double>(input.seq) *
                     static_cast<double>(input.seq) * static_cast<double>(model.hidden);
  }
  plan.forward_s_per_layer = forward_flops / (input.tflops * 1e12);
  plan.backward_s_per_layer = 3 * plan.forward_s_per_layer;  // 2x backward + 1x recompute
  plan.compute_s =
      static_cast<double>(model.layers) * (plan.forward_s_per_layer + plan.backward_s_per_layer);
  const double moved = static_cast<double>(plan.gpu_bytes_saved);
  plan.d2h_s = moved / (input.d2h_gbps * 1e9);
  plan.h2d_s = moved / (input.h2d_gbps * 1e9);
  plan.pcie_s = plan.d2h_s + plan.h2d_s;

  CKPT_ASSIGN_OR_RETURN(SimOutcome sim,
                        SimulateStep(input, plan.bytes_per_layer, plan.forward_s_per_layer * 1e6,
                                     plan.backward_s_per_layer * 1e6));
  plan.step_s = sim.step_us * 1e-6;
  plan.exposed_s = (sim.step_us - sim.compute_us) * 1e-6;
  // Below a nanosecond is floating-point residue of summing the simulated ops.
  if (plan.exposed_s < 1e-9) plan.exposed_s = 0;
  plan.backward_wait_s = sim.blocked_us * 1e-6;
  plan.engine_exposed_wait_s = sim.engine_exposed_wait_us * 1e-6;
  // Every entry has the same size: peak stand-in bytes / stand-in layer = layers held.
  plan.peak_engine_device_bytes =
      sim.peak_held_layers_bytes / sim.sim_bytes_per_layer * plan.bytes_per_layer;
  plan.sim_bytes_per_layer = sim.sim_bytes_per_layer;
  return plan;
}

std::string FormatPlanTable(const PlanInput& input, const Plan& plan) {
  const ModelShape& m = input.model;
  std::string out = absl::StrFormat(
      "%s: %d layers, hidden %d, ffn %d, %d heads (%d kv), %.2f M params/layer\n"
      "step: batch %d x seq %d, %s, %s TFLOP/s%s, keep_last %d, prefetch_depth %d\n"
      "PCIe: d2h %s GB/s, h2d %s GB/s, bidir %s GB/s\n\n",
      m.name, m.layers, m.hidden, m.ffn, m.heads, m.kv_heads,
      static_cast<double>(plan.params_per_layer) / 1e6, input.batch, input.seq,
      DTypeName(input.dtype), FormatNumber(input.tflops),
      input.attention_flops ? " (attention counted)" : "", input.keep_last, input.prefetch_depth,
      FormatNumber(input.d2h_gbps), FormatNumber(input.h2d_gbps), FormatNumber(input.bidir_gbps));
  std::vector<std::pair<std::string, std::string>> rows = {
      {"hidden state per layer", FormatBytes(plan.bytes_per_layer)},
      {"layers offloaded", absl::StrCat(plan.offloaded_layers, " of ", m.layers)},
      {"GPU bytes saved", FormatBytes(plan.gpu_bytes_saved)},
      {"host bytes per GPU", FormatBytes(plan.host_bytes_per_gpu)},
      {absl::StrCat("host bytes per node (", input.gpus_per_node, " GPUs)"),
       FormatBytes(plan.host_bytes_per_node)},
  };
  if (input.host_ram_bytes > 0) {
    rows.push_back(
        {"host RAM per node", absl::StrCat(FormatBytes(input.host_ram_bytes), "  (offload needs ",
                                           Percent(static_cast<double>(plan.host_bytes_per_node),
                                                   static_cast<double>(input.host_ram_bytes)),
                                           ")")});
  }
  if (plan.host_limit_per_gpu > 0) {
    const std::string source =
        input.host_memory_limit_bytes > 0
            ? "--host_memory_limit"
            : absl::StrCat("default: half of RAM / ", input.gpus_per_node, " GPUs");
    const std::string fit =
        plan.layers_within_host_limit == plan.offloaded_layers
            ? absl::StrCat("all ", plan.offloaded_layers, " offloaded layers fit")
            : absl::StrCat("only ", plan.layers_within_host_limit, " of ", plan.offloaded_layers,
                           " offloaded layers fit, the rest stay on the GPU");
    rows.push_back({"host limit per GPU", absl::StrCat(FormatBytes(plan.host_limit_per_gpu), "  (",
                                                       source, "; ", fit, ")")});
  }
  rows.insert(
      rows.end(),
      {
          {"compute per step",
           absl::StrCat(FormatSeconds(plan.compute_s), "  (per layer: forward ",
                        FormatSeconds(plan.forward_s_per_layer), ", backward+recompute ",
                        FormatSeconds(plan.backward_s_per_layer), ")")},
          {"PCIe per step (D2H + H2D)",
           absl::StrCat(FormatSeconds(plan.pcie_s), "  (", FormatSeconds(plan.d2h_s), " + ",
                        FormatSeconds(plan.h2d_s), "; ", Percent(plan.pcie_s, plan.compute_s),
                        " of compute)")},
          {"exposed transfer per step",
           absl::StrCat(FormatSeconds(plan.exposed_s), "  (",
                        Percent(plan.exposed_s, plan.compute_s), " of compute; backward waits ",
                        FormatSeconds(plan.backward_wait_s), ")")},
          {"simulated step time", FormatSeconds(plan.step_s)},
      });
  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  for (const auto& [label, value] : rows) {
    absl::StrAppend(&out, "  ", label, std::string(width - label.size() + 2, ' '), value, "\n");
  }
  return out;
}

std::string FormatPlanJson(const PlanInput& input, const Plan& plan) {
  const ModelShape& m = input.model;
  std::string out = "{";
  bool first = true;
  auto field = [&](const char* key, const std::string& value) {
    absl::StrAppend(&out, first ? "" : ", ", "\"", key, "\": ", value);
    first = false;
  };
  auto quoted = [](const std::string& text) {
    std::string escaped;
    for (char c : text) {
      if (c == '"' || c == '\\') escaped.push_back('\\');
      escaped.push_back(c);
    }
    return absl::StrCat("\"", escaped, "\"");
  };
  field("model", quoted(m.name));
  field("layers", absl::StrCat(m.layers));
  field("hidden", absl::StrCat(m.hidden));
  field("ffn", absl::StrCat(m.ffn));
  field("heads", absl::StrCat(m.heads));
  field("kv_heads", absl::StrCat(m.kv_heads));
  field("seq", absl::StrCat(input.seq));
  field("batch", absl::StrCat(input.batch));
  field("dtype", quoted(DTypeName(input.dtype)));
  field("tflops", FormatNumber(input.tflops));
  field("attention_flops", input.attention_flops ? "true" : "false");
  field("d2h_gbps", FormatNumber(input.d2h_gbps));
  field("h2d_gbps", FormatNumber(input.h2d_gbps));
  field("bidir_gbps", FormatNumber(input.bidir_gbps));
  field("gpus_per_node", absl::StrCat(input.gpus_per_node));
  field("keep_last", absl::StrCat(input.keep_last));
  field("prefetch_depth", absl::StrCat(input.prefetch_depth));
  field("max_inflight_d2h_groups", absl::StrCat(input.max_inflight_d2h_groups));
  field("params_per_layer", absl::StrCat(plan.params_per_layer));
  field("tokens", absl::StrCat(plan.tokens));
  field("offloaded_layers", absl::StrCat(plan.offloaded_layers));
  field("bytes_per_layer", absl::StrCat(plan.bytes_per_layer));
  field("gpu_bytes_saved", absl::StrCat(plan.gpu_bytes_saved));
  field("host_bytes_per_gpu", absl::StrCat(plan.host_bytes_per_gpu));
  field("host_bytes_per_node", absl::StrCat(plan.host_bytes_per_node));
  field("host_ram_bytes", absl::StrCat(input.host_ram_bytes));
  field("host_limit_per_gpu", absl::StrCat(plan.host_limit_per_gpu));
  field("layers_within_host_limit", absl::StrCat(plan.layers_within_host_limit));
  field("forward_s_per_layer", FormatNumber(plan.forward_s_per_layer));
  field("backward_s_per_layer", FormatNumber(plan.backward_s_per_layer));
  field("compute_s_per_step", FormatNumber(plan.compute_s));
  field("d2h_s_per_step", FormatNumber(plan.d2h_s));
  field("h2d_s_per_step", FormatNumber(plan.h2d_s));
  field("pcie_s_per_step", FormatNumber(plan.pcie_s));
  field("exposed_s_per_step", FormatNumber(plan.exposed_s));
  field("backward_wait_s_per_step", FormatNumber(plan.backward_wait_s));
  field("simulated_step_s", FormatNumber(plan.step_s));
  field("peak_engine_device_bytes", absl::StrCat(plan.peak_engine_device_bytes));
  field("sim_bytes_per_layer", absl::StrCat(plan.sim_bytes_per_layer));
  absl::StrAppend(&out, "}\n");
  return out;
}

}  // namespace ckpt_offload::planner
