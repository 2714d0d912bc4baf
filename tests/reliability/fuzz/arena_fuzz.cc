// Fuzz target: HostArena under arbitrary sequences of Allocate / Free / SetByteCap /
// ReleaseFreeSlabs / ResetPeak / Reserve / backend failures / full resets, with arbitrary
// options.
//
// Checked after every operation (host_arena.h's contract):
// - a block is aligned to kHostBlockAlignment, holds at least the requested bytes (and, as
//   this implementation rounds only to the alignment, less than requested + alignment), lies
//   inside one slab the backend handed out, and overlaps no other live block; its bytes
//   survive until it is freed (a pattern is written on Allocate and checked on Free);
// - accounting: live bytes/blocks equal the sum over live blocks, reserved bytes equal the
//   backend's outstanding slabs, peak >= live, allocation and backend counters match;
// - the cap: the pool only grows up to the cap; a refused request changes nothing; after
//   SetByteCap/ReleaseFreeSlabs no completely free slab is kept above the cap;
// - the bound: a growth leaves reserved <= 1.15 * high water + granularity unless it is
//   counted in overbound_growths; retiring bytes never exceed reserved ones; the high
//   water never drops and is at least live bytes;
// - Reserve: on success reserved >= the request, with at most one backend allocation; a
//   refusal changes nothing;
// - every slab goes back to the backend, exactly once, by the time the arena is destroyed.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "offload_core/host_arena.h"
#include "tests/reliability/fuzz/fuzz_input.h"

namespace ckpt_offload::fuzz {
namespace {

// The backend's view: every slab handed out and not yet returned.
struct BackendLedger {
  std::map<uintptr_t, size_t> slabs;
  size_t bytes = 0;  // sum over `slabs`
  int64_t allocations = 0;
  int64_t frees = 0;
  int fail_next = 0;  // the next `fail_next` Allocate calls fail
};

class TrackingBackend : public HostMemoryBackend {
 public:
  explicit TrackingBackend(BackendLedger* ledger) : ledger_(ledger) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (ledger_->fail_next > 0) {
      --ledger_->fail_next;
      return absl::ResourceExhaustedError("tracking backend: refused (fuzzed failure)");
    }
    FUZZ_CHECK(bytes > 0 && bytes % kHostBlockAlignment == 0, "slab of %zu bytes", bytes);
    if (bytes > (size_t{64} << 20)) {
      // Like std::aligned_alloc running out: the arena asks (an uncapped arena has no other
      // limit) and the backend refuses.
      return absl::ResourceExhaustedError("tracking backend: slab larger than 64 MiB");
    }
    void* ptr = std::aligned_alloc(kHostBlockAlignment, bytes);
    FUZZ_CHECK(ptr != nullptr, "aligned_alloc(%zu)", bytes);
    ledger_->slabs.emplace(reinterpret_cast<uintptr_t>(ptr), bytes);
    ledger_->bytes += bytes;
    ++ledger_->allocations;
    return ptr;
  }
  void Free(void* ptr, size_t bytes) override {
    auto it = ledger_->slabs.find(reinterpret_cast<uintptr_t>(ptr));
    FUZZ_CHECK(it != ledger_->slabs.end(), "Free of a slab never handed out (%p)", ptr);
    FUZZ_CHECK(it->second == bytes, "slab freed with %zu bytes, allocated with %zu", bytes,
               it->second);
    ledger_->slabs.erase(it);
    ledger_->bytes -= bytes;
    ++ledger_->frees;
    std::free(ptr);
  }
  const char* name() const override { return "tracking"; }

 private:
  BackendLedger* ledger_;
};

struct Live {
  size_t bytes;  // as returned
  size_t requested;
  uint8_t tag;
};

uint8_t PatternAt(uint8_t tag, size_t i) {
  return static_cast<uint8_t>(tag * 31 + i * 7 + (i >> 8));
}

// Writes (or checks) the pattern on every byte of blocks up to 256 bytes, and on the first
// and last 32 bytes plus one byte per 256 of larger ones: every 256-byte granule of a block
// is sampled, which is what a misplaced or overlapping block would corrupt, and fuzzing
// stays fast.
template <typename Fn>
void ForPatternBytes(size_t bytes, Fn fn) {
  if (bytes <= 256) {
    for (size_t i = 0; i < bytes; ++i) fn(i);
    return;
  }
  for (size_t i = 0; i < 32; ++i) fn(i);
  for (size_t i = 128; i < bytes - 32; i += 256) fn(i);
  for (size_t i = bytes - 32; i < bytes; ++i) fn(i);
}

class Harness {
 public:
  Harness(ArenaOptions options) : options_(options) {
    arena_ = std::make_unique<HostArena>(std::make_unique<TrackingBackend>(&ledger_), options);
    cap_ = options.byte_cap;
  }

  ~Harness() {
    size_t live_sum = 0, slab_sum = 0;
    for (auto& [start, live] : live_) live_sum += live.bytes;
    for (auto& [base, size] : ledger_.slabs) slab_sum += size;
    FUZZ_CHECK(live_sum == live_bytes_ && slab_sum == ledger_.bytes, "running sums drifted");
    for (auto& [start, live] : live_) Check(start, live);
    for (auto& [start, live] : live_) {
      arena_->Free(HostBlock{reinterpret_cast<void*>(start), live.bytes});
    }
    live_.clear();
    arena_.reset();
    FUZZ_CHECK(ledger_.slabs.empty(), "%zu slabs never returned to the backend",
               ledger_.slabs.size());
    FUZZ_CHECK(ledger_.allocations == ledger_.frees, "%lld allocations, %lld frees",
               static_cast<long long>(ledger_.allocations), static_cast<long long>(ledger_.frees));
  }

  void Allocate(size_t requested) {
    const ArenaStats before = arena_->stats();
    const int64_t backend_calls_before = ledger_.allocations + ledger_.frees;
    absl::StatusOr<HostBlock> block = arena_->Allocate(requested);
    const ArenaStats after = arena_->stats();
    if (!block.ok()) {
      FUZZ_CHECK(block.status().code() == absl::StatusCode::kResourceExhausted,
                 "unexpected error code: %s", block.status().ToString().c_str());
      FUZZ_CHECK(after.live_bytes == before.live_bytes, "a refused request changed live bytes");
      if (after.cap_rejections == before.cap_rejections + 1) {
        // Refused by the cap: the pool is left exactly as it was.
        FUZZ_CHECK(after.backend_failures == before.backend_failures, "counted twice");
        FUZZ_CHECK(ledger_.allocations + ledger_.frees == backend_calls_before,
                   "a cap refusal allocated or released slabs");
      } else {
        // Refused by the backend: free slabs may have been given back to make room (the
        // arena releases before it asks), but the pool never grows.
        FUZZ_CHECK(after.backend_failures == before.backend_failures + 1,
                   "a refusal was not counted");
        FUZZ_CHECK(after.reserved_bytes <= before.reserved_bytes,
                   "a refused request grew the pool");
      }
      VerifyAccounting();
      return;
    }
    const uintptr_t start = reinterpret_cast<uintptr_t>(block->data);
    const size_t need = std::max<size_t>(requested, 1);
    FUZZ_CHECK(start % kHostBlockAlignment == 0, "block at %p is misaligned", block->data);
    FUZZ_CHECK(block->bytes >= need, "block of %zu bytes for a request of %zu", block->bytes,
               requested);
    FUZZ_CHECK(block->bytes - need < kHostBlockAlignment,
               "block of %zu bytes for a request of %zu rounds beyond the alignment", block->bytes,
               requested);
    // Inside one slab.
    auto slab = ledger_.slabs.upper_bound(start);
    FUZZ_CHECK(slab != ledger_.slabs.begin(), "block at %p below every slab", block->data);
    --slab;
    FUZZ_CHECK(start + block->bytes <= slab->first + slab->second,
               "block [%p, +%zu) crosses the end of its slab", block->data, block->bytes);
    // Overlaps no live block.
    auto next = live_.lower_bound(start);
    if (next != live_.end()) {
      FUZZ_CHECK(start + block->bytes <= next->first, "block at %p overlaps the next live block",
                 block->data);
    }
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      FUZZ_CHECK(prev->first + prev->second.bytes <= start,
                 "block at %p overlaps the previous live block", block->data);
    }
    // Growth stays under the cap, and under the bound unless counted.
    if (after.reserved_bytes > before.reserved_bytes) {
      FUZZ_CHECK(after.reserved_bytes <= cap_, "reserved %zu above the cap %zu after growth",
                 after.reserved_bytes, cap_);
      if (after.overbound_growths == before.overbound_growths) {
        FUZZ_CHECK(WithinBound(after), "growth to %zu above 1.15 * %zu + %zu, not counted",
                   after.reserved_bytes, after.high_water_bytes, granularity_);
      }
    }
    const uint8_t tag = static_cast<uint8_t>(++tags_);
    auto* bytes = static_cast<uint8_t*>(block->data);
    ForPatternBytes(block->bytes, [&](size_t i) { bytes[i] = PatternAt(tag, i); });
    live_.emplace(start, Live{block->bytes, requested, tag});
    live_bytes_ += block->bytes;
    ++allocations_;
    VerifyAccounting();
  }

  void Free(uint32_t pick) {
    if (live_.empty()) return;
    auto it = std::next(live_.begin(), pick % live_.size());
    Check(it->first, it->second);
    arena_->Free(HostBlock{reinterpret_cast<void*>(it->first), it->second.bytes});
    live_bytes_ -= it->second.bytes;
    live_.erase(it);
    VerifyAccounting();
  }

  void SetCap(size_t cap) {
    arena_->SetByteCap(cap);
    cap_ = cap;
    FUZZ_CHECK(arena_->stats().byte_cap == cap, "byte_cap not updated");
    if (arena_->stats().reserved_bytes > cap) NoFreeSlabLeft("SetByteCap above the cap");
    VerifyAccounting();
  }

  void ReleaseFreeSlabs() {
    arena_->ReleaseFreeSlabs();
    NoFreeSlabLeft("ReleaseFreeSlabs");
    VerifyAccounting();
  }

  void ResetPeak() {
    arena_->ResetPeak();
    const ArenaStats stats = arena_->stats();
    FUZZ_CHECK(stats.peak_live_bytes == stats.live_bytes, "peak %zu != live %zu after ResetPeak",
               stats.peak_live_bytes, stats.live_bytes);
  }

  void FailBackend(int count) { ledger_.fail_next = count; }

  void Reserve(size_t bytes) {
    const ArenaStats before = arena_->stats();
    const int64_t backend_calls_before = ledger_.allocations + ledger_.frees;
    const absl::Status status = arena_->Reserve(bytes);
    const ArenaStats after = arena_->stats();
    if (status.ok()) {
      FUZZ_CHECK(after.reserved_bytes >= bytes, "Reserve(%zu) left %zu reserved", bytes,
                 after.reserved_bytes);
      FUZZ_CHECK(after.reserved_bytes == before.reserved_bytes || after.reserved_bytes <= cap_,
                 "Reserve grew the pool above the cap");
      FUZZ_CHECK(ledger_.allocations - (backend_calls_before - ledger_.frees) <= 1 &&
                     after.backend_frees == before.backend_frees,
                 "Reserve made more than one backend allocation or released slabs");
      FUZZ_CHECK(after.high_water_bytes >= bytes, "Reserve did not raise the high water");
    } else {
      FUZZ_CHECK(after.reserved_bytes == before.reserved_bytes &&
                     ledger_.allocations + ledger_.frees == backend_calls_before,
                 "a refused Reserve changed the pool");
    }
    VerifyAccounting();
  }

  // Everything freed, every slab released: the pool is empty again.
  void Reset() {
    while (!live_.empty()) Free(0);
    arena_->ReleaseFreeSlabs();
    FUZZ_CHECK(ledger_.slabs.empty(), "slabs left after freeing everything and releasing");
    FUZZ_CHECK(arena_->stats().reserved_bytes == 0, "reserved bytes left after a reset");
    VerifyAccounting();
  }

  void FreeNull() {
    const ArenaStats before = arena_->stats();
    arena_->Free(HostBlock{});
    FUZZ_CHECK(arena_->stats().live_bytes == before.live_bytes, "Free(null) changed live bytes");
  }

 private:
  void Check(uintptr_t start, const Live& live) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(start);
    ForPatternBytes(live.bytes, [&](size_t i) {
      FUZZ_CHECK(bytes[i] == PatternAt(live.tag, i),
                 "block at %p (%zu bytes) changed at byte %zu while live", bytes, live.bytes, i);
    });
  }

  // Every slab still reserved holds at least one live block.
  void NoFreeSlabLeft(const char* after) {
    for (const auto& [base, size] : ledger_.slabs) {
      auto it = live_.lower_bound(base);
      FUZZ_CHECK(it != live_.end() && it->first < base + size,
                 "%s: a completely free slab of %zu bytes is kept (reserved %zu, cap %zu)", after,
                 size, arena_->stats().reserved_bytes, cap_);
    }
  }

  void VerifyAccounting() {
    // Running sums (an O(n) recount per operation would slow fuzzing down tenfold); the
    // destructor recounts them once.
    const ArenaStats stats = arena_->stats();
    const size_t live_bytes = live_bytes_;
    const size_t reserved = ledger_.bytes;
    FUZZ_CHECK(stats.live_bytes == live_bytes, "live bytes %zu, blocks sum to %zu",
               stats.live_bytes, live_bytes);
    FUZZ_CHECK(stats.live_blocks == static_cast<int64_t>(live_.size()), "live blocks %lld vs %zu",
               static_cast<long long>(stats.live_blocks), live_.size());
    FUZZ_CHECK(stats.reserved_bytes == reserved, "reserved %zu, backend holds %zu",
               stats.reserved_bytes, reserved);
    FUZZ_CHECK(stats.live_bytes <= stats.reserved_bytes, "live above reserved");
    FUZZ_CHECK(stats.peak_live_bytes >= stats.live_bytes, "peak below live");
    FUZZ_CHECK(stats.allocations == allocations_, "allocations %lld vs %lld",
               static_cast<long long>(stats.allocations), static_cast<long long>(allocations_));
    FUZZ_CHECK(
        stats.backend_allocations == ledger_.allocations && stats.backend_frees == ledger_.frees,
        "backend counters differ from the backend's");
    FUZZ_CHECK(stats.retiring_bytes <= stats.reserved_bytes, "retiring above reserved");
    FUZZ_CHECK(stats.high_water_bytes >= stats.live_bytes && stats.high_water_bytes >= high_water_,
               "high water %zu below live %zu or dropped from %zu", stats.high_water_bytes,
               stats.live_bytes, high_water_);
    high_water_ = stats.high_water_bytes;
  }

  // 20 * reserved <= 23 * high water + 20 * granularity (exact: 1.15 = 23 / 20).
  bool WithinBound(const ArenaStats& stats) const {
    const unsigned __int128 reserved = stats.reserved_bytes;
    return 20 * reserved <= 23 * static_cast<unsigned __int128>(stats.high_water_bytes) +
                                20 * static_cast<unsigned __int128>(granularity_);
  }

  ArenaOptions options_;
  // The arena's granularity: at least, and a multiple of, the block alignment.
  size_t granularity_ =
      (std::max(options_.slab_granularity, kHostBlockAlignment) + kHostBlockAlignment - 1) /
      kHostBlockAlignment * kHostBlockAlignment;
  size_t high_water_ = 0;
  BackendLedger ledger_;
  std::unique_ptr<HostArena> arena_;
  std::map<uintptr_t, Live> live_;
  size_t live_bytes_ = 0;  // sum over `live_`
  size_t cap_;
  int64_t allocations_ = 0;
  unsigned tags_ = 0;
};

size_t Size(Input& in) {
  switch (in.Below(32)) {
    case 0:
      return 0;
    case 1:
    case 2:
      return kHostBlockAlignment * (1 + in.Below(64));  // exact multiples
    case 3:
      // Around 1 MiB: the large class even with the largest min_slab_bytes. Rare, since
      // big slabs cost the fuzzer mmap/munmap time.
      return (size_t{1} << 20) + in.U16() * 16;
    case 4:
    case 5:
    case 6:
      return in.U32() % (size_t{256} << 10);
    case 7:
      // Beyond any address space / cap: must be refused without overflow.
      return std::numeric_limits<size_t>::max() - in.Below(1024);
    default:
      return 1 + in.U16() % 16384;
  }
}

size_t Cap(Input& in) {
  switch (in.Below(6)) {
    case 0:
      return std::numeric_limits<size_t>::max();
    case 1:
      return 0;
    case 2:
      return in.U32() % (size_t{8} << 20);  // unaligned caps too
    default:
      return kHostBlockAlignment * in.U16();  // up to 16 MiB
  }
}

}  // namespace
}  // namespace ckpt_offload::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckpt_offload;
  using namespace ckpt_offload::fuzz;
  Input in(data, size);
  ArenaOptions options;
  // Odd values too: the arena rounds granularity and the small-slab size to the alignment.
  static constexpr size_t kGranularities[] = {1, 256, 4096, 65536, size_t{1} << 20, 3000};
  static constexpr size_t kMinSlabs[] = {0, 256, 8192, 65536, size_t{1} << 20, 5000};
  options.slab_granularity = kGranularities[in.Below(6)];
  options.min_slab_bytes = kMinSlabs[in.Below(6)];
  options.byte_cap = Cap(in);
  Harness harness(options);
  for (int op = 0; op < 2000 && !in.empty(); ++op) {
    switch (in.Below(16)) {
      case 0:
      case 1:
      case 2:
      case 3:
      case 4:
      case 5:
        harness.Allocate(Size(in));
        break;
      case 6:
      case 7:
      case 8:
      case 9:
        harness.Free(in.U16());
        break;
      case 10:
        harness.SetCap(Cap(in));
        break;
      case 11:
        harness.ReleaseFreeSlabs();
        break;
      case 12:
        harness.ResetPeak();
        break;
      case 13:
        harness.FailBackend(1 + in.Below(3));
        break;
      case 14:
        harness.Reset();
        break;
      case 15:
        if (in.Below(2) == 0) {
          harness.FreeNull();
        } else {
          harness.Reserve(Size(in));
        }
        break;
    }
  }
  return 0;
}
