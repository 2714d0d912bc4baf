// The host pool through OffloadEngine on the host device: training steps of varying length
// round-trip every byte, steps no longer than an earlier one reach no backend, the pool
// stays within the arena's bound, and ReserveHost sizes it up front.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "offload_core/device.h"
#include "offload_core/engine.h"

namespace ckpt_offload {
namespace {

constexpr size_t kKiB = size_t{1} << 10;

// Restore buffers from the heap; sources belong to the test and outlive every step.
class HeapClient : public OffloadEngine::Client {
 public:
  void ReleaseSource(EntryId, SourceToken) override {}
  absl::StatusOr<void*> AllocateRestore(EntryId, size_t bytes) override {
    auto buffer = std::make_unique<uint8_t[]>(bytes == 0 ? 1 : bytes);
    void* data = buffer.get();
    buffers_.emplace(data, std::move(buffer));
    return data;
  }
  void DropRestore(EntryId, void* data) override { buffers_.erase(data); }
  void Free(void* data) { buffers_.erase(data); }
  size_t outstanding() const { return buffers_.size(); }

 private:
  std::map<void*, std::unique_ptr<uint8_t[]>> buffers_;
};

class HostPoolEngine {
 public:
  explicit HostPoolEngine(EngineOptions options) : device_(MakeHostDevice()) {
    auto made = OffloadEngine::Create(device_.get(), &client_, options);
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) engine_ = std::move(*made);
  }

  OffloadEngine& engine() { return *engine_; }

  // One step: `layers` groups with one input of `bytes` each and a second, 1/8 as large,
  // forward then backward; every restored byte is checked.
  void RunStep(int layers, size_t bytes, uint32_t seed) {
    struct Saved {
      EntryId entry;
      std::vector<uint8_t>* source;
    };
    std::vector<std::vector<uint8_t>> sources;
    sources.reserve(2 * layers);
    std::vector<std::vector<Saved>> groups;
    std::mt19937 rng(seed);
    for (int layer = 0; layer < layers; ++layer) {
      absl::StatusOr<GroupId> group = engine_->BeginGroup(/*compute=*/0);
      ASSERT_TRUE(group.ok()) << group.status();
      std::vector<Saved> saved;
      for (size_t entry_bytes : {bytes, bytes / 8}) {
        sources.emplace_back(entry_bytes);
        const uint32_t salt = static_cast<uint32_t>(rng());
        for (size_t i = 0; i < entry_bytes; ++i) {
          sources.back()[i] = static_cast<uint8_t>(salt + i * 7 + (i >> 9));
        }
        absl::StatusOr<OffloadEngine::Offer> offer = engine_->OfferEntry(
            *group, sources.back().data(), entry_bytes, /*source=*/0, /*compute=*/0);
        ASSERT_TRUE(offer.ok()) << offer.status();
        saved.push_back({offer->entry, &sources.back()});
      }
      groups.push_back(std::move(saved));
    }
    for (auto group = groups.rbegin(); group != groups.rend(); ++group) {
      for (const Saved& saved : *group) {
        absl::StatusOr<OffloadEngine::Acquired> acquired =
            engine_->Acquire(saved.entry, /*compute=*/0);
        ASSERT_TRUE(acquired.ok()) << acquired.status();
        const void* data = acquired->resident ? saved.source->data() : acquired->device_data;
        EXPECT_EQ(std::memcmp(data, saved.source->data(), saved.source->size()), 0);
        if (!acquired->resident) client_.Free(acquired->device_data);
      }
      for (const Saved& saved : *group) engine_->Discard(saved.entry);
    }
    ASSERT_TRUE(engine_->Synchronize().ok());
  }

  ~HostPoolEngine() {
    if (engine_) {
      EXPECT_TRUE(engine_->Reset().ok());
    }
    engine_.reset();
    EXPECT_EQ(client_.outstanding(), 0u);
  }

 private:
  std::unique_ptr<Device> device_;
  HeapClient client_;
  std::unique_ptr<OffloadEngine> engine_;
};

EngineOptions SmallPoolOptions() {
  EngineOptions options;
  options.keep_last = 1;
  options.prefetch_depth = 1;
  options.arena.slab_granularity = 16 * kKiB;
  options.arena.min_slab_bytes = 64 * kKiB;
  return options;
}

size_t StepBytes(int64_t seq) { return static_cast<size_t>(seq) * 16; }  // 16 B per token

TEST(EngineHostPool, VariableLengthStepsReachTheBackendOnlyForNewLongestLengths) {
  HostPoolEngine t(SmallPoolOptions());
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int64_t> seq_dist(2048, 8192);
  int64_t longest = 0;
  for (int step = 0; step < 30; ++step) {
    const int64_t seq = step == 0 ? 3000 : seq_dist(rng);
    const int64_t before = t.engine().stats().arena.backend_allocations;
    t.RunStep(/*layers=*/12, StepBytes(seq), static_cast<uint32_t>(step));
    const EngineStats stats = t.engine().stats();
    SCOPED_TRACE(absl::StrCat("step ", step, " seq ", seq));
    if (seq <= longest) {
      EXPECT_EQ(stats.arena.backend_allocations, before);
    }
    longest = std::max(longest, seq);
    EXPECT_EQ(stats.arena.live_bytes, 0u);
    EXPECT_EQ(stats.arena.retiring_bytes, 0u);
    EXPECT_LE(20 * stats.arena.reserved_bytes,
              23 * stats.arena.high_water_bytes + 20 * (16 * kKiB));
  }
}

TEST(EngineHostPool, ReserveHostMakesTheOnlyBackendAllocation) {
  HostPoolEngine t(SmallPoolOptions());
  // Offloaded per step at the longest length: 11 of 12 layers (keep_last = 1), 9/8 each.
  const size_t longest_step = 11 * (StepBytes(8192) + StepBytes(8192) / 8);
  ASSERT_TRUE(t.engine().ReserveHost(longest_step).ok());
  EXPECT_EQ(t.engine().stats().arena.reserve_calls, 1);
  EXPECT_GE(t.engine().stats().arena.reserved_bytes, longest_step);
  std::mt19937_64 rng(6);
  std::uniform_int_distribution<int64_t> seq_dist(2048, 8192);
  for (int step = 0; step < 20; ++step) {
    t.RunStep(/*layers=*/12, StepBytes(seq_dist(rng)), static_cast<uint32_t>(step));
  }
  t.RunStep(/*layers=*/12, StepBytes(8192), 99);
  const EngineStats stats = t.engine().stats();
  EXPECT_EQ(stats.arena.backend_allocations, 1);
  EXPECT_GT(stats.offloaded_tensors, 0);
  EXPECT_EQ(stats.cap_fallbacks, 0);
  // A second, smaller hint changes nothing.
  ASSERT_TRUE(t.engine().ReserveHost(longest_step / 2).ok());
  EXPECT_EQ(t.engine().stats().arena.backend_allocations, 1);
}

TEST(EngineHostPool, ReserveHostAboveTheCapIsRefusedAndChangesNothing) {
  EngineOptions options = SmallPoolOptions();
  options.arena.byte_cap = 1 << 20;
  HostPoolEngine t(options);
  const absl::Status refused = t.engine().ReserveHost((1 << 20) + 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("byte cap"), absl::string_view::npos) << refused;
  EXPECT_EQ(t.engine().stats().arena.reserved_bytes, 0u);
  ASSERT_TRUE(t.engine().ReserveHost(1 << 20).ok());
  EXPECT_EQ(t.engine().stats().arena.reserved_bytes, size_t{1} << 20);
}

}  // namespace
}  // namespace ckpt_offload
