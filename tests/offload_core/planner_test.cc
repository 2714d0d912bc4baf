// Tests for the offload planner: byte and FLOP arithmetic on the presets, the simulated
// exposed time in the regimes where it is known in closed form, and flag errors.
#include "offload_core/planner.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace ckpt_offload::planner {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

PlanInput PresetInput(const std::string& name, int64_t seq) {
  PlanInput input;
  absl::StatusOr<ModelShape> shape = Preset(name);
  EXPECT_TRUE(shape.ok()) << shape.status();
  if (shape.ok()) input.model = *shape;
  input.seq = seq;
  return input;
}

Plan MustPlan(const PlanInput& input) {
  absl::StatusOr<Plan> plan = MakePlan(input);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.value_or(Plan{});
}

// --- Arithmetic ---------------------------------------------------------------------

TEST(PlannerTest, PresetShapes) {
  const std::vector<std::string> names = PresetNames();
  EXPECT_EQ(names, (std::vector<std::string>{"llama-1b", "llama-8b", "llama-70b"}));
  const ModelShape llama_70b = Preset("llama-70b").value();
  EXPECT_EQ(llama_70b.layers, 80);
  EXPECT_EQ(llama_70b.hidden, 8192);
  EXPECT_EQ(llama_70b.ffn, 28672);
  EXPECT_EQ(llama_70b.heads, 64);
  EXPECT_EQ(llama_70b.kv_heads, 8);
  EXPECT_FALSE(Preset("llama-9000").ok());
}

TEST(PlannerTest, ParamsPerLayerMatchPublishedModelSizes) {
  // Q, O: h*h; K, V: h * kv_heads * head_dim; MLP: 3 * h * ffn; norms: 2 * h.
  EXPECT_EQ(ParamsPerLayer(Preset("llama-1b").value()),
            2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048);
  EXPECT_EQ(ParamsPerLayer(Preset("llama-8b").value()),
            int64_t{2} * 4096 * 4096 + 2 * 4096 * 1024 + int64_t{3} * 4096 * 14336 + 2 * 4096);
  EXPECT_EQ(ParamsPerLayer(Preset("llama-70b").value()),
            int64_t{2} * 8192 * 8192 + 2 * 8192 * 1024 + int64_t{3} * 8192 * 28672 + 2 * 8192);
  // Layer stacks close to the names (embeddings and LM head come on top).
  EXPECT_NEAR(80 * ParamsPerLayer(Preset("llama-70b").value()) / 1e9, 68.45, 0.01);
  EXPECT_NEAR(32 * ParamsPerLayer(Preset("llama-8b").value()) / 1e9, 6.98, 0.01);
}

TEST(PlannerTest, Llama70bAt128kBytes) {
  const PlanInput input = PresetInput("llama-70b", 131072);
  const Plan plan = MustPlan(input);
  // batch * seq * hidden * 2 bytes (bf16) = 2 GiB exactly.
  EXPECT_EQ(plan.bytes_per_layer, size_t{131072} * 8192 * 2);
  EXPECT_EQ(plan.bytes_per_layer, 2 * kGiB);
  EXPECT_EQ(plan.offloaded_layers, 79);
  EXPECT_EQ(plan.gpu_bytes_saved, 79 * 2 * kGiB);
  EXPECT_EQ(plan.host_bytes_per_gpu, 79 * 2 * kGiB);
  EXPECT_EQ(plan.host_bytes_per_node, 8 * 79 * 2 * kGiB);
  EXPECT_EQ(plan.tokens, 131072);
  // 2 FLOPs per parameter per token at 700 TFLOP/s; backward 2x + recompute 1x.
  const double forward_s = 2.0 * plan.params_per_layer * 131072 / 700e12;
  EXPECT_DOUBLE_EQ(plan.forward_s_per_layer, forward_s);
  EXPECT_DOUBLE_EQ(plan.backward_s_per_layer, 3 * forward_s);
  EXPECT_DOUBLE_EQ(plan.compute_s, 80 * 4 * forward_s);
  const double one_way = 79.0 * 2 * kGiB / 55e9;
  EXPECT_DOUBLE_EQ(plan.d2h_s, one_way);
  EXPECT_DOUBLE_EQ(plan.h2d_s, one_way);
  EXPECT_DOUBLE_EQ(plan.pcie_s, 2 * one_way);
}

TEST(PlannerTest, BytesFollowDtypeBatchKeepLastAndNodeSize) {
  PlanInput input = PresetInput("llama-8b", 8192);
  input.batch = 2;
  input.dtype = DType::kFp32;
  input.keep_last = 3;
  input.gpus_per_node = 4;
  const Plan plan = MustPlan(input);
  const size_t per_layer = size_t{2} * 8192 * 4096 * 4;
  EXPECT_EQ(plan.bytes_per_layer, per_layer);
  EXPECT_EQ(plan.offloaded_layers, 32 - 3);
  EXPECT_EQ(plan.gpu_bytes_saved, 29 * per_layer);
  EXPECT_EQ(plan.host_bytes_per_node, 4 * 29 * per_layer);

  input.dtype = DType::kFp16;
  EXPECT_EQ(MustPlan(input).bytes_per_layer, per_layer / 2);
  input.keep_last = 32;  // nothing offloaded
  const Plan resident = MustPlan(input);
  EXPECT_EQ(resident.gpu_bytes_saved, 0u);
  EXPECT_EQ(resident.pcie_s, 0);
  EXPECT_NEAR(resident.exposed_s, 0, 1e-9);
}

TEST(PlannerTest, AttentionFlopsAddTheCausalScoreMatmuls) {
  PlanInput input = PresetInput("llama-1b", 32768);
  const double dense = MustPlan(input).forward_s_per_layer;
  input.attention_flops = true;
  const double with_attention = MustPlan(input).forward_s_per_layer;
  EXPECT_DOUBLE_EQ(with_attention - dense, 2.0 * 32768.0 * 32768.0 * 2048 / 700e12);
}

// --- Simulated schedule ---------------------------------------------------------------

TEST(PlannerTest, ExposedIsZeroWhenComputeDominates) {
  for (const std::string& name : PresetNames()) {
    for (int keep_last : {1, 2}) {
      for (int prefetch : {1, 2}) {
        SCOPED_TRACE(absl::StrCat(name, " keep_last=", keep_last, " prefetch=", prefetch));
        PlanInput input = PresetInput(name, 131072);
        input.keep_last = keep_last;
        input.prefetch_depth = prefetch;
        const Plan plan = MustPlan(input);
        ASSERT_LT(plan.pcie_s, plan.compute_s);
        EXPECT_NEAR(plan.exposed_s, 0, 1e-9 * plan.compute_s);
        EXPECT_NEAR(plan.backward_wait_s, 0, 1e-9 * plan.compute_s);
        EXPECT_NEAR(plan.step_s, plan.compute_s, 1e-9 * plan.compute_s);
      }
    }
  }
}

TEST(PlannerTest, ExposedWithoutPrefetchIsEveryRestore) {
  // Forward hides every offload (C = 39 ms per copy, F = 320 ms per layer). prefetch_depth 0:
  // the first Acquire waits for the forward's last copy, which ends at 79F + C, before the
  // last layer's forward does (80F), so that wait costs nothing; with it done no layer is
  // reclaimed, and backward then waits a whole restore per offloaded layer.
  for (int keep_last : {0, 1, 4}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    PlanInput input = PresetInput("llama-70b", 131072);
    input.keep_last = keep_last;
    input.prefetch_depth = 0;
    const Plan plan = MustPlan(input);
    const double restore_s = static_cast<double>(plan.bytes_per_layer) / (input.h2d_gbps * 1e9);
    const double expected = (80 - keep_last) * restore_s;
    EXPECT_GT(plan.exposed_s, 0);
    EXPECT_NEAR(plan.exposed_s, expected, 1e-6 * expected);
    EXPECT_NEAR(plan.backward_wait_s, expected, 1e-6 * expected);
    EXPECT_NEAR(plan.engine_exposed_wait_s, expected, 1e-6 * expected);
    EXPECT_NEAR(plan.step_s, plan.compute_s + expected, 1e-6 * plan.step_s);
  }
}

TEST(PlannerTest, KeepLastZeroReclaimsTheLastLayersAndExposesNothing) {
  // keep_last 0 keeps nothing, but layer k's copy runs over [kF, kF + C] (after the compute
  // queued when layer k is offered) and the in-flight bound last makes the host wait for
  // layer 77's, so backward starts at host time 77F + C with layers 78 and 79 still copying
  // out. Acquire(79) reclaims layer 79 itself, its prefetch reclaims 78; Acquire(78)
  // prefetches 77 behind bwd79, and that copy (C) ends long before bwd78 does (Bk = 3F > C),
  // as does every later one behind the backward above it. Forward never starves either (the
  // host is at most (k - 2)F + C < kF when it issues layer k's compute). Nothing is exposed;
  // the restore that used to be exposed (layer 79's, on demand) is not made at all.
  PlanInput input = PresetInput("llama-70b", 131072);
  input.keep_last = 0;
  const Plan plan = MustPlan(input);
  const double restore_s = static_cast<double>(plan.bytes_per_layer) / (input.h2d_gbps * 1e9);
  ASSERT_LT(restore_s, plan.forward_s_per_layer);   // 2F > C: forward hides the copies
  ASSERT_LT(restore_s, plan.backward_s_per_layer);  // Bk > C
  EXPECT_NEAR(plan.exposed_s, 0, 1e-9 * plan.compute_s);
  EXPECT_NEAR(plan.backward_wait_s, 0, 1e-9 * plan.compute_s);
  EXPECT_NEAR(plan.engine_exposed_wait_s, 0, 1e-9 * plan.compute_s);
  EXPECT_NEAR(plan.step_s, plan.compute_s, 1e-9 * plan.compute_s);
}

TEST(PlannerTest, CopyBoundStepMatchesTheScheduleWithReclaim) {
  PlanInput input = PresetInput("llama-8b", 8192);
  input.tflops = 20000;  // compute far faster than PCIe
  const Plan plan = MustPlan(input);
  ASSERT_GT(plan.pcie_s, plan.compute_s);
  // The schedule (keep_last 1, prefetch 1, max_inflight 2, L = 32; per layer F forward,
  // Bk = 3F backward, C = B / 55 GB/s per copy alone):
  // - Forward, 2F < C: the D2H engine is the bottleneck. Layer k's copy runs back to back
  //   over [F + kC, F + (k + 1)C]. From BeginGroup(3) on, the in-flight bound makes the host
  //   wait for copy k - 3 before it issues copy k - 1, so layer k's compute (k >= 3) is
  //   issued, and runs, at F + (k - 2)C. Forward ends at host time F + 29C (after copy 28)
  //   with copies 29 and 30 running until F + 30C and F + 31C; bwd31 starts at 2F + 29C.
  // - Backward is all issued at host time F + 29C: Acquire(31) (kept) reclaims layer 30 by
  //   prefetch, Acquire(30) reclaims 29, Acquire(29) prefetches 28, whose copy waits for the
  //   compute queued then: it starts at s = 2F + 29C + 2Bk = 8F + 29C. Copy 29 ended before
  //   (7F > C); copy 30 did not (2C > 7F): until it ends, both directions share the 97 GB/s
  //   cap at 48.5 GB/s each (it ends first, as e - s < C), which delays restore 28 by
  //   delta = (e - s) * (55 / 48.5 - 1), e = F + 31C the end copy 30 had alone.
  // - The 29 restores (28 .. 0) then run back to back, every backward waiting for its copy
  //   (Bk < C), and bwd0 ends at s + 29C + delta + Bk.
  // Step = 11F + 58C + delta; compute = 32 * 4F = 128F; exposed = 58C - 117F + delta. The
  // compute stream's waits are backward's share of it, 29(C - Bk) + delta; the rest,
  // 29C - 30F, is forward compute issued late by the host waiting in the in-flight bound.
  // Without reclaim the step would carry two more restores (2C).
  const double f = plan.forward_s_per_layer;
  const double bk = plan.backward_s_per_layer;
  const double c = static_cast<double>(plan.bytes_per_layer) / (input.h2d_gbps * 1e9);
  ASSERT_EQ(input.d2h_gbps, input.h2d_gbps);
  ASSERT_LT(2 * f, c);
  ASSERT_GT(7 * f, c);
  ASSERT_LT(7 * f, 2 * c);
  ASSERT_LT(bk, c);
  const double shared_gbps = input.bidir_gbps / 2;
  ASSERT_LT(shared_gbps, input.h2d_gbps);
  const double s = 8 * f + 29 * c;
  const double e = f + 31 * c;
  const double delta = (e - s) * (input.h2d_gbps / shared_gbps - 1);
  const double expected = 58 * c - 117 * f + delta;
  EXPECT_NEAR(plan.compute_s, 128 * f, 1e-9 * plan.compute_s);
  EXPECT_NEAR(plan.exposed_s, expected, 1e-6 * expected);
  EXPECT_NEAR(plan.backward_wait_s, 29 * (c - bk) + delta, 1e-6 * expected);
  EXPECT_NEAR(plan.engine_exposed_wait_s, 29 * (c - bk) + delta, 1e-6 * expected);
  EXPECT_NEAR(plan.step_s, plan.compute_s + plan.exposed_s, 1e-9 * plan.step_s);
  EXPECT_LE(plan.exposed_s, plan.pcie_s);
  // The engine bounds what it holds on the device: keep_last + in-flight + prefetch + 1.
  EXPECT_LE(plan.peak_engine_device_bytes,
            static_cast<size_t>(input.keep_last + input.max_inflight_d2h_groups +
                                input.prefetch_depth + 1) *
                plan.bytes_per_layer);
}

TEST(PlannerTest, ScaledSimulationMatchesUnscaled) {
  // A small shape whose bytes the simulation moves as they are, and the same schedule
  // with 512x the bytes at 512x the bandwidth and FLOP rate: every time is identical, but
  // the second run simulates scaled-down stand-ins.
  PlanInput small;
  small.model = ModelShape{"tiny", 12, 128, 512, 4, 2};
  small.seq = 256;  // 64 KiB per layer: simulated as is
  small.tflops = 0.05;
  small.d2h_gbps = 1;
  small.h2d_gbps = 0.8;
  small.bidir_gbps = 1.5;
  for (int prefetch : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("prefetch=", prefetch));
    small.prefetch_depth = prefetch;
    PlanInput large = small;
    large.seq *= 512;
    large.tflops *= 512;
    large.d2h_gbps *= 512;
    large.h2d_gbps *= 512;
    large.bidir_gbps *= 512;
    const Plan a = MustPlan(small);
    const Plan b = MustPlan(large);
    EXPECT_EQ(a.sim_bytes_per_layer, a.bytes_per_layer);
    EXPECT_LT(b.sim_bytes_per_layer, b.bytes_per_layer);
    EXPECT_NEAR(a.compute_s, b.compute_s, 1e-9 * a.compute_s);
    EXPECT_NEAR(a.exposed_s, b.exposed_s, 1e-9 * a.step_s);
    EXPECT_NEAR(a.step_s, b.step_s, 1e-9 * a.step_s);
  }
}

// --- Flags --------------------------------------------------------------------------

absl::StatusOr<PlanRequest> Parse(const std::string& command_line) {
  std::vector<std::string> args = absl::StrSplit(command_line, ' ', absl::SkipEmpty());
  return ParsePlanArgs(args);
}

TEST(PlannerFlagsTest, ParsesPresetOverridesAndBothValueForms) {
  absl::StatusOr<PlanRequest> request = Parse(
      "--preset=llama-8b --seq 4096 --batch=2 --dtype=fp16 --tflops=400.5 "
      "--d2h_gbps=25 --h2d_gbps 26 --bidir_gbps=50 --gpus_per_node=4 --keep_last=0 "
      "--prefetch_depth=3 --max_inflight_d2h_groups=5 --layers=16 --json");
  ASSERT_TRUE(request.ok()) << request.status();
  const PlanInput& input = request->input;
  EXPECT_TRUE(request->json);
  EXPECT_FALSE(request->help);
  EXPECT_EQ(input.model.layers, 16);  // overrides the preset's 32
  EXPECT_EQ(input.model.hidden, 4096);
  EXPECT_EQ(input.model.name, "llama-8b (modified)");
  EXPECT_EQ(input.seq, 4096);
  EXPECT_EQ(input.batch, 2);
  EXPECT_EQ(input.dtype, DType::kFp16);
  EXPECT_DOUBLE_EQ(input.tflops, 400.5);
  EXPECT_DOUBLE_EQ(input.d2h_gbps, 25);
  EXPECT_DOUBLE_EQ(input.h2d_gbps, 26);
  EXPECT_DOUBLE_EQ(input.bidir_gbps, 50);
  EXPECT_EQ(input.gpus_per_node, 4);
  EXPECT_EQ(input.keep_last, 0);
  EXPECT_EQ(input.prefetch_depth, 3);
  EXPECT_EQ(input.max_inflight_d2h_groups, 5);
}

TEST(PlannerFlagsTest, DefaultsAndCustomShape) {
  absl::StatusOr<PlanRequest> request =
      Parse("--layers=4 --hidden=256 --ffn=1024 --heads=4 --kv_heads=2");
  ASSERT_TRUE(request.ok()) << request.status();
  const PlanInput& input = request->input;
  EXPECT_EQ(input.model.name, "custom");
  EXPECT_EQ(input.seq, 4096);
  EXPECT_EQ(input.batch, 1);
  EXPECT_EQ(input.dtype, DType::kBf16);
  EXPECT_DOUBLE_EQ(input.tflops, 700);
  EXPECT_DOUBLE_EQ(input.d2h_gbps, 55);
  EXPECT_DOUBLE_EQ(input.h2d_gbps, 55);
  EXPECT_DOUBLE_EQ(input.bidir_gbps, 97);
  EXPECT_EQ(input.gpus_per_node, 8);
  EXPECT_EQ(input.keep_last, 1);
  EXPECT_EQ(input.prefetch_depth, 1);
  EXPECT_FALSE(request->json);
  EXPECT_TRUE(Parse("--help").value().help);
  EXPECT_TRUE(Parse("-h").value().help);
}

TEST(PlannerFlagsTest, HostSizesAndName) {
  absl::StatusOr<PlanRequest> request =
      Parse("--preset=llama-70b --host_ram=2TiB --host_memory_limit=100GB --name=my-model");
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->input.host_ram_bytes, size_t{2} << 40);
  EXPECT_EQ(request->input.host_memory_limit_bytes, size_t{100000000000});
  EXPECT_EQ(request->input.model.name, "my-model");
  EXPECT_EQ(request->input.model.layers, 80);  // --name changes the label only

  const std::pair<const char*, size_t> sizes[] = {
      {"1000", 1000},           {"1000b", 1000},         {"4KiB", 4096},
      {"1.5GiB", 3 * kGiB / 2}, {"512gb", 512000000000}, {"2tib", size_t{2} << 40},
      {"3MB", 3000000},         {"1.25MiB", 1310720},
  };
  for (const auto& [text, bytes] : sizes) {
    absl::StatusOr<size_t> parsed = ParseByteSize("host_ram", text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status();
    EXPECT_EQ(*parsed, bytes) << text;
  }
  EXPECT_EQ(DefaultHostMemoryLimit(size_t{2} << 40, 8), 128 * kGiB);
  EXPECT_EQ(DefaultHostMemoryLimit(64 * kGiB, 1), 32 * kGiB);
  EXPECT_EQ(DefaultHostMemoryLimit(64 * kGiB, 0), 32 * kGiB);  // as for one rank
}

TEST(PlannerFlagsTest, EveryBadValueNamesItsFlag) {
  struct Case {
    const char* command_line;
    const char* expected;  // a substring of the message
  };
  const Case cases[] = {
      {"--preset=llama-8b --seq=abc", "--seq must be a positive integer, got 'abc'"},
      {"--preset=llama-8b --seq=0", "--seq must be a positive integer, got '0'"},
      {"--preset=llama-8b --seq=-5", "--seq must be a positive integer, got '-5'"},
      {"--preset=llama-8b --seq=1.5", "--seq must be a positive integer, got '1.5'"},
      {"--preset=llama-8b --seq=", "--seq must be a positive integer, got ''"},
      {"--seq=abc", "--seq must be a positive integer"},  // before "--layers is required"
      {"--preset=llama-8b --batch=two", "--batch must be a positive integer, got 'two'"},
      {"--preset=llama-8b --layers=x", "--layers must be a positive integer, got 'x'"},
      {"--preset=llama-8b --hidden=0", "--hidden must be a positive integer"},
      {"--preset=llama-8b --ffn=-1", "--ffn must be a positive integer"},
      {"--preset=llama-8b --heads=h", "--heads must be a positive integer"},
      {"--preset=llama-8b --kv_heads=", "--kv_heads must be a positive integer"},
      {"--preset=llama-8b --heads=30", "must be a multiple of --heads (30)"},
      {"--preset=llama-8b --kv_heads=5", "--heads (32) must be a multiple of --kv_heads (5)"},
      {"--preset=llama-8b --dtype=int8", "--dtype must be one of bf16, fp16, fp32, got 'int8'"},
      {"--preset=llama-8b --tflops=fast", "--tflops must be a positive number, got 'fast'"},
      {"--preset=llama-8b --tflops=0", "--tflops must be a positive number, got '0'"},
      {"--preset=llama-8b --tflops=nan", "--tflops must be a positive number, got 'nan'"},
      {"--preset=llama-8b --tflops=inf", "--tflops must be a positive number, got 'inf'"},
      {"--preset=llama-8b --d2h_gbps=-1", "--d2h_gbps must be a positive number"},
      {"--preset=llama-8b --h2d_gbps=x", "--h2d_gbps must be a positive number"},
      {"--preset=llama-8b --bidir_gbps=0", "--bidir_gbps must be a positive number"},
      {"--preset=llama-8b --gpus_per_node=0", "--gpus_per_node must be a positive integer"},
      {"--preset=llama-8b --keep_last=-1", "--keep_last must be a non-negative integer, got '-1'"},
      {"--preset=llama-8b --keep_last=33", "--keep_last must be at most --layers (32), got 33"},
      {"--preset=llama-8b --prefetch_depth=x", "--prefetch_depth must be a non-negative integer"},
      {"--preset=llama-8b --max_inflight_d2h_groups=0",
       "--max_inflight_d2h_groups must be a positive integer"},
      {"--preset=llama-8b --json=maybe", "--json must be true or false, got 'maybe'"},
      {"--preset=llama-8b --attention_flops=2", "--attention_flops must be true or false"},
      {"--preset=gpt-5", "--preset must be one of llama-1b, llama-8b, llama-70b, got 'gpt-5'"},
      {"--preset=llama-8b --bogus=1", "unknown flag --bogus"},
      {"--preset=llama-8b --seq", "--seq needs a value"},
      {"--preset=llama-8b stray", "unexpected argument 'stray'"},
      {"--layers=4 --hidden=256 --ffn=1024 --heads=4", "--kv_heads is required without --preset"},
      {"--preset=llama-8b --layers=1000000", "--layers must be at most 100000"},
      {"--preset=llama-8b --host_ram=lots",
       "--host_ram must be a byte count such as 2TiB, 512GB or 1000000, got 'lots'"},
      {"--preset=llama-8b --host_ram=0", "--host_ram must be a byte count"},
      {"--preset=llama-8b --host_ram=2XB", "--host_ram must be a byte count"},
      {"--preset=llama-8b --host_ram=1.2.3GB", "--host_ram must be a byte count"},
      {"--preset=llama-8b --host_ram=99999999TiB", "--host_ram must be a byte count"},
      {"--preset=llama-8b --host_memory_limit=-1", "--host_memory_limit must be a byte count"},
      {"--preset=llama-8b --name=", "--name must not be empty"},
      {"--preset=llama-8b --seq=9000000000000", "--seq x --batch x --hidden"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PlanRequest> request = Parse(c.command_line);
    ASSERT_FALSE(request.ok()) << c.command_line;
    EXPECT_NE(request.status().message().find(c.expected), std::string::npos)
        << c.command_line << "\n  got: " << request.status().message()
        << "\n  want: " << c.expected;
  }
}

TEST(PlannerFlagsTest, ValidatePlanInputNamesTheFlagForProgrammaticInput) {
  const PlanInput good = PresetInput("llama-1b", 1024);
  EXPECT_TRUE(ValidatePlanInput(good).ok());
  struct Case {
    PlanInput input;
    const char* flag;
  };
  std::vector<Case> cases;
  cases.push_back({good, "--tflops"});
  cases.back().input.tflops = -1;
  cases.push_back({good, "--h2d_gbps"});
  cases.back().input.h2d_gbps = std::nan("");
  cases.push_back({good, "--seq"});
  cases.back().input.seq = 0;
  cases.push_back({good, "--prefetch_depth"});
  cases.back().input.prefetch_depth = -1;
  cases.push_back({good, "--max_inflight_d2h_groups"});
  cases.back().input.max_inflight_d2h_groups = 0;
  cases.push_back({good, "--layers"});
  cases.back().input.model.layers = 0;
  for (const Case& c : cases) {
    absl::Status status = ValidatePlanInput(c.input);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.flag;
    EXPECT_NE(status.message().find(c.flag), std::string::npos) << status;
    EXPECT_FALSE(MakePlan(c.input).ok()) << c.flag;
  }
}

// --- Output -------------------------------------------------------------------------

TEST(PlannerOutputTest, TableAndJson) {
  const PlanInput input = PresetInput("llama-70b", 131072);
  const Plan plan = MustPlan(input);
  const std::string table = FormatPlanTable(input, plan);
  for (const char* expected :
       {"llama-70b: 80 layers", "hidden state per layer        2.00 GiB",
        "GPU bytes saved               158.00 GiB", "host bytes per node (8 GPUs)  1.23 TiB",
        "layers offloaded              79 of 80", "exposed transfer per step     0 s"}) {
    EXPECT_NE(table.find(expected), std::string::npos) << expected << "\n" << table;
  }
  const std::string json = FormatPlanJson(input, plan);
  ASSERT_FALSE(json.empty());
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.substr(json.size() - 2), "}\n");
  EXPECT_EQ(json.find('\n'), json.size() - 1);  // one object, one line
  for (const char* key : {"\"bytes_per_layer\": 2147483648", "\"offloaded_layers\": 79",
                          "\"gpu_bytes_saved\": 169651208192", "\"exposed_s_per_step\": 0",
                          "\"model\": \"llama-70b\"", "\"pcie_s_per_step\": "}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << "\n" << json;
  }
  for (const char* not_json : {": nan", ": -nan", ": inf", ": -inf"}) {
    EXPECT_EQ(json.find(not_json), std::string::npos) << not_json;
  }
  // No host RAM given: no host rows; every offloaded layer counts as fitting.
  EXPECT_EQ(table.find("host limit per GPU"), std::string::npos) << table;
  EXPECT_EQ(table.find("host RAM per node"), std::string::npos) << table;
  EXPECT_NE(json.find("\"host_limit_per_gpu\": 0, \"layers_within_host_limit\": 79"),
            std::string::npos)
      << json;
}

TEST(PlannerOutputTest, HostRamAndTheDefaultLimit) {
  PlanInput input = PresetInput("llama-70b", 131072);
  input.host_ram_bytes = size_t{2} << 40;  // 2 TiB: 128 GiB per GPU by default, 2 GiB layers
  Plan plan = MustPlan(input);
  EXPECT_EQ(plan.host_limit_per_gpu, 128 * kGiB);
  EXPECT_EQ(plan.layers_within_host_limit, 64);
  std::string table = FormatPlanTable(input, plan);
  for (const char* expected :
       {"host RAM per node             2.00 TiB  (offload needs 61.7%)",
        "host limit per GPU            128.00 GiB  (default: half of RAM / 8 GPUs; only 64 of "
        "79 offloaded layers fit, the rest stay on the GPU)"}) {
    EXPECT_NE(table.find(expected), std::string::npos) << expected << "\n" << table;
  }
  EXPECT_NE(FormatPlanJson(input, plan)
                .find("\"host_ram_bytes\": 2199023255552, "
                      "\"host_limit_per_gpu\": 137438953472, "
                      "\"layers_within_host_limit\": 64"),
            std::string::npos);

  input.host_memory_limit_bytes = 200 * kGiB;  // an explicit limit wins over the default
  plan = MustPlan(input);
  EXPECT_EQ(plan.host_limit_per_gpu, 200 * kGiB);
  EXPECT_EQ(plan.layers_within_host_limit, 79);
  table = FormatPlanTable(input, plan);
  EXPECT_NE(table.find("200.00 GiB  (--host_memory_limit; all 79 offloaded layers fit)"),
            std::string::npos)
      << table;
}

}  // namespace
}  // namespace ckpt_offload::planner
