// Fuzz target: saved-tensor metadata through OffloadEngine on the host device, the way the
// torch plugin uses it, without torch. A "tensor" is (element size, sizes, strides, storage
// offset) over a byte buffer standing for its device storage; the plugin's rule picks the
// storage span its elements touch, which is offered to the engine. After the forward, the
// backward acquires every entry in reverse and reads every element back through the same
// metadata: each must equal the original, whether the engine restored the span into a new
// buffer (element at span-relative offset) or kept it resident (the caller's storage).
//
// The input also chooses the schedule (keep_last, prefetch_depth, in-flight bound, a host cap
// that forces fallbacks), discards before backward (a freed graph), second acquires (a
// retained graph), device faults (copy/event) at any call and whether the caller resets or
// carries on after them. Checked: data is never wrong (a failed call may fail, but what it
// hands out is intact), a released source is never reported resident, every source is
// released at most once, and after Reset, or once every entry is discarded, the arena has no
// live bytes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "offload_core/device.h"
#include "offload_core/engine.h"
#include "offload_core/fault_injection.h"
#include "tests/reliability/fuzz/fuzz_input.h"

namespace ckpt_offload::fuzz {
namespace {

struct Meta {
  int64_t itemsize = 4;
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;  // in elements

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    return n;
  }
  // Byte range [begin, end) of the storage that the elements touch (non-empty tensors).
  std::pair<int64_t, int64_t> Span() const {
    int64_t last = 0;
    for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
    const int64_t begin = storage_offset * itemsize;
    return {begin, begin + (last + 1) * itemsize};
  }
  // Calls fn(storage byte offset of element) for every element, in index order.
  template <typename Fn>
  void ForEachElement(Fn fn) const {
    std::vector<int64_t> index(sizes.size(), 0);
    for (int64_t n = 0; n < numel(); ++n) {
      int64_t element = storage_offset;
      for (size_t d = 0; d < sizes.size(); ++d) element += index[d] * strides[d];
      fn(element * itemsize);
      for (size_t d = sizes.size(); d-- > 0;) {
        if (++index[d] < sizes[d]) break;
        index[d] = 0;
      }
    }
  }
};

uint8_t StorageByte(uint32_t storage, int64_t i) {
  uint32_t x = storage * 0x9E3779B1u + static_cast<uint32_t>(i) * 0x85EBCA77u;
  x ^= x >> 15;
  return static_cast<uint8_t>(x * 0x2C1B3C6Du >> 24);
}

class Client : public OffloadEngine::Client {
 public:
  void ReleaseSource(EntryId entry, SourceToken) override {
    FUZZ_CHECK(++releases_[entry] == 1, "source of entry %lld released twice",
               static_cast<long long>(entry));
    released_.insert(entry);
  }
  absl::StatusOr<void*> AllocateRestore(EntryId entry, size_t bytes) override {
    auto buffer = std::make_unique<uint8_t[]>(bytes == 0 ? 1 : bytes);
    std::memset(buffer.get(), 0xCD, bytes);
    void* data = buffer.get();
    restores_[data] = std::move(buffer);
    return data;
  }
  void DropRestore(EntryId, void* data) override {
    FUZZ_CHECK(restores_.erase(data) == 1, "DropRestore of an unknown buffer");
  }
  void FreeAcquired(void* data) {
    FUZZ_CHECK(restores_.erase(data) == 1, "Acquire handed out an unknown buffer");
  }
  bool released(EntryId entry) const { return released_.count(entry) > 0; }
  size_t restores() const { return restores_.size(); }

 private:
  std::map<EntryId, int> releases_;
  std::set<EntryId> released_;
  std::map<void*, std::unique_ptr<uint8_t[]>> restores_;
};

struct Tensor {
  Meta meta;
  uint32_t storage_id;
  std::vector<uint8_t>* storage;  // owned by Step::storages
  EntryId entry = 0;
  int64_t span_begin = 0;
  size_t span_bytes = 0;
  bool discarded = false;
};

Meta DecodeMeta(Input& in) {
  Meta meta;
  static constexpr int64_t kItemsizes[] = {1, 2, 4, 8};
  meta.itemsize = kItemsizes[in.Below(4)];
  const int ndim = in.Below(5);
  meta.sizes.resize(ndim);
  meta.strides.resize(ndim);
  for (int d = 0; d < ndim; ++d) meta.sizes[d] = 1 + in.Below(6);
  // Contiguous, a permuted contiguous layout, or arbitrary strides (overlap and 0 included).
  const int layout = in.Below(3);
  int64_t running = 1 + (layout == 1 ? in.Below(3) : 0);  // layout 1: with gaps
  std::vector<int> order(ndim);
  for (int d = 0; d < ndim; ++d) order[d] = ndim - 1 - d;
  if (layout == 1 && ndim > 1) std::swap(order[0], order[in.Below(ndim)]);
  for (int d : order) {
    if (layout == 2) {
      meta.strides[d] = in.Below(24);
    } else {
      meta.strides[d] = running;
      running *= meta.sizes[d];
    }
  }
  meta.storage_offset = in.Below(32);
  return meta;
}

bool ElementsIntact(const Tensor& t, const uint8_t* data, int64_t base_offset) {
  bool ok = true;
  t.meta.ForEachElement([&](int64_t byte) {
    for (int64_t b = 0; b < t.meta.itemsize && ok; ++b) {
      ok = data[byte - base_offset + b] == StorageByte(t.storage_id, byte + b);
    }
  });
  return ok;
}

class Harness {
 public:
  Harness(Input& in) : in_(in) {
    EngineOptions options;
    options.keep_last = in.Below(4);
    options.prefetch_depth = in.Below(4);
    options.max_inflight_d2h_groups = 1 + in.Below(3);
    options.arena.min_slab_bytes = 4096;
    options.arena.slab_granularity = 4096;
    if (in.Below(4) == 0) options.arena.byte_cap = in.Below(64) * 256;  // fallbacks
    device_ = MakeHostDevice();
    auto made = OffloadEngine::Create(device_.get(), &client_, options);
    FUZZ_CHECK(made.ok(), "Create: %s", made.status().ToString().c_str());
    engine_ = std::move(*made);
  }

  ~Harness() {
    faults::ClearAll();
    FUZZ_CHECK(engine_->Reset().ok(), "final Reset failed without faults");
    CheckEmpty("after the final Reset");
    engine_.reset();
    FUZZ_CHECK(client_.restores() == 0, "%zu restore buffers never returned", client_.restores());
  }

  void Step() {
    std::vector<std::vector<Tensor>> groups(1 + in_.Below(6));
    std::vector<std::unique_ptr<std::vector<uint8_t>>> storages;
    bool broken = false;  // a call failed and the caller chose to reset
    for (auto& group : groups) {
      MaybeFault();
      auto gid = engine_->BeginGroup(0);
      if (!gid.ok()) {
        if (OnError()) {
          broken = true;
          break;
        }
        continue;  // carry on: this group begins no group, its tensors stay unsaved
      }
      const int tensors = 1 + in_.Below(3);
      for (int i = 0; i < tensors; ++i) {
        Tensor t;
        t.meta = DecodeMeta(in_);
        if (t.meta.numel() == 0) continue;
        const auto [begin, end] = t.meta.Span();
        // A view of the previous tensor's storage, or a new storage.
        if (!group.empty() && in_.Below(4) == 0 &&
            static_cast<int64_t>(group.back().storage->size()) >= end) {
          t.storage = group.back().storage;
          t.storage_id = group.back().storage_id;
        } else {
          storages.push_back(std::make_unique<std::vector<uint8_t>>(end + in_.Below(16)));
          t.storage = storages.back().get();
          t.storage_id = next_storage_++;
          for (size_t b = 0; b < t.storage->size(); ++b) {
            (*t.storage)[b] = StorageByte(t.storage_id, b);
          }
        }
        t.span_begin = begin;
        t.span_bytes = static_cast<size_t>(end - begin);
        MaybeFault();
        auto offer = engine_->OfferEntry(*gid, t.storage->data() + begin, t.span_bytes,
                                         /*source=*/0, /*compute=*/0);
        if (!offer.ok()) {
          if (OnError()) {
            broken = true;
            break;
          }
          continue;  // the engine forgot the entry; the tensor simply stays unsaved
        }
        t.entry = offer->entry;
        group.push_back(std::move(t));
      }
      if (broken) break;
    }

    // A freed graph before backward: some entries are discarded unread.
    for (auto& group : groups) {
      for (Tensor& t : group) {
        if (in_.Below(8) == 0) {
          source_needed_[t.entry] = engine_->Discard(t.entry);
          t.discarded = true;
        }
      }
    }

    for (auto g = groups.rbegin(); g != groups.rend() && !broken; ++g) {
      for (Tensor& t : *g) {
        if (t.discarded || broken) continue;
        const int reads = in_.Below(6) == 0 ? 2 : 1;  // a retained graph reads twice
        for (int r = 0; r < reads && !broken; ++r) {
          MaybeFault();
          auto acquired = engine_->Acquire(t.entry, 0);
          if (!acquired.ok()) {
            broken = OnError();
            break;
          }
          if (acquired->resident) {
            FUZZ_CHECK(!client_.released(t.entry),
                       "entry %lld reported resident after its source was released",
                       static_cast<long long>(t.entry));
            FUZZ_CHECK(ElementsIntact(t, t.storage->data(), 0),
                       "resident entry %lld reads wrong elements", static_cast<long long>(t.entry));
          } else {
            FUZZ_CHECK(acquired->device_data != nullptr, "restored entry without a buffer");
            FUZZ_CHECK(
                ElementsIntact(t, static_cast<const uint8_t*>(acquired->device_data), t.span_begin),
                "restored entry %lld (itemsize %lld, %zu span bytes) reads wrong elements",
                static_cast<long long>(t.entry), static_cast<long long>(t.meta.itemsize),
                t.span_bytes);
            client_.FreeAcquired(acquired->device_data);
          }
        }
      }
      for (Tensor& t : *g) {
        if (!t.discarded) source_needed_[t.entry] = engine_->Discard(t.entry);
        t.discarded = true;
      }
    }
    faults::ClearAll();
    for (auto& group : groups) {
      for (Tensor& t : group) {
        if (!t.discarded) source_needed_[t.entry] = engine_->Discard(t.entry);
      }
    }
    if (had_error_) {
      // After a failure the engine promises intact data and a Reset that recovers; copies
      // whose completion event was never recorded are only settled by that Reset.
      had_error_ = false;
      FUZZ_CHECK(engine_->Reset().ok(), "Reset after a failure failed without faults");
      CheckEmpty("after Reset");
    } else {
      FUZZ_CHECK(engine_->Synchronize().ok(), "Synchronize failed without faults");
      CheckEmpty("once every entry was discarded");
      for (const auto& [entry, needed] : source_needed_) {
        FUZZ_CHECK(!needed || client_.released(entry),
                   "entry %lld: Discard kept its source, which was never released",
                   static_cast<long long>(entry));
      }
    }
    source_needed_.clear();  // the storages die with this step
  }

 private:
  // Sometimes the next device copy or event call fails.
  void MaybeFault() {
    const uint32_t pick = in_.Below(32);
    if (pick == 0) faults::FailNext(faults::Fault::kCopy, 1);
    if (pick == 1) faults::FailNext(faults::Fault::kEvent, 1);
  }
  // A call failed: true when the caller resets (the step is abandoned), false when it
  // carries on with the engine as it is.
  bool OnError() {
    faults::ClearAll();
    had_error_ = true;
    return in_.Bool();
  }
  void CheckEmpty(const char* when) {
    const EngineStats stats = engine_->stats();
    FUZZ_CHECK(stats.arena.live_bytes == 0 && stats.arena.live_blocks == 0,
               "%zu live host bytes %s", stats.arena.live_bytes, when);
    FUZZ_CHECK(stats.device_held_bytes == 0, "%zu device bytes held %s", stats.device_held_bytes,
               when);
    FUZZ_CHECK(stats.arena.reserved_bytes <= stats.arena.byte_cap, "reserved above the cap");
  }

  Input& in_;
  std::unique_ptr<Device> device_;
  Client client_;
  std::unique_ptr<OffloadEngine> engine_;
  uint32_t next_storage_ = 1;
  bool had_error_ = false;
  std::map<EntryId, bool> source_needed_;  // what Discard returned, this step
};

}  // namespace
}  // namespace ckpt_offload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckpt_offload;
  faults::ClearAll();
  fuzz::Input in(data, size);
  {
    fuzz::Harness harness(in);
    for (int step = 0; step < 8 && !in.empty(); ++step) harness.Step();
  }
  faults::ClearAll();
  return 0;
}
