// HostArena implementation.
//
// Design note
// -----------
// Why the pool grew after warm-up (the previous policy; figures from the issue):
// - Two size classes that shared nothing. Requests under min_slab_bytes (16 MiB) took
//   16 MiB shared slabs, so an entry of 9-16 MiB had a slab to itself with up to 44 % of it
//   idle (156 MiB live, 256 MiB reserved); and each class kept enough for its own peak, so
//   when the length moved entries across 16 MiB the pool held both peaks, and the step whose
//   mix leaned further to one side than before found that class short and grew (7 -> 13
//   pinned allocations at step 31).
// - Growth released completely free slabs smaller than the request before asking for a new
//   one. With entries of several sizes (a layer's 16 MiB input, the head's 32 MiB one at 1B
//   s4k) and frees that lag (a block returns only after its copy completed; the next step's
//   first copies can start before the previous step's last frees), a request that found no
//   fit released slabs the next request needed: slabs released and obtained again long
//   after warm-up (the one slow step at a fixed length).
// - One slab per block, of exactly the request: each new longest length replaced every
//   slab, the whole pool (1.4 s at 8B).
//
// The policy now:
// 1. One pool; first fit in slab creation order. A large request takes the lowest range
//    that holds it, a small one (below min_slab_bytes) the high end of the highest, so
//    small tensors that outlive their step gather at slab ends. New slabs come last in the
//    order and a slab is only released while free, so a step that grew the pool is placed
//    the same way when it runs again (each block in the slab it got the first time): the
//    backend is called again only for a step that needs more than any before it.
// 2. Growth aims at the bound, 1.15 * W + granularity (W: high water of live bytes, or the
//    largest Reserve): the headroom lets the next, slightly longer steps fit, so rising
//    lengths grow the pool in few steps. Free slabs are given back only when the growth
//    would break the bound otherwise; then all of them go and their bytes are folded into
//    the one new slab: a new longest length replaces per-block slabs of an earlier, shorter
//    one with a single large slab, and later new lengths add slabs for their extra bytes.
//    Slab sizes are not rounded to the granularity (rounding down would cut the headroom,
//    up would add a granule per slab); near the cap they are whole multiples of the request.
// 3. Within the bound, fragmentation is tails: a slab's free end shorter than the next
//    block. When a growth finds no room left under the bound and no free slab (tails of
//    many partly used slabs), it takes the exact request anyway (overbound_growths) and
//    every slab holding blocks but the largest retires: retiring slabs still serve
//    requests; the moment none of them holds a block (in a step-ordered loop, the end of
//    that step's backward, or the next step's start when blocks are carried over) they
//    are replaced by one slab that takes the pool back to the bound (consolidations).
//    This keeps the slab count, and with it the tails, small.
// Limits, measured on host_arena_steps_test's traces: the first step of an arena without
// Reserve makes about one slab per block (the bound leaves no room for more while live
// bytes are small; 31-45 backend allocations for 32 layers); with blocks carried across
// steps, a step whose live set an earlier one covered made one backend allocation in a few
// traces (the carried blocks leave holes the earlier step did not have). Reserve up front
// avoids both: one allocation for the whole run.
//
// The cap is hard. When a new slab would cross it the arena takes a smaller one (whole
// requests, then the rounded request, then the exact one), else releases completely free
// slabs (largest first) if that makes room; only when nothing of that works does it refuse.
// A refused request releases nothing.
//
// One std::mutex guards everything, including backend calls (the backend contract lets
// the arena serialize them). The backend is only called while the pool grows, so the
// lock is only held across a slow pinned allocation during warm-up.
//
// Misuse: Free of a pointer this arena did not hand out, a double free, or a Free with a
// changed `bytes` is a programming error and aborts with a message on stderr (continuing
// would corrupt the free lists and hand the same memory out twice). Free of a null block is
// a no-op. A zero-byte request gets a 256-byte block. Destroying the arena with live blocks
// logs a warning and still returns every slab.
#include "offload_core/host_arena.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "offload_core/fault_hooks.h"

namespace ckpt_offload {
namespace {

// Sets *out to `value` rounded up to a multiple of `multiple` (> 0); false on overflow.
bool RoundUpChecked(size_t value, size_t multiple, size_t* out) {
  const size_t remainder = value % multiple;
  if (remainder == 0) {
    *out = value;
    return true;
  }
  const size_t pad = multiple - remainder;
  if (value > std::numeric_limits<size_t>::max() - pad) return false;
  *out = value + pad;
  return true;
}

class AlignedHostBackend : public HostMemoryBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (faults::ShouldFail(faults::Fault::kHostAllocation)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("aligned host allocation of ", bytes, " bytes failed (injected fault)"));
    }
    // std::aligned_alloc wants a size that is a multiple of the alignment.
    size_t rounded = 0;
    if (!RoundUpChecked(bytes == 0 ? 1 : bytes, kHostBlockAlignment, &rounded)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("aligned host allocation of ", bytes, " bytes is too large"));
    }
    void* ptr = std::aligned_alloc(kHostBlockAlignment, rounded);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("std::aligned_alloc(", kHostBlockAlignment,
                                                       ", ", rounded, ") returned null"));
    }
    return ptr;
  }
  void Free(void* ptr, size_t /*bytes*/) override { std::free(ptr); }
  const char* name() const override { return "aligned_host"; }
};

[[noreturn]] void DieOnMisuse(const char* what, const void* ptr, size_t bytes) {
  std::fprintf(stderr, "HostArena::Free: %s (data=%p bytes=%zu); aborting\n", what, ptr, bytes);
  std::fflush(stderr);
  std::abort();
}

}  // namespace

std::unique_ptr<HostMemoryBackend> MakeAlignedHostBackend() {
  return std::make_unique<AlignedHostBackend>();
}

struct HostArena::Impl {
  // One backend allocation and the parts of it not handed out.
  struct Slab {
    uintptr_t base = 0;
    size_t bytes = 0;
    size_t live_bytes = 0;  // 0 exactly when the slab is one free range
    // offset -> length; never two adjacent entries (Free coalesces).
    std::map<size_t, size_t> free_ranges;
    size_t largest_free = 0;  // the longest entry of free_ranges (0 when none)
    uint64_t sequence = 0;    // creation order
    bool retiring = false;    // replaced by one slab once every retiring slab is free
  };

  // A free range chosen for a request.
  struct FreeRange {
    size_t length;
    uintptr_t start;
    Slab* slab;
  };

  // The order requests search slabs in: oldest first (design note, point 1).
  struct OldestSlabFirst {
    bool operator()(const Slab* a, const Slab* b) const { return a->sequence < b->sequence; }
  };

  struct LiveBlock {
    Slab* slab;
    size_t bytes;
  };

  Impl(std::unique_ptr<HostMemoryBackend> backend_in, ArenaOptions options_in)
      : backend(std::move(backend_in)), options(options_in) {
    // Keep every slab size and offset a multiple of the block alignment.
    size_t granularity = std::max(options.slab_granularity, kHostBlockAlignment);
    if (!RoundUpChecked(granularity, kHostBlockAlignment, &options.slab_granularity)) {
      options.slab_granularity = kHostBlockAlignment;
    }
    stats.byte_cap = options.byte_cap;
  }

  static void RecomputeLargestFree(Slab* slab) {
    slab->largest_free = 0;
    for (const auto& [offset, length] : slab->free_ranges) {
      slab->largest_free = std::max(slab->largest_free, length);
    }
  }

  static void AddFreeRange(Slab* slab, size_t offset, size_t length) {
    slab->free_ranges.emplace(offset, length);
    slab->largest_free = std::max(slab->largest_free, length);
  }

  static void RemoveFreeRange(Slab* slab, size_t offset, size_t length) {
    slab->free_ranges.erase(offset);
    if (length == slab->largest_free) RecomputeLargestFree(slab);
  }

  // Moves or resizes a free range in place. Reuses the map's node (C++17 node handles) so
  // the steady-state Allocate/Free path does not touch the heap for it.
  static void ResizeFreeRange(Slab* slab, size_t offset, size_t length, size_t new_offset,
                              size_t new_length) {
    auto range_node = slab->free_ranges.extract(offset);
    range_node.key() = new_offset;
    range_node.mapped() = new_length;
    slab->free_ranges.insert(std::move(range_node));
    if (new_length >= slab->largest_free) {
      slab->largest_free = new_length;
    } else if (length == slab->largest_free) {
      RecomputeLargestFree(slab);
    }
  }

  // First fit in slab order: a large request takes the lowest-address range that holds it
  // in the first slab that has one, a small request the highest-address one (design note,
  // point 1). Returns false when no free range holds `need` bytes.
  bool FindFit(size_t need, FreeRange* fit) const {
    const bool small = need < options.min_slab_bytes;
    for (Slab* slab : slab_order) {
      if (slab->largest_free < need) continue;
      if (small) {
        for (auto it = slab->free_ranges.rbegin(); it != slab->free_ranges.rend(); ++it) {
          if (it->second >= need) {
            *fit = FreeRange{it->second, slab->base + it->first, slab};
            return true;
          }
        }
      } else {
        for (const auto& [offset, length] : slab->free_ranges) {
          if (length >= need) {
            *fit = FreeRange{length, slab->base + offset, slab};
            return true;
          }
        }
      }
    }
    return false;
  }

  // Hands out `need` bytes of `range` (which must hold them): its low end for a large
  // request, its high end for a small one (design note, point 1).
  HostBlock Carve(FreeRange range, size_t need) {
    Slab* slab = range.slab;
    const size_t offset = range.start - slab->base;
    const bool from_high_end = need < options.min_slab_bytes;
    uintptr_t start = range.start;
    if (range.length == need) {
      RemoveFreeRange(slab, offset, range.length);
    } else if (from_high_end) {
      ResizeFreeRange(slab, offset, range.length, offset, range.length - need);
      start = range.start + range.length - need;
    } else {
      ResizeFreeRange(slab, offset, range.length, offset + need, range.length - need);
    }
    if (slab->retiring && slab->live_bytes == 0) ++retiring_live_slabs;
    slab->live_bytes += need;
    live.emplace(start, LiveBlock{slab, need});
    stats.live_bytes += need;
    stats.peak_live_bytes = std::max(stats.peak_live_bytes, stats.live_bytes);
    stats.high_water_bytes = std::max(stats.high_water_bytes, stats.live_bytes);
    ++stats.live_blocks;
    ++stats.allocations;
    return HostBlock{reinterpret_cast<void*>(start), need};
  }

  absl::StatusOr<Slab*> AddSlab(size_t bytes) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<void*> memory = backend->Allocate(bytes);
    stats.backend_alloc_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!memory.ok()) {
      return absl::Status(
          memory.status().code(),
          absl::StrCat("HostArena: backend '", backend->name(), "' refused a slab of ", bytes,
                       " bytes: ", memory.status().message()));
    }
    const uintptr_t base = reinterpret_cast<uintptr_t>(*memory);
    if (base == 0 || base % kHostBlockAlignment != 0) {
      // A backend bug; handing out misaligned blocks would break every caller's copy path.
      backend->Free(*memory, bytes);
      return absl::InternalError(absl::StrCat("HostArena: backend '", backend->name(),
                                              "' returned a slab at ", base, " not aligned to ",
                                              kHostBlockAlignment));
    }
    auto slab = std::make_unique<Slab>();
    slab->base = base;
    slab->bytes = bytes;
    slab->sequence = next_sequence++;
    Slab* raw = slab.get();
    slabs.emplace(base, std::move(slab));
    slab_order.insert(raw);
    AddFreeRange(raw, 0, bytes);
    stats.reserved_bytes += bytes;
    ++stats.backend_allocations;
    return raw;
  }

  void ReleaseSlab(Slab* slab) {
    RemoveFreeRange(slab, 0, slab->bytes);
    const uintptr_t base = slab->base;
    const size_t bytes = slab->bytes;
    backend->Free(reinterpret_cast<void*>(base), bytes);
    stats.reserved_bytes -= bytes;
    ++stats.backend_frees;
    if (slab->retiring) --retiring_slabs;
    slab_order.erase(slab);
    slabs.erase(base);  // destroys *slab
  }

  // Completely free slabs, smallest first (ties: lowest address).
  std::vector<Slab*> FreeSlabsSmallestFirst() const {
    std::vector<Slab*> result;
    for (const auto& entry : slabs) {
      if (entry.second->live_bytes == 0) result.push_back(entry.second.get());
    }
    std::stable_sort(result.begin(), result.end(),
                     [](const Slab* a, const Slab* b) { return a->bytes < b->bytes; });
    return result;
  }

  // Releases completely free slabs, largest first (the fewest slabs given up per byte),
  // until reserved <= target or none is left.
  void ReleaseFreeSlabsDownTo(size_t target) {
    std::vector<Slab*> free_slabs = FreeSlabsSmallestFirst();
    for (auto it = free_slabs.rbegin(); it != free_slabs.rend(); ++it) {
      if (stats.reserved_bytes <= target) return;
      ReleaseSlab(*it);
    }
  }

  // Bytes under the cap that a pool of `reserved` bytes leaves for a new slab.
  size_t Headroom(size_t reserved) const {
    return options.byte_cap > reserved ? options.byte_cap - reserved : 0;
  }

  // 1.15 * high_water + granularity, saturating (design note, point 2).
  size_t Bound(size_t high_water) const {
    const size_t extra = high_water / 20 * 3 + (high_water % 20) * 3 / 20;
    size_t bound = high_water;
    for (size_t add : {extra, options.slab_granularity}) {
      bound = bound > std::numeric_limits<size_t>::max() - add ? std::numeric_limits<size_t>::max()
                                                               : bound + add;
    }
    return bound;
  }

  absl::Status CapRefusal(size_t requested, size_t slab_bytes) {
    ++stats.cap_rejections;
    return absl::ResourceExhaustedError(
        absl::StrCat("HostArena: request of ", requested, " bytes refused by the byte cap of ",
                     options.byte_cap, " bytes (reserved ", stats.reserved_bytes, ", live ",
                     stats.live_bytes, ", a new slab needs ", slab_bytes, ")"));
  }

  // The pool must grow for a request of `need` (aligned) bytes that no free range holds.
  // Plans everything first: a refused request leaves the pool as it was.
  absl::StatusOr<HostBlock> Grow(size_t requested, size_t need) {
    size_t rounded = need;  // the smallest granular slab holding the request
    if (!RoundUpChecked(need, options.slab_granularity, &rounded)) rounded = need;
    const size_t high_water = std::max(stats.high_water_bytes,
                                       stats.live_bytes > std::numeric_limits<size_t>::max() - need
                                           ? std::numeric_limits<size_t>::max()
                                           : stats.live_bytes + need);
    const size_t bound = Bound(high_water);

    // Every completely free slab is smaller than the request (it would have held it).
    std::vector<Slab*> free_slabs = FreeSlabsSmallestFirst();
    size_t free_bytes = 0;
    for (const Slab* slab : free_slabs) free_bytes += slab->bytes;

    // The bound: when the growth would break it, every free slab goes back and its bytes
    // go into the one new slab (design note, point 2).
    std::vector<Slab*> to_release;
    size_t reserved_after = stats.reserved_bytes;
    if (reserved_after + need > bound) {
      to_release = free_slabs;
      reserved_after -= free_bytes;
    }
    // Aim at the bound: the headroom serves the next, longer steps without a backend call.
    // Not rounded to the granularity: rounding down would cut the headroom that lets a
    // slab hold a slightly longer block, rounding up would add a granule per slab.
    const size_t room_in_bound = bound > reserved_after ? bound - reserved_after : 0;
    size_t slab_bytes = need;
    if (room_in_bound >= need) slab_bytes = room_in_bound - room_in_bound % kHostBlockAlignment;

    // The cap.
    size_t room = Headroom(reserved_after);
    if (room < slab_bytes || room - slab_bytes < rounded) {
      // Near the cap: a whole number of requests of this size, so the headroom holds
      // blocks like this one instead of leaving a tail none of them fits in.
      slab_bytes = std::min(slab_bytes, room);
      slab_bytes -= slab_bytes % (slab_bytes >= rounded ? rounded : kHostBlockAlignment);
    }
    if (slab_bytes < need || slab_bytes > room) slab_bytes = rounded;
    if (slab_bytes > room) slab_bytes = need;  // exact: the rounded slab crosses the cap
    if (slab_bytes > room) {
      // Release more free slabs, largest first, if that makes room.
      const size_t reachable = Headroom(stats.reserved_bytes - free_bytes);
      if (need > reachable) return CapRefusal(requested, need);
      slab_bytes = rounded <= reachable ? rounded : need;
      for (auto it = free_slabs.rbegin(); room < slab_bytes; ++it) {
        if (std::find(to_release.begin(), to_release.end(), *it) != to_release.end()) continue;
        to_release.push_back(*it);
        reserved_after -= (*it)->bytes;
        room = Headroom(reserved_after);
      }
    }

    for (Slab* slab : to_release) ReleaseSlab(slab);
    absl::StatusOr<Slab*> slab = AddSlab(slab_bytes);
    if (!slab.ok()) {
      ++stats.backend_failures;
      return slab.status();
    }
    const HostBlock block = Carve(FreeRange{slab_bytes, (*slab)->base, *slab}, need);
    if (stats.reserved_bytes > bound) {
      ++stats.overbound_growths;
      RetireAllButTheLargest();
    }
    return block;
  }

  // Over the bound (design note, point 3): every slab holding blocks but the largest one
  // retires. Retiring slabs still serve requests; once none of them holds a block they are
  // replaced by one slab that takes the pool back to the bound.
  void RetireAllButTheLargest() {
    Slab* largest = nullptr;
    for (Slab* slab : slab_order) {
      if (largest == nullptr || slab->bytes > largest->bytes) largest = slab;
    }
    for (Slab* slab : slab_order) {
      if (slab == largest || slab->retiring) continue;
      slab->retiring = true;
      ++retiring_slabs;
      if (slab->live_bytes > 0) ++retiring_live_slabs;
    }
    if (retiring_slabs > 0 && retiring_live_slabs == 0) Consolidate();
  }

  // Replaces the (now completely free) retiring slabs by one slab of what the bound allows.
  void Consolidate() {
    std::vector<Slab*> retiring;
    size_t retiring_bytes = 0;
    for (Slab* slab : slab_order) {
      if (slab->retiring) {
        retiring.push_back(slab);
        retiring_bytes += slab->bytes;
      }
    }
    const size_t kept = stats.reserved_bytes - retiring_bytes;
    const size_t bound = Bound(stats.high_water_bytes);
    size_t slab_bytes = bound > kept ? bound - kept : 0;
    slab_bytes = std::min(slab_bytes, Headroom(kept));
    slab_bytes -= slab_bytes % kHostBlockAlignment;
    const bool allocate_first = slab_bytes > 0 && slab_bytes <= Headroom(stats.reserved_bytes);
    bool added = false;
    if (allocate_first) added = AddSlab(slab_bytes).ok();
    for (Slab* slab : retiring) ReleaseSlab(slab);
    if (!allocate_first && slab_bytes > 0) added = AddSlab(slab_bytes).ok();
    if (added) ++stats.consolidations;
  }

  absl::StatusOr<HostBlock> Allocate(size_t requested) {
    size_t need = 0;
    const bool representable =
        RoundUpChecked(std::max<size_t>(requested, 1), kHostBlockAlignment, &need);
    std::lock_guard<std::mutex> lock(mu);
    // Larger than any address space: no cap can admit it.
    if (!representable) return CapRefusal(requested, requested);
    FreeRange fit;
    if (FindFit(need, &fit)) return Carve(fit, need);
    return Grow(requested, need);
  }

  absl::Status Reserve(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    if (bytes > options.byte_cap) {
      return absl::ResourceExhaustedError(absl::StrCat("HostArena::Reserve: ", bytes,
                                                       " bytes are above the byte cap of ",
                                                       options.byte_cap, " bytes"));
    }
    if (bytes > stats.reserved_bytes) {
      size_t slab_bytes = 0;
      const size_t missing = bytes - stats.reserved_bytes;
      if (!RoundUpChecked(missing, kHostBlockAlignment, &slab_bytes)) {
        // Larger than any address space once aligned: no backend could serve it.
        return absl::ResourceExhaustedError(
            absl::StrCat("HostArena::Reserve: ", bytes, " bytes need a slab of ", missing,
                         " bytes, which cannot be aligned to ", kHostBlockAlignment));
      }
      size_t rounded = slab_bytes;
      if (RoundUpChecked(missing, options.slab_granularity, &rounded) &&
          rounded <= Headroom(stats.reserved_bytes)) {
        slab_bytes = rounded;
      }
      if (slab_bytes > Headroom(stats.reserved_bytes)) {
        // Only alignment rounding can cross a cap that `bytes` itself is under.
        return absl::ResourceExhaustedError(
            absl::StrCat("HostArena::Reserve: ", bytes, " bytes need a slab of ", slab_bytes,
                         " bytes, above what the byte cap of ", options.byte_cap, " leaves"));
      }
      absl::StatusOr<Slab*> slab = AddSlab(slab_bytes);
      if (!slab.ok()) return slab.status();
      ++stats.reserve_calls;
    }
    stats.high_water_bytes = std::max(stats.high_water_bytes, bytes);
    return absl::OkStatus();
  }

  void Free(const HostBlock& block) {
    if (block.data == nullptr) return;
    const uintptr_t start = reinterpret_cast<uintptr_t>(block.data);
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(start);
    if (it == live.end()) {
      DieOnMisuse("pointer is not a live block of this arena (double free or foreign pointer)",
                  block.data, block.bytes);
    }
    if (it->second.bytes != block.bytes) {
      DieOnMisuse("bytes differ from what Allocate returned", block.data, block.bytes);
    }
    Slab* slab = it->second.slab;
    size_t offset = start - slab->base;
    size_t length = it->second.bytes;
    live.erase(it);
    slab->live_bytes -= length;
    stats.live_bytes -= length;
    --stats.live_blocks;

    // Coalesce with the free neighbours on either side.
    auto next = slab->free_ranges.lower_bound(offset);
    const bool merge_next = next != slab->free_ranges.end() && next->first == offset + length;
    auto prev = next == slab->free_ranges.begin() ? slab->free_ranges.end() : std::prev(next);
    const bool merge_prev = prev != slab->free_ranges.end() && prev->first + prev->second == offset;
    if (merge_prev) {
      const size_t prev_offset = prev->first;
      const size_t prev_length = prev->second;
      size_t merged = prev_length + length;
      if (merge_next) {
        merged += next->second;
        RemoveFreeRange(slab, next->first, next->second);
      }
      ResizeFreeRange(slab, prev_offset, prev_length, prev_offset, merged);
    } else if (merge_next) {
      ResizeFreeRange(slab, next->first, next->second, offset, length + next->second);
    } else {
      AddFreeRange(slab, offset, length);
    }
    if (slab->retiring && slab->live_bytes == 0 && --retiring_live_slabs == 0) Consolidate();
  }

  std::mutex mu;
  std::unique_ptr<HostMemoryBackend> backend;
  ArenaOptions options;                              // sanitized copy
  std::map<uintptr_t, std::unique_ptr<Slab>> slabs;  // by base address
  std::set<Slab*, OldestSlabFirst> slab_order;
  uint64_t next_sequence = 0;
  size_t retiring_slabs = 0;                      // slabs with `retiring` set
  size_t retiring_live_slabs = 0;                 // ... of them holding at least one block
  std::unordered_map<uintptr_t, LiveBlock> live;  // by block start
  ArenaStats stats;
};

HostArena::HostArena(std::unique_ptr<HostMemoryBackend> backend, ArenaOptions options)
    : impl_(std::make_unique<Impl>(std::move(backend), options)) {}

HostArena::~HostArena() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->live.empty()) {
    std::fprintf(stderr,
                 "HostArena: destroyed with %lld live blocks (%zu bytes); their memory is "
                 "returned to the backend anyway\n",
                 static_cast<long long>(impl_->stats.live_blocks), impl_->stats.live_bytes);
  }
  for (auto& entry : impl_->slabs) {
    impl_->backend->Free(reinterpret_cast<void*>(entry.second->base), entry.second->bytes);
  }
  impl_->slabs.clear();
}

absl::StatusOr<HostBlock> HostArena::Allocate(size_t bytes) { return impl_->Allocate(bytes); }

absl::Status HostArena::Reserve(size_t bytes) { return impl_->Reserve(bytes); }

void HostArena::Free(const HostBlock& block) { impl_->Free(block); }

void HostArena::SetByteCap(size_t byte_cap) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->options.byte_cap = byte_cap;
  impl_->stats.byte_cap = byte_cap;
  impl_->ReleaseFreeSlabsDownTo(byte_cap);
}

void HostArena::ReleaseFreeSlabs() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ReleaseFreeSlabsDownTo(0);
}

void HostArena::ResetPeak() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.peak_live_bytes = impl_->stats.live_bytes;
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ArenaStats stats = impl_->stats;
  if (impl_->retiring_slabs > 0) {
    for (const Impl::Slab* slab : impl_->slab_order) {
      if (slab->retiring) stats.retiring_bytes += slab->bytes;
    }
  }
  return stats;
}

const char* HostArena::backend_name() const { return impl_->backend->name(); }

}  // namespace ckpt_offload
