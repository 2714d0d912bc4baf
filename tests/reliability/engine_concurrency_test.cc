// OffloadEngine on the host device driven from several threads, the way PyTorch drives it:
// forward (BeginGroup/OfferEntry) on one thread, backward (Acquire/Discard) on another, for
// many steps, with a third thread reading stats and synchronizing. Every restored byte is
// checked, sources are freed the moment the engine releases them (so any later read by the
// engine is a use-after-free under ASan), and the arena is empty at the end. Run under
// --config=tsan to check the engine's locking.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "offload_core/device.h"
#include "offload_core/engine.h"

namespace ckpt_offload {
namespace {

uint8_t Pattern(uint64_t tag, size_t i) {
  uint64_t x = tag * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  return static_cast<uint8_t>(x >> 56);
}

// The caller's side of the engine: device sources (plain heap buffers standing for device
// memory) and restore buffers. Callbacks come with the engine's lock held, from whichever
// thread made the engine call.
class Client : public OffloadEngine::Client {
 public:
  struct Source {
    std::unique_ptr<uint8_t[]> data;
    size_t bytes = 0;
    uint64_t tag = 0;
    bool released = false;
  };

  // Makes a source buffer filled with tag's pattern, filed under `key` (the SourceToken it
  // is offered with); returns its address.
  const uint8_t* NewSource(SourceToken key, size_t bytes, uint64_t tag) {
    auto source = std::make_unique<Source>();
    source->data.reset(new uint8_t[bytes == 0 ? 1 : bytes]);
    source->bytes = bytes;
    source->tag = tag;
    for (size_t i = 0; i < bytes; ++i) source->data[i] = Pattern(tag, i);
    const uint8_t* data = source->data.get();
    std::lock_guard<std::mutex> lock(mu_);
    sources_[key] = std::move(source);
    return data;
  }
  // The engine named the entry of the source filed under `key`.
  void Bind(SourceToken key, EntryId entry) {
    std::lock_guard<std::mutex> lock(mu_);
    key_of_[entry] = key;
  }
  // OfferEntry failed: the source was never the engine's.
  void Forget(SourceToken key) {
    std::lock_guard<std::mutex> lock(mu_);
    sources_.erase(key);
  }

  void ReleaseSource(EntryId entry, SourceToken key) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++releases_[entry];
    sources_.erase(key);  // frees the device memory: the engine must never read it again
  }
  absl::StatusOr<void*> AllocateRestore(EntryId entry, size_t bytes) override {
    auto buffer = std::make_unique<uint8_t[]>(bytes == 0 ? 1 : bytes);
    std::memset(buffer.get(), 0xCD, bytes);
    void* data = buffer.get();
    std::lock_guard<std::mutex> lock(mu_);
    restores_[data] = std::move(buffer);
    return data;
  }
  void DropRestore(EntryId, void* data) override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_EQ(restores_.erase(data), 1u);
  }

  // Checks the bytes backward got for `entry` (resident: the caller's own source).
  std::string Verify(EntryId entry, const OffloadEngine::Acquired& acquired, size_t bytes,
                     uint64_t tag) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint8_t* data = nullptr;
    if (acquired.resident) {
      auto it = sources_.find(KeyOf(entry));
      if (it == sources_.end()) {
        return absl::StrCat("entry ", entry, " reported resident but its source was released");
      }
      data = it->second->data.get();
    } else {
      data = static_cast<const uint8_t*>(acquired.device_data);
      if (restores_.count(acquired.device_data) == 0) {
        return absl::StrCat("entry ", entry, " restored into an unknown buffer");
      }
    }
    for (size_t i = 0; i < bytes; ++i) {
      if (data[i] != Pattern(tag, i)) {
        return absl::StrCat("entry ", entry, " byte ", i, " of ", bytes,
                            acquired.resident ? " (resident)" : " (restored)", " differs");
      }
    }
    return "";
  }
  // The caller is done with an acquired restore buffer.
  void FreeRestore(void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    restores_.erase(data);
  }
  // Discard(entry) returned `source_needed`.
  void AfterDiscard(EntryId entry, bool source_needed) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!source_needed) sources_.erase(KeyOf(entry));
  }

  int MaxReleasesPerEntry() {
    std::lock_guard<std::mutex> lock(mu_);
    int most = 0;
    for (const auto& [entry, count] : releases_) most = std::max(most, count);
    return most;
  }
  size_t HeldSources() {
    std::lock_guard<std::mutex> lock(mu_);
    return sources_.size();
  }
  size_t HeldRestores() {
    std::lock_guard<std::mutex> lock(mu_);
    return restores_.size();
  }

 private:
  // mu_ held. 0 (no source has that key) when Bind has not come yet.
  SourceToken KeyOf(EntryId entry) const {
    auto it = key_of_.find(entry);
    return it == key_of_.end() ? 0 : it->second;
  }

  std::mutex mu_;
  std::map<SourceToken, std::unique_ptr<Source>> sources_;  // by the key offered with
  std::map<EntryId, SourceToken> key_of_;
  std::map<EntryId, int> releases_;
  std::map<void*, std::unique_ptr<uint8_t[]>> restores_;
};

struct Saved {
  EntryId entry;
  size_t bytes;
  uint64_t tag;
};
using StepRecord = std::vector<std::vector<Saved>>;  // per layer, in forward order

// Hands finished forwards to the backward thread; at most `depth` steps in flight.
class StepQueue {
 public:
  explicit StepQueue(size_t depth) : depth_(depth) {}
  void Push(StepRecord step) {
    std::unique_lock<std::mutex> lock(mu_);
    space_.wait(lock, [&] { return queue_.size() < depth_; });
    queue_.push_back(std::move(step));
    ready_.notify_one();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    ready_.notify_all();
  }
  std::optional<StepRecord> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    ready_.wait(lock, [&] { return !queue_.empty() || closed_; });
    if (queue_.empty()) return std::nullopt;
    StepRecord step = std::move(queue_.front());
    queue_.pop_front();
    space_.notify_one();
    return step;
  }

 private:
  std::mutex mu_;
  std::condition_variable ready_, space_;
  std::deque<StepRecord> queue_;
  size_t depth_;
  bool closed_ = false;
};

struct Params {
  int keep_last;
  int prefetch_depth;
  int max_inflight;
  size_t queue_depth;  // 1: backward of step s overlaps forward of step s+1
  int steps;
};

std::string Name(const testing::TestParamInfo<Params>& info) {
  const Params& p = info.param;
  return absl::StrCat("keep", p.keep_last, "_prefetch", p.prefetch_depth, "_inflight",
                      p.max_inflight, "_queue", p.queue_depth);
}

class EngineConcurrency : public testing::TestWithParam<Params> {};

TEST_P(EngineConcurrency, ForwardAndBackwardOnDifferentThreadsRoundTripEveryByte) {
  const Params p = GetParam();
  std::unique_ptr<Device> device = MakeHostDevice();
  Client client;
  EngineOptions options;
  options.keep_last = p.keep_last;
  options.prefetch_depth = p.prefetch_depth;
  options.max_inflight_d2h_groups = p.max_inflight;
  options.arena.min_slab_bytes = 64 << 10;  // small slabs: growth and reuse both happen
  options.arena.slab_granularity = 4 << 10;
  auto made = OffloadEngine::Create(device.get(), &client, options);
  ASSERT_TRUE(made.ok()) << made.status();
  OffloadEngine& engine = **made;

  StepQueue queue(p.queue_depth);
  std::atomic<bool> failed{false};
  std::mutex failure_mu;
  std::string failure;
  auto fail = [&](std::string what) {
    std::lock_guard<std::mutex> lock(failure_mu);
    if (!failed.exchange(true)) failure = std::move(what);
  };

  std::thread forward([&] {
    std::mt19937_64 rng(p.keep_last * 131 + p.prefetch_depth * 17 + p.queue_depth);
    uint64_t next_key = 1;
    for (int step = 0; step < p.steps && !failed; ++step) {
      const int layers = 2 + static_cast<int>(rng() % 6);
      StepRecord record(layers);
      for (int layer = 0; layer < layers; ++layer) {
        auto group = engine.BeginGroup(/*compute=*/0);
        if (!group.ok()) return fail(absl::StrCat("BeginGroup: ", group.status().ToString()));
        const int tensors = 1 + static_cast<int>(rng() % 3);
        for (int t = 0; t < tensors; ++t) {
          // Mostly a few KiB, sometimes empty, sometimes beyond the small-slab size.
          const uint64_t pick = rng() % 16;
          const size_t bytes = pick == 0   ? 0
                               : pick == 1 ? (80 << 10) + rng() % 4096
                                           : 1 + rng() % 8192;
          const uint64_t key = next_key++;
          const uint64_t tag = (static_cast<uint64_t>(step) << 20) | (layer << 4) | t;
          const uint8_t* src = client.NewSource(key, bytes, tag);
          auto offer = engine.OfferEntry(*group, src, bytes, /*source=*/key, /*compute=*/0);
          if (!offer.ok()) {
            client.Forget(key);
            return fail(absl::StrCat("OfferEntry: ", offer.status().ToString()));
          }
          client.Bind(key, offer->entry);
          record[layer].push_back({offer->entry, bytes, tag});
        }
      }
      queue.Push(std::move(record));
    }
    queue.Close();
  });

  std::thread backward([&] {
    int steps = 0;
    while (std::optional<StepRecord> record = queue.Pop()) {
      ++steps;
      for (auto layer = record->rbegin(); layer != record->rend(); ++layer) {
        for (const Saved& saved : *layer) {
          if (failed) continue;  // still discard below
          auto acquired = engine.Acquire(saved.entry, /*compute=*/0);
          if (!acquired.ok()) {
            fail(absl::StrCat("Acquire: ", acquired.status().ToString()));
            continue;
          }
          std::string bad = client.Verify(saved.entry, *acquired, saved.bytes, saved.tag);
          if (!bad.empty()) fail(bad);
          if (!acquired->resident) client.FreeRestore(acquired->device_data);
        }
        for (const Saved& saved : *layer) {
          client.AfterDiscard(saved.entry, engine.Discard(saved.entry));
        }
      }
    }
    EXPECT_EQ(steps, p.steps);
  });

  std::atomic<bool> done{false};
  std::thread observer([&] {
    while (!done) {
      EngineStats stats = engine.stats();
      if (stats.arena.reserved_bytes > 0 && stats.arena.live_bytes > stats.arena.reserved_bytes) {
        fail("arena live bytes exceed reserved bytes");
      }
      absl::Status synced = engine.Synchronize();
      if (!synced.ok()) fail(absl::StrCat("Synchronize: ", synced.ToString()));
      std::this_thread::yield();
    }
  });

  forward.join();
  backward.join();
  done = true;
  observer.join();
  ASSERT_FALSE(failed) << failure;

  ASSERT_TRUE(engine.Synchronize().ok());
  const EngineStats stats = engine.stats();
  EXPECT_EQ(stats.arena.live_bytes, 0u);
  EXPECT_EQ(stats.arena.live_blocks, 0);
  EXPECT_EQ(stats.device_held_bytes, 0u);
  EXPECT_GT(stats.offloaded_tensors, 0);
  EXPECT_EQ(stats.cap_fallbacks, 0);
  EXPECT_LE(client.MaxReleasesPerEntry(), 1);
  EXPECT_EQ(client.HeldSources(), 0u);
  EXPECT_EQ(client.HeldRestores(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, EngineConcurrency,
    testing::Values(Params{0, 0, 1, 1, 150}, Params{1, 1, 2, 1, 150}, Params{2, 2, 2, 1, 150},
                    // Deeper queue: forward runs a step ahead of backward, so a new forward
                    // begins while the previous backward still acquires.
                    Params{0, 1, 2, 3, 150}, Params{1, 2, 3, 3, 150}),
    Name);

}  // namespace
}  // namespace ckpt_offload
