// Microbenchmarks for offload_core.
//
//   bazel run -c opt //benchmarks:core_bench -- --benchmark_filter=Arena
//
// Every arena benchmark warms the pool up before timing and fails (SkipWithError) if the
// timed loop reached the backend: they measure the steady-state bookkeeping cost, which is
// what a training step pays per offloaded tensor.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "offload_core/host_arena.h"

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

}  // namespace
}  // namespace ckpt_offload
