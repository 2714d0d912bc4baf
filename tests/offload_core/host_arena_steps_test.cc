// HostArena on training-step traces: the pool never stalls a step.
//
// Each step allocates its entries in forward order and frees them in backward order; the
// next step's first entries may be allocated before the previous step's first entries
// (freed last) are gone, and small tensors may outlive their step. Entry sizes follow the
// step's sequence length. Over adversarial length sequences (random, rising then falling
// then rising, a long plateau then a new maximum, creeping up by 1 %) and entry mixes
// (sizes straddling the granularity and the small/large placement threshold, hand-built
// and pseudo-random) the tests assert after every operation and every step:
// - no backend allocation in a step that is not longer than every step before it;
// - few growth steps: backend allocations per growing step are bounded;
// - reserved <= 1.15 * high water of live bytes + slab granularity (the header's bound);
// - the cap is respected; live bytes are 0 at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "offload_core/host_arena.h"

namespace ckpt_offload {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// Hands out addresses in an unmapped range that nothing touches, so traces of many GiB
// cost no memory; counts calls and checks every Free matches an allocation.
class FakeBackend : public HostMemoryBackend {
 public:
  struct Ledger {
    int64_t allocations = 0;
    int64_t frees = 0;
    size_t outstanding_bytes = 0;
    std::map<uintptr_t, size_t> outstanding;
    int64_t bad_frees = 0;
  };
  explicit FakeBackend(std::shared_ptr<Ledger> ledger) : ledger_(std::move(ledger)) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const uintptr_t base = next_;
    next_ += (bytes + kMiB) / kMiB * kMiB + kMiB;
    ledger_->outstanding.emplace(base, bytes);
    ledger_->outstanding_bytes += bytes;
    ++ledger_->allocations;
    return reinterpret_cast<void*>(base);
  }
  void Free(void* ptr, size_t bytes) override {
    auto it = ledger_->outstanding.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == ledger_->outstanding.end() || it->second != bytes) {
      ++ledger_->bad_frees;
      return;
    }
    ledger_->outstanding.erase(it);
    ledger_->outstanding_bytes -= bytes;
    ++ledger_->frees;
  }
  const char* name() const override { return "fake"; }

 private:
  std::shared_ptr<Ledger> ledger_;
  uintptr_t next_ = uintptr_t{1} << 44;
};

// Which entries a step saves, as a function of its sequence length.
struct EntryMix {
  std::string name;
  // Per layer: bytes per token of each entry (a layer's hidden state, a second input...).
  std::vector<std::vector<double>> layer_bytes_per_token;
  // Saved after the last layer (a head's float32 input, ...), freed first in backward.
  std::vector<double> head_bytes_per_token;
  // Entries of fixed size per step (rotary tables, masks), allocated at the step start.
  std::vector<size_t> fixed_bytes;
  // Per layer, a small entry that outlives its step by this many steps (0: none).
  int side_lifetime_steps = 0;
  double side_bytes_per_token = 0;
  // The next step's first `overlap` layers allocate before the previous step's first
  // `overlap` layers are freed.
  int overlap = 0;
};

struct TraceOptions {
  ArenaOptions arena;
  int64_t reserve_bytes = 0;  // Reserve() before the first step when > 0
};

struct TraceReport {
  int64_t steps = 0;
  int64_t new_max_steps = 0;
  int64_t growing_steps = 0;
  int64_t allocations_in_non_max_steps = 0;
  int64_t max_allocations_in_a_step_after_the_first = 0;
  int64_t total_backend_allocations = 0;
  int64_t backend_frees = 0;
  double worst_reserved_over_bound = 0;   // reserved / (1.15 * W + granularity)
  double worst_transient_over_bound = 0;  // the same while slabs are retiring
  int64_t consolidations = 0;
  int64_t consolidations_in_the_next_step = 0;
  int64_t bound_or_cap_problems = 0;
  size_t retiring_bytes_at_end = 0;
  double worst_reserved_over_peak_at_step_ends = 0;
  size_t peak_live = 0;
  size_t reserved_at_end = 0;
  int64_t overbound_growths = 0;
  int64_t refusals = 0;
  std::string first_problem;
};

size_t EntryBytes(double bytes_per_token, int64_t seq) {
  return static_cast<size_t>(bytes_per_token * static_cast<double>(seq));
}

class TraceRunner {
 public:
  TraceRunner(const EntryMix& mix, const TraceOptions& options)
      : mix_(mix), options_(options), ledger_(std::make_shared<FakeBackend::Ledger>()) {
    arena_ = std::make_unique<HostArena>(std::make_unique<FakeBackend>(ledger_), options.arena);
    if (options.reserve_bytes > 0) {
      EXPECT_TRUE(arena_->Reserve(static_cast<size_t>(options.reserve_bytes)).ok());
    }
  }

  // A step's live set is its own entries plus what earlier steps left live (the previous
  // step's first layers with overlap, side tensors of the last side_lifetime_steps steps):
  // its key is its length and those steps' lengths. It is covered when an earlier step's
  // key is at least as large in every position.
  std::vector<int64_t> LiveSetKey(const std::vector<int64_t>& lengths, size_t step) const {
    const size_t history = std::max<size_t>(mix_.side_lifetime_steps, mix_.overlap > 0 ? 1 : 0);
    std::vector<int64_t> key;
    for (size_t back = 0; back <= history; ++back) {
      key.push_back(step >= back ? lengths[step - back] : 0);
    }
    return key;
  }

  TraceReport Run(const std::vector<int64_t>& lengths) {
    std::vector<std::vector<int64_t>> seen;
    for (size_t step = 0; step < lengths.size(); ++step) {
      const ArenaStats before = arena_->stats();
      RunStep(lengths[step], static_cast<int64_t>(step));
      const ArenaStats after = arena_->stats();
      const int64_t grew = after.backend_allocations - before.backend_allocations;
      const int64_t consolidated = after.consolidations - before.consolidations;
      const std::vector<int64_t> key = LiveSetKey(lengths, step);
      const bool new_max = std::none_of(seen.begin(), seen.end(), [&](const auto& earlier) {
        for (size_t i = 0; i < key.size(); ++i) {
          if (earlier[i] < key[i]) return false;
        }
        return true;
      });
      seen.push_back(key);
      ++report_.steps;
      if (new_max) ++report_.new_max_steps;
      if (grew > 0) ++report_.growing_steps;
      // The one allocation a later step may see: the consolidation finishing the growth of
      // the step before it, when that step's last blocks outlived it (overlap, tensors
      // kept for later steps).
      const bool finishes_previous_growth = consolidated == 1 && grew == 1 && previous_grew_;
      if (finishes_previous_growth) ++report_.consolidations_in_the_next_step;
      previous_grew_ = grew > 0 && !finishes_previous_growth;
      if (!new_max && grew > 0 && !finishes_previous_growth) {
        report_.allocations_in_non_max_steps += grew;
        Problem(absl::StrCat("step ", step, " (seq ", lengths[step],
                             ", an earlier step's live set covers it) made ", grew,
                             " backend allocations"));
      }
      if (step > 0) {
        report_.max_allocations_in_a_step_after_the_first =
            std::max(report_.max_allocations_in_a_step_after_the_first, grew);
      }
      const ArenaStats stats = arena_->stats();
      report_.worst_reserved_over_peak_at_step_ends =
          std::max(report_.worst_reserved_over_peak_at_step_ends,
                   static_cast<double>(stats.reserved_bytes) / stats.peak_live_bytes);
    }
    Drain();
    const ArenaStats stats = arena_->stats();
    report_.total_backend_allocations = stats.backend_allocations;
    report_.backend_frees = stats.backend_frees;
    report_.peak_live = stats.peak_live_bytes;
    report_.reserved_at_end = stats.reserved_bytes;
    report_.overbound_growths = stats.overbound_growths;
    report_.consolidations = stats.consolidations;
    report_.retiring_bytes_at_end = stats.retiring_bytes;
    report_.refusals = stats.cap_rejections + stats.backend_failures;
    EXPECT_EQ(stats.live_bytes, 0u) << mix_.name;
    EXPECT_EQ(stats.live_blocks, 0) << mix_.name;
    EXPECT_EQ(stats.reserved_bytes, ledger_->outstanding_bytes) << mix_.name;
    EXPECT_EQ(ledger_->bad_frees, 0) << mix_.name;
    return report_;
  }

  HostArena& arena() { return *arena_; }

 private:
  HostBlock Allocate(size_t bytes) {
    absl::StatusOr<HostBlock> block = arena_->Allocate(bytes);
    if (!block.ok()) {
      // Only the cap may refuse (the fake backend never does).
      if (block.status().code() != absl::StatusCode::kResourceExhausted) {
        Problem(absl::StrCat("unexpected error ", block.status().ToString()));
      }
      return HostBlock{};
    }
    CheckBounds();
    return *block;
  }

  void Free(const HostBlock& block) {
    if (block) arena_->Free(block);
    CheckBounds();
  }

  // reserved <= 1.15 * W + granularity, exactly: 20 * reserved <= 23 * W + 20 * G. A
  // growth that found only scattered free space may pass it until the slabs it retired are
  // free and replaced (the header's exception); nothing else may.
  void CheckBounds() {
    const ArenaStats stats = arena_->stats();
    const uint64_t twenty_bound =
        23 * uint64_t{stats.high_water_bytes} + 20 * uint64_t{options_.arena.slab_granularity};
    const double ratio = 20.0 * static_cast<double>(stats.reserved_bytes) / twenty_bound;
    if (stats.retiring_bytes > 0) {
      report_.worst_transient_over_bound = std::max(report_.worst_transient_over_bound, ratio);
    } else {
      report_.worst_reserved_over_bound = std::max(report_.worst_reserved_over_bound, ratio);
      if (20 * uint64_t{stats.reserved_bytes} > twenty_bound) {
        ++report_.bound_or_cap_problems;
        Problem(absl::StrCat("reserved ", stats.reserved_bytes, " above 1.15 * ",
                             stats.high_water_bytes, " + granularity"));
      }
    }
    if (stats.reserved_bytes > options_.arena.byte_cap) {
      ++report_.bound_or_cap_problems;
      Problem(absl::StrCat("reserved ", stats.reserved_bytes, " above the cap"));
    }
  }

  void Problem(const std::string& what) {
    if (report_.first_problem.empty()) report_.first_problem = what;
  }

  void RunStep(int64_t seq, int64_t step) {
    std::vector<HostBlock> fixed;
    for (size_t bytes : mix_.fixed_bytes) fixed.push_back(Allocate(bytes));
    std::vector<std::vector<HostBlock>> layers;
    std::vector<HostBlock> side;
    for (size_t layer = 0; layer < mix_.layer_bytes_per_token.size(); ++layer) {
      std::vector<HostBlock> blocks;
      for (double per_token : mix_.layer_bytes_per_token[layer]) {
        blocks.push_back(Allocate(EntryBytes(per_token, seq)));
      }
      if (mix_.side_lifetime_steps > 0) {
        side.push_back(Allocate(EntryBytes(mix_.side_bytes_per_token, seq)));
      }
      layers.push_back(std::move(blocks));
      // The previous step's first layers go once this step's first `overlap` ones are out.
      if (static_cast<int>(layer) + 1 == mix_.overlap || mix_.overlap == 0) FreeCarriedLayers();
    }
    if (mix_.overlap > static_cast<int>(layers.size())) FreeCarriedLayers();
    std::vector<HostBlock> head;
    for (double per_token : mix_.head_bytes_per_token) {
      head.push_back(Allocate(EntryBytes(per_token, seq)));
    }
    // Backward: the head, then layers in reverse; the first `overlap` layers stay for the
    // next step.
    for (auto it = head.rbegin(); it != head.rend(); ++it) Free(*it);
    const size_t kept = std::min<size_t>(std::max(mix_.overlap, 0), layers.size());
    for (size_t layer = layers.size(); layer-- > kept;) {
      for (auto it = layers[layer].rbegin(); it != layers[layer].rend(); ++it) Free(*it);
    }
    carried_layers_.assign(layers.begin(), layers.begin() + kept);
    for (auto it = fixed.rbegin(); it != fixed.rend(); ++it) Free(*it);
    side_tensors_.push_back(std::move(side));
    while (static_cast<int>(side_tensors_.size()) > mix_.side_lifetime_steps) {
      for (const HostBlock& block : side_tensors_.front()) Free(block);
      side_tensors_.pop_front();
    }
    (void)step;
  }

  void FreeCarriedLayers() {
    for (auto layer = carried_layers_.rbegin(); layer != carried_layers_.rend(); ++layer) {
      for (auto it = layer->rbegin(); it != layer->rend(); ++it) Free(*it);
    }
    carried_layers_.clear();
  }

  void Drain() {
    FreeCarriedLayers();
    for (const std::vector<HostBlock>& blocks : side_tensors_) {
      for (const HostBlock& block : blocks) Free(block);
    }
    side_tensors_.clear();
  }

  EntryMix mix_;
  TraceOptions options_;
  std::shared_ptr<FakeBackend::Ledger> ledger_;
  std::unique_ptr<HostArena> arena_;
  std::vector<std::vector<HostBlock>> carried_layers_;
  std::deque<std::vector<HostBlock>> side_tensors_;
  TraceReport report_;
  bool previous_grew_ = false;
};

// ---------------------------------------------------------------------------------------
// Length sequences (all deterministic). Lengths in tokens; the mixes below scale entries
// so that seq = 16384 is the longest any sequence reaches.

constexpr int64_t kMaxSeq = 16384;

std::vector<int64_t> UniformLengths(uint64_t seed, int steps, int64_t lo, int64_t hi) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  std::vector<int64_t> lengths(steps);
  for (int64_t& length : lengths) length = dist(rng);
  // The first step is not the longest.
  lengths[0] = lo + (hi - lo) / 4;
  return lengths;
}

std::vector<int64_t> RiseFallRise() {
  std::vector<int64_t> lengths;
  for (int64_t seq = 4096; seq <= 12288; seq += 1024) lengths.push_back(seq);
  for (int64_t seq = 12288; seq >= 2048; seq -= 1536) lengths.push_back(seq);
  for (int64_t seq = 3000; seq <= kMaxSeq; seq += 1100) lengths.push_back(seq);
  for (int64_t seq = kMaxSeq; seq >= 1024; seq -= 2500) lengths.push_back(seq);
  return lengths;
}

std::vector<int64_t> PlateauThenNewMax() {
  std::vector<int64_t> lengths(60, 8192);
  lengths.push_back(8193);  // one token longer: a new maximum by a hair
  for (int i = 0; i < 20; ++i) lengths.push_back(8192 - 37 * i);
  lengths.push_back(kMaxSeq);
  for (int i = 0; i < 20; ++i) lengths.push_back(kMaxSeq - 311 * i);
  return lengths;
}

std::vector<int64_t> CreepingUp() {
  std::vector<int64_t> lengths;
  for (double seq = 2048; seq <= kMaxSeq; seq *= 1.01) {
    lengths.push_back(static_cast<int64_t>(seq));
    lengths.push_back(static_cast<int64_t>(seq * 0.9));  // and a shorter one after each
  }
  return lengths;
}

struct NamedLengths {
  std::string name;
  std::vector<int64_t> lengths;
};

std::vector<NamedLengths> AllLengthSequences() {
  std::vector<NamedLengths> all;
  for (uint64_t seed : {1, 2, 3}) {
    all.push_back({absl::StrCat("uniform[8k,16k] seed ", seed),
                   UniformLengths(seed, 60, kMaxSeq / 2, kMaxSeq)});
    all.push_back({absl::StrCat("uniform[1k,16k] seed ", seed),
                   UniformLengths(seed + 100, 60, 1024, kMaxSeq)});
  }
  all.push_back({"rise-fall-rise", RiseFallRise()});
  all.push_back({"plateau then new max", PlateauThenNewMax()});
  all.push_back({"creeping up 1 %", CreepingUp()});
  return all;
}

// ---------------------------------------------------------------------------------------
// Entry mixes.

// A Llama-shaped model: 32 layers with one hidden-state input each (bf16), a float32 head
// input, two small rotary tables. `hidden` bytes per token per hidden state.
EntryMix LlamaMix(int layers, double hidden_bytes_per_token, int overlap, int side_steps) {
  EntryMix mix;
  mix.name = absl::StrCat("llama L", layers, " h", hidden_bytes_per_token, " overlap ", overlap,
                          " side ", side_steps);
  mix.layer_bytes_per_token.assign(layers, {hidden_bytes_per_token});
  mix.head_bytes_per_token = {2 * hidden_bytes_per_token};
  mix.fixed_bytes = {256 * kKiB, 256 * kKiB};
  mix.overlap = overlap;
  mix.side_lifetime_steps = side_steps;
  mix.side_bytes_per_token = hidden_bytes_per_token / 64;
  return mix;
}

// Entries whose sizes cross the 16 MiB placement threshold and the 2 MiB granularity as
// the length moves: per-layer sizes in [8, 24] MiB at seq 16k, with a second entry around
// 2 MiB.
EntryMix StraddlingMix(int overlap) {
  EntryMix mix;
  mix.name = absl::StrCat("straddling 16 MiB and 2 MiB, overlap ", overlap);
  for (int layer = 0; layer < 16; ++layer) {
    const double main_mib = 8.0 + layer;          // 8..23 MiB at kMaxSeq
    const double second_mib = 1.5 + 0.1 * layer;  // 1.5..3 MiB at kMaxSeq
    mix.layer_bytes_per_token.push_back(
        {main_mib * kMiB / kMaxSeq + 3.0, second_mib * kMiB / kMaxSeq + 0.5});
  }
  mix.head_bytes_per_token = {16.0 * kMiB / kMaxSeq + 1.0};  // 16 MiB (+1 B per token)
  mix.fixed_bytes = {16 * kMiB - 256, 2 * kMiB + 256, 255};
  mix.overlap = overlap;
  return mix;
}

// Pseudo-random: every layer draws 1-3 entries with per-token sizes spread over 2.5
// decades (from KiB to tens of MiB at the longest length).
EntryMix RandomMix(uint64_t seed) {
  std::mt19937_64 rng(seed);
  EntryMix mix;
  mix.name = absl::StrCat("random mix seed ", seed);
  std::uniform_real_distribution<double> log_size(10.0, 19.0);  // 1 KiB..512 KiB per 1k tokens
  const int layers = 8 + static_cast<int>(rng() % 25);
  for (int layer = 0; layer < layers; ++layer) {
    std::vector<double> entries(1 + rng() % 3);
    for (double& per_token : entries) per_token = std::exp2(log_size(rng)) / 1024 * 16;
    mix.layer_bytes_per_token.push_back(entries);
  }
  mix.head_bytes_per_token = {std::exp2(log_size(rng)) / 1024 * 32};
  mix.overlap = static_cast<int>(rng() % 3);
  mix.side_lifetime_steps = static_cast<int>(rng() % 3);
  mix.side_bytes_per_token = std::exp2(log_size(rng)) / 1024;
  absl::StrAppend(&mix.name, " overlap ", mix.overlap, " side ", mix.side_lifetime_steps);
  return mix;
}

bool CarriesBlocksAcrossSteps(const EntryMix& mix) {
  return mix.overlap > 0 || mix.side_lifetime_steps > 0;
}

void ExpectNeverStalls(const EntryMix& mix, const NamedLengths& lengths,
                       const TraceReport& report) {
  SCOPED_TRACE(absl::StrCat(mix.name, " / ", lengths.name));
  if (CarriesBlocksAcrossSteps(mix)) {
    // Blocks that outlive their step leave holes whose layout depends on more than the
    // live set; a covered step can then miss a contiguous range once (the header says so).
    EXPECT_LE(report.allocations_in_non_max_steps, 1) << report.first_problem;
  } else {
    EXPECT_EQ(report.allocations_in_non_max_steps, 0) << report.first_problem;
  }
  EXPECT_EQ(report.bound_or_cap_problems, 0) << report.first_problem;
  EXPECT_LE(report.worst_reserved_over_bound, 1.0);
  EXPECT_EQ(report.retiring_bytes_at_end, 0u);
  EXPECT_LE(report.growing_steps, report.new_max_steps + report.consolidations_in_the_next_step);
}

void Print(const EntryMix& mix, const NamedLengths& lengths, const TraceReport& report) {
  std::printf(
      "%-44s %-24s steps %3lld (new max %3lld, growing %3lld, covered but allocating %lld) "
      "backend allocs %4lld, frees %4lld, "
      "most in a later step %3lld; reserved/bound worst %.3f (%.3f while %lld growths over it "
      "were settled by %lld consolidations); reserved/peak at step ends worst %.3f; peak %.0f "
      "MiB\n",
      mix.name.c_str(), lengths.name.c_str(), static_cast<long long>(report.steps),
      static_cast<long long>(report.new_max_steps), static_cast<long long>(report.growing_steps),
      static_cast<long long>(report.allocations_in_non_max_steps),
      static_cast<long long>(report.total_backend_allocations),
      static_cast<long long>(report.backend_frees),
      static_cast<long long>(report.max_allocations_in_a_step_after_the_first),
      report.worst_reserved_over_bound, report.worst_transient_over_bound,
      static_cast<long long>(report.overbound_growths),
      static_cast<long long>(report.consolidations), report.worst_reserved_over_peak_at_step_ends,
      static_cast<double>(report.peak_live) / kMiB);
}

// Runs `mix` over every length sequence with default options, checking and printing each.
void ExpectNeverStallsOverEveryLengthSequence(const EntryMix& mix) {
  for (const NamedLengths& lengths : AllLengthSequences()) {
    TraceOptions options;
    TraceRunner runner(mix, options);
    const TraceReport report = runner.Run(lengths.lengths);
    ExpectNeverStalls(mix, lengths, report);
    Print(mix, lengths, report);
  }
}

TEST(HostArenaSteps, LlamaShapedStepsNeverStallAfterTheirLength) {
  for (int overlap : {0, 1, 2}) {
    for (int side_steps : {0, 2}) {
      const EntryMix mix = LlamaMix(32, 4096.0 * 2 / 8, overlap, side_steps);  // 8B at 1/8 size
      ExpectNeverStallsOverEveryLengthSequence(mix);
    }
  }
}

TEST(HostArenaSteps, StraddlingSizesNeverStallAfterTheirLength) {
  for (int overlap : {0, 1}) {
    const EntryMix mix = StraddlingMix(overlap);
    ExpectNeverStallsOverEveryLengthSequence(mix);
  }
}

TEST(HostArenaSteps, RandomMixesNeverStallAfterTheirLength) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    const EntryMix mix = RandomMix(seed);
    ExpectNeverStallsOverEveryLengthSequence(mix);
  }
}

// The live bytes of one step of `mix` at `seq` (blocks rounded to the alignment), for a
// mix that carries nothing across steps.
size_t StepLiveBytes(const EntryMix& mix, int64_t seq) {
  auto aligned = [](size_t bytes) {
    bytes = std::max<size_t>(bytes, 1);
    return (bytes + kHostBlockAlignment - 1) / kHostBlockAlignment * kHostBlockAlignment;
  };
  size_t total = 0;
  for (size_t bytes : mix.fixed_bytes) total += aligned(bytes);
  for (const std::vector<double>& layer : mix.layer_bytes_per_token) {
    for (double per_token : layer) total += aligned(EntryBytes(per_token, seq));
  }
  for (double per_token : mix.head_bytes_per_token) total += aligned(EntryBytes(per_token, seq));
  return total;
}

TEST(HostArenaSteps, ReserveUpFrontMakesTheOnlyBackendAllocation) {
  for (const EntryMix& mix : {LlamaMix(32, 4096.0 * 2 / 8, 0, 0), StraddlingMix(0)}) {
    for (const NamedLengths& lengths : AllLengthSequences()) {
      TraceOptions options;
      options.reserve_bytes = static_cast<int64_t>(StepLiveBytes(mix, kMaxSeq));
      TraceRunner runner(mix, options);
      const TraceReport report = runner.Run(lengths.lengths);
      SCOPED_TRACE(absl::StrCat(mix.name, " / ", lengths.name));
      EXPECT_EQ(report.total_backend_allocations, 1);
      EXPECT_EQ(report.reserved_at_end,
                static_cast<size_t>(options.reserve_bytes) +
                    (options.arena.slab_granularity -
                     options.reserve_bytes % options.arena.slab_granularity) %
                        options.arena.slab_granularity);
      EXPECT_EQ(report.first_problem, "");
      EXPECT_EQ(runner.arena().stats().reserve_calls, 1);
    }
  }
}

TEST(HostArenaSteps, TheCapHoldsAndRefusalsLeaveTheRestIntact) {
  const EntryMix mix = LlamaMix(32, 4096.0 * 2 / 8, 1, 2);
  const size_t longest = StepLiveBytes(LlamaMix(32, 4096.0 * 2 / 8, 0, 0), kMaxSeq);
  for (double cap_fraction : {0.3, 0.8, 1.0, 1.2}) {
    for (const NamedLengths& lengths : AllLengthSequences()) {
      TraceOptions options;
      options.arena.byte_cap = static_cast<size_t>(cap_fraction * longest);
      TraceRunner runner(mix, options);
      const TraceReport report = runner.Run(lengths.lengths);
      SCOPED_TRACE(absl::StrCat(mix.name, " / ", lengths.name, " cap ", cap_fraction));
      EXPECT_EQ(report.bound_or_cap_problems, 0) << report.first_problem;
      if (cap_fraction < 1.0) {
        EXPECT_GT(report.refusals, 0);
      }
    }
  }
}

}  // namespace
}  // namespace ckpt_offload
