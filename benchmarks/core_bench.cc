// Microbenchmarks for offload_core.
//
//   bazel run -c opt //benchmarks:core_bench -- --benchmark_filter=Arena
//
// Every arena benchmark warms the pool up before timing and fails (SkipWithError) if the
// timed loop reached the backend: they measure the steady-state bookkeeping cost, which is
// what a training step pays per offloaded tensor.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "offload_core/engine.h"
#include "offload_core/host_arena.h"
#include "offload_core/sim_device.h"

namespace ckpt_offload {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// Fails the benchmark when the timed region allocated from the backend.
void RequireNoBackendAllocations(benchmark::State& state, const HostArena& arena, int64_t before) {
  if (arena.stats().backend_allocations != before) {
    state.SkipWithError("backend allocation inside the timed loop");
  }
}

// ------------------------------------------------------------------------------------------
// HostArena

// One Allocate + Free of the same size: the cheapest path (best fit hits, free coalesces
// back into the whole slab). Arg: block bytes. Slabs come from std::aligned_alloc and are
// never touched, so large sizes cost no page faults.
void BM_ArenaAllocFree(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  HostArena arena(MakeAlignedHostBackend());
  arena.Free(arena.Allocate(bytes).value());  // warm-up: the slab stays in the pool
  const int64_t backend_before = arena.stats().backend_allocations;
  for (auto _ : state) {
    absl::StatusOr<HostBlock> block = arena.Allocate(bytes);
    benchmark::DoNotOptimize(block);
    arena.Free(*block);
  }
  RequireNoBackendAllocations(state, arena, backend_before);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ArenaAllocFree)->Arg(4 * kKiB)->Arg(1 * kMiB)->Arg(64 * kMiB);

// Many small blocks live at once in shared slabs, freed in random order: exercises the
// best-fit index and neighbour coalescing with fragmented slabs. Arg: live blocks.
void BM_ArenaSmallBlocksRandomOrder(benchmark::State& state) {
  const int live_blocks = static_cast<int>(state.range(0));
  HostArena arena(MakeAlignedHostBackend());
  std::mt19937_64 rng(7);
  std::vector<size_t> sizes(live_blocks);
  for (size_t& size : sizes) size = 1 + rng() % (64 * kKiB);
  std::vector<size_t> free_order(live_blocks);
  for (int i = 0; i < live_blocks; ++i) free_order[i] = i;
  std::shuffle(free_order.begin(), free_order.end(), rng);

  std::vector<HostBlock> blocks(live_blocks);
  auto run_round = [&] {
    for (int i = 0; i < live_blocks; ++i) blocks[i] = arena.Allocate(sizes[i]).value();
    for (size_t index : free_order) arena.Free(blocks[index]);
  };
  run_round();  // warm-up
  const int64_t backend_before = arena.stats().backend_allocations;
  for (auto _ : state) run_round();
  RequireNoBackendAllocations(state, arena, backend_before);
  state.SetItemsProcessed(state.iterations() * live_blocks);  // one Allocate + one Free each
}
BENCHMARK(BM_ArenaSmallBlocksRandomOrder)->Arg(64)->Arg(1024);

// A training step with a new sequence length each time: 31 large blocks in order, freed in
// reverse, lengths uniform in [S/2, S] with 64 MiB blocks at S. Items are blocks.
void BM_ArenaVariableLengthSteps(benchmark::State& state) {
  constexpr int kLayers = 31;
  constexpr size_t kBlockAtFull = 64 * kMiB;
  HostArena arena(MakeAlignedHostBackend());
  std::mt19937_64 rng(3);
  std::vector<size_t> step_bytes(256);
  for (size_t& bytes : step_bytes) bytes = kBlockAtFull / 2 + rng() % (kBlockAtFull / 2 + 1);
  std::vector<HostBlock> blocks(kLayers);
  auto run_step = [&](size_t bytes) {
    for (int layer = 0; layer < kLayers; ++layer) blocks[layer] = arena.Allocate(bytes).value();
    for (int layer = kLayers - 1; layer >= 0; --layer) arena.Free(blocks[layer]);
  };
  run_step(kBlockAtFull);  // warm-up: the full-length step sizes the pool
  const int64_t backend_before = arena.stats().backend_allocations;
  size_t step = 0;
  for (auto _ : state) run_step(step_bytes[step++ % step_bytes.size()]);
  RequireNoBackendAllocations(state, arena, backend_before);
  state.SetItemsProcessed(state.iterations() * kLayers);
}
BENCHMARK(BM_ArenaVariableLengthSteps);

// The host pool over adversarial length sequences, at 8B scale (32 layers, 8 KiB per token
// and layer, a float32 head input of twice that, two small fixed tables), with the slabs'
// addresses made up (nothing is touched, so GiBs cost nothing). Not a timing: one iteration
// runs the whole trace and the counters are the figures. Arg 0: no hint, Arg 1:
// Reserve(the longest step's bytes) first. Pinned memory costs ~0.45 s per GiB on the GPU
// box, so `gib_after_first_step` is what later steps would pay.
class CountingBackend : public HostMemoryBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const uintptr_t base = next_;
    next_ += (bytes / kMiB + 2) * kMiB;
    allocated_bytes += bytes;
    return reinterpret_cast<void*>(base);
  }
  void Free(void*, size_t) override {}
  const char* name() const override { return "counting"; }
  size_t allocated_bytes = 0;

 private:
  uintptr_t next_ = uintptr_t{1} << 44;
};

struct PoolTraceFigures {
  int64_t steps = 0;
  int64_t growing_steps = 0;
  int64_t first_step_allocations = 0;
  int64_t later_allocations = 0;
  int64_t covered_step_allocations = 0;  // steps no longer than an earlier one
  int64_t most_in_a_later_step = 0;
  double gib_after_first_step = 0;
  double worst_reserved_over_peak = 0;  // at step ends
};

PoolTraceFigures RunPoolTrace(const std::vector<int64_t>& lengths, bool reserve, bool print) {
  constexpr int kLayers = 32;
  constexpr size_t kPerToken = 8 * kKiB;
  auto backend = std::make_unique<CountingBackend>();
  CountingBackend* counting = backend.get();
  HostArena arena(std::move(backend));
  auto step_bytes = [&](int64_t seq) {
    return 2 * 256 * kKiB + kLayers * kPerToken * seq + 2 * kPerToken * seq;
  };
  if (reserve) {
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    (void)arena.Reserve(step_bytes(longest));
  }
  PoolTraceFigures figures;
  int64_t longest = 0;
  size_t bytes_after_first = 0;
  std::vector<HostBlock> blocks;
  for (size_t step = 0; step < lengths.size(); ++step) {
    const int64_t seq = lengths[step];
    const ArenaStats before = arena.stats();
    const size_t bytes_before = counting->allocated_bytes;
    blocks.clear();
    for (int i = 0; i < 2; ++i) blocks.push_back(arena.Allocate(256 * kKiB).value());
    for (int layer = 0; layer < kLayers; ++layer) {
      blocks.push_back(arena.Allocate(kPerToken * seq).value());
    }
    blocks.push_back(arena.Allocate(2 * kPerToken * seq).value());
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) arena.Free(*it);
    const ArenaStats after = arena.stats();
    const int64_t made = after.backend_allocations - before.backend_allocations;
    ++figures.steps;
    if (made > 0) ++figures.growing_steps;
    if (step == 0) {
      figures.first_step_allocations = made;
    } else {
      figures.later_allocations += made;
      figures.most_in_a_later_step = std::max(figures.most_in_a_later_step, made);
      bytes_after_first += counting->allocated_bytes - bytes_before;
    }
    if (seq <= longest) figures.covered_step_allocations += made;
    longest = std::max(longest, seq);
    const double ratio = static_cast<double>(after.reserved_bytes) / after.peak_live_bytes;
    figures.worst_reserved_over_peak = std::max(figures.worst_reserved_over_peak, ratio);
    if (print && (made > 0 || step == 0)) {
      std::fprintf(stderr,
                   "  step %3zu seq %5lld: %2lld backend allocations (%.2f GiB), %2lld frees; "
                   "reserved %.2f GiB, peak live %.2f GiB (x%.3f)\n",
                   step, static_cast<long long>(seq), static_cast<long long>(made),
                   static_cast<double>(counting->allocated_bytes - bytes_before) / (1 << 30),
                   static_cast<long long>(after.backend_frees - before.backend_frees),
                   static_cast<double>(after.reserved_bytes) / (1 << 30),
                   static_cast<double>(after.peak_live_bytes) / (1 << 30), ratio);
    }
  }
  figures.gib_after_first_step = static_cast<double>(bytes_after_first) / (1 << 30);
  return figures;
}

std::vector<int64_t> AdversarialLengths() {
  std::vector<int64_t> lengths;
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int64_t> uniform(8192, 16384);
  lengths.push_back(10240);  // the first step is not the longest
  for (int i = 0; i < 20; ++i) lengths.push_back(uniform(rng));  // seq drawn in [8k, 16k]
  for (int64_t seq = 4096; seq <= 12288; seq += 2048) lengths.push_back(seq);  // rise
  for (int64_t seq = 12288; seq >= 4096; seq -= 2048) lengths.push_back(seq);  // fall
  for (int i = 0; i < 30; ++i) lengths.push_back(12288);                       // a long plateau
  lengths.push_back(18000);                                                    // then a new maximum
  for (int i = 0; i < 10; ++i) lengths.push_back(uniform(rng));
  return lengths;
}

void BM_ArenaPoolAdversarialLengths(benchmark::State& state) {
  const bool reserve = state.range(0) == 1;
  const std::vector<int64_t> lengths = AdversarialLengths();
  PoolTraceFigures figures;
  bool print = true;
  for (auto _ : state) {
    if (print) {
      std::fprintf(stderr, "pool trace (%s), steps with backend allocations:\n",
                   reserve ? "Reserve(longest step) first" : "no hint");
    }
    figures = RunPoolTrace(lengths, reserve, print);
    print = false;
  }
  state.counters["steps"] = static_cast<double>(figures.steps);
  state.counters["growing_steps"] = static_cast<double>(figures.growing_steps);
  state.counters["allocs_first_step"] = static_cast<double>(figures.first_step_allocations);
  state.counters["allocs_later"] = static_cast<double>(figures.later_allocations);
  state.counters["allocs_covered_steps"] = static_cast<double>(figures.covered_step_allocations);
  state.counters["most_in_a_later_step"] = static_cast<double>(figures.most_in_a_later_step);
  state.counters["gib_after_first_step"] = figures.gib_after_first_step;
  state.counters["reserved_over_peak"] = figures.worst_reserved_over_peak;
}
BENCHMARK(BM_ArenaPoolAdversarialLengths)->Arg(0)->Arg(1)->Iterations(1);

// Threads sharing one arena (the engine's forward and backward sides do): the cost of the
// single mutex under contention. Arg: block bytes.
void BM_ArenaAllocFreeShared(benchmark::State& state) {
  static HostArena* arena = nullptr;
  static int64_t backend_before = 0;
  const size_t bytes = static_cast<size_t>(state.range(0));
  if (state.thread_index() == 0) {
    arena = new HostArena(MakeAlignedHostBackend());
    // Warm-up: one block per possible thread at once, so no thread reaches the backend.
    std::vector<HostBlock> warm;
    for (int i = 0; i < 8; ++i) warm.push_back(arena->Allocate(bytes).value());
    for (const HostBlock& block : warm) arena->Free(block);
    backend_before = arena->stats().backend_allocations;
  }
  for (auto _ : state) {
    absl::StatusOr<HostBlock> block = arena->Allocate(bytes);
    benchmark::DoNotOptimize(block);
    arena->Free(*block);
  }
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    RequireNoBackendAllocations(state, *arena, backend_before);
    delete arena;
    arena = nullptr;
  }
}
BENCHMARK(BM_ArenaAllocFreeShared)->Arg(64 * kKiB)->Threads(1)->Threads(2)->UseRealTime();

// ------------------------------------------------------------------------------------------
// Engine (per-tensor overhead)
//
// Reserved for the engine benchmarks (per-tensor offload/restore overhead on the host and
// sim devices). Add them here, named BM_Engine*, so --benchmark_filter=Engine selects them.
//
// What is timed: only the engine's own calls (BeginGroup, OfferEntry, Acquire, Discard),
// each bracketed by a steady clock and summed into the iteration's manual time; the
// engine's calls into the device (event records and queries, copy launches) count, since
// the engine pays them per tensor. What is not: the caller's work around them (queueing
// compute, moving the simulated host clock, draining at the end of a step). Each
// iteration is one training step; `us_per_tensor` is the figure to hold to <= 2 us.

// Restore buffers from a pool filled up front, so the client adds no allocator cost to
// Acquire; sources are never freed (the benchmark reuses them every step).
class PooledClient : public OffloadEngine::Client {
 public:
  void ReleaseSource(EntryId, SourceToken) override {}
  absl::StatusOr<void*> AllocateRestore(EntryId, size_t) override {
    if (free_.empty()) return absl::ResourceExhaustedError("benchmark restore pool is empty");
    void* data = free_.back();
    free_.pop_back();
    return data;
  }
  void DropRestore(EntryId, void* data) override { free_.push_back(data); }
  void Recycle(void* data) { free_.push_back(data); }
  void Fill(std::vector<void*> buffers) { free_ = std::move(buffers); }

 private:
  std::vector<void*> free_;
};

class EngineClock {
 public:
  template <typename Fn>
  void Time(Fn&& fn) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double TakeSeconds() {
    const double seconds = seconds_;
    seconds_ = 0;
    return seconds;
  }

 private:
  double seconds_ = 0;
};

// A SimDevice, an engine on it, and the buffers one step needs. SimDevice records every op
// in its timeline without bound, and that growth (page faults, reallocation) would land
// inside the engine's timed calls, so the benchmark replaces the rig every few steps.
struct SimRig {
  static constexpr size_t kTensorBytes = 4 * kKiB;

  SimRig(const EngineOptions& options, int layers, int per_layer)
      : compute(sim.CreateStream()),
        sources(layers, std::vector<void*>(per_layer)),
        entries(layers, std::vector<EntryId>(per_layer)) {
    auto created = OffloadEngine::Create(&sim, &client, options);
    if (created.ok()) engine = std::move(*created);
    for (auto& layer : sources) {
      for (void*& source : layer) {
        source = sim.AllocateDeviceBuffer(kTensorBytes);
        pool.push_back(sim.AllocateDeviceBuffer(kTensorBytes));
      }
    }
    client.Fill(pool);
  }
  ~SimRig() {
    engine.reset();
    for (auto& layer : sources) {
      for (void* source : layer) sim.FreeDeviceBuffer(source);
    }
    for (void* data : pool) sim.FreeDeviceBuffer(data);
  }

  SimDevice sim;
  StreamHandle compute;
  PooledClient client;
  std::unique_ptr<OffloadEngine> engine;
  std::vector<std::vector<void*>> sources;
  std::vector<std::vector<EntryId>> entries;
  std::vector<void*> pool;
  std::vector<void*> restored;
};

// One checkpointed step per iteration on SimDevice. Args: layers, saved tensors per layer,
// keep_last, prefetch_depth. Tensors are 4 KiB so the simulated copies' memmove stays
// small; per-layer compute (50 us forward, 100 us backward) hides every copy, and the
// simulated host clock advances with it so events complete as they would on a GPU that
// keeps pace with the host.
void BM_EnginePerTensorSim(benchmark::State& state) {
  const int layers = static_cast<int>(state.range(0));
  const int per_layer = static_cast<int>(state.range(1));
  EngineOptions options;
  options.keep_last = static_cast<int>(state.range(2));
  options.prefetch_depth = static_cast<int>(state.range(3));
  constexpr double kForwardUs = 50;
  constexpr double kBackwardUs = 100;
  constexpr int kStepsPerRig = 64;

  EngineClock clock;
  bool failed = false;
  auto run_step = [&](SimRig& rig) {
    OffloadEngine& engine = *rig.engine;
    for (int layer = 0; layer < layers && !failed; ++layer) {
      clock.Time([&] {
        absl::StatusOr<GroupId> group = engine.BeginGroup(rig.compute);
        failed = !group.ok();
        for (int i = 0; i < per_layer && !failed; ++i) {
          auto offer = engine.OfferEntry(*group, rig.sources[layer][i], SimRig::kTensorBytes,
                                         /*source=*/0, rig.compute);
          failed = !offer.ok();
          if (!failed) rig.entries[layer][i] = offer->entry;
        }
      });
      rig.sim.Compute(rig.compute, kForwardUs);
      rig.sim.AdvanceHost(kForwardUs);
    }
    for (int layer = layers - 1; layer >= 0 && !failed; --layer) {
      clock.Time([&] {
        for (int i = 0; i < per_layer && !failed; ++i) {
          auto acquired = engine.Acquire(rig.entries[layer][i], rig.compute);
          failed = !acquired.ok();
          if (!failed && !acquired->resident) rig.restored.push_back(acquired->device_data);
        }
      });
      rig.sim.Compute(rig.compute, kBackwardUs);
      rig.sim.AdvanceHost(kBackwardUs);
      clock.Time([&] {
        for (int i = 0; i < per_layer; ++i) engine.Discard(rig.entries[layer][i]);
      });
    }
    // The step's end: the device drains, consumed restore buffers go back to the pool.
    if (!rig.sim.SynchronizeAll().ok()) failed = true;
    for (void* data : rig.restored) rig.client.Recycle(data);
    rig.restored.clear();
  };

  std::unique_ptr<SimRig> rig;
  int rig_steps = kStepsPerRig;
  double timed_seconds = 0;
  int64_t offloaded = 0;
  int64_t timed_steps = 0;
  for (auto _ : state) {
    if (rig_steps == kStepsPerRig) {
      if (rig) offloaded += rig->engine->stats().offloaded_tensors;
      rig = std::make_unique<SimRig>(options, layers, per_layer);
      if (!rig->engine) {
        state.SkipWithError("OffloadEngine::Create failed");
        return;
      }
      run_step(*rig);  // warm-up: the arena's slabs and the engine's maps reach their sizes
      rig->engine->ResetStats();
      clock.TakeSeconds();
      rig_steps = 0;
    }
    run_step(*rig);
    ++rig_steps;
    ++timed_steps;
    const double seconds = clock.TakeSeconds();
    timed_seconds += seconds;
    state.SetIterationTime(seconds);
  }
  if (rig) offloaded += rig->engine->stats().offloaded_tensors;
  if (failed) state.SkipWithError("an engine call failed");
  const double tensors = static_cast<double>(timed_steps) * layers * per_layer;
  state.SetItemsProcessed(static_cast<int64_t>(tensors));
  state.counters["us_per_tensor"] = tensors > 0 ? timed_seconds * 1e6 / tensors : 0;
  state.counters["offloaded_per_step"] =
      timed_steps > 0 ? static_cast<double>(offloaded) / static_cast<double>(timed_steps) : 0;
}
BENCHMARK(BM_EnginePerTensorSim)
    ->ArgNames({"layers", "per_layer", "keep_last", "prefetch"})
    ->Args({32, 4, 1, 1})
    ->Args({80, 2, 1, 1})
    ->Args({32, 4, 0, 2})
    ->UseManualTime();

}  // namespace
}  // namespace ckpt_offload
