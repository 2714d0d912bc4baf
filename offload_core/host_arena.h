// HostArena: a pool of host memory (pinned for CUDA, plain aligned for the host backend)
// that offloaded activations are copied into.
//
// Contract
// - Allocate(bytes) returns a block of at least `bytes`, aligned to kHostBlockAlignment, or
//   absl::ResourceExhaustedError when serving it would take reserved bytes past the byte cap
//   (the cap is never exceeded, the call never aborts) or the backend error when the backend
//   refused memory. Callers fall back (the torch plugin keeps the tensor on the device).
// - Free(block) returns a block obtained from Allocate of this arena, exactly once.
// - Reuse. The backend is called only when no free range holds the request, and slabs
//   are never given back to make growth easier: only SetByteCap, ReleaseFreeSlabs, the
//   destructor, the cap (when that is the only way to serve a request under it) and the
//   bound below release them. For a training loop whose steps allocate their entries in
//   forward order and free them in backward order: a step whose live set (its entries and
//   what earlier steps left live) an earlier step covered, entry by entry no larger, makes
//   no backend call; rerunning a step never does. Exceptions, both counted: the one
//   consolidation below may land in the next step when blocks outlive their step; and with
//   blocks carried across steps (the next step starts before the previous one's last
//   frees, small tensors kept for later steps) a covered step can still miss a contiguous
//   range once (measured: a few of hundreds of adversarial traces, one allocation each).
//   tests/offload_core/host_arena_steps_test.cc checks all of this. Reserve avoids both.
// - Bound. Let W be the high-water mark of live bytes since construction (ResetPeak does
//   not lower it), raised to the largest `bytes` of a successful Reserve, and G the slab
//   granularity. Then reserved_bytes <= 1.15 * W + G whenever no slab is retiring
//   (stats().retiring_bytes == 0). A growth aims at that bound, so lengths rising step by
//   step grow the pool in few, large slabs; free slabs are released only when the growth
//   would break it, and folded into the one new slab. The exception: a request no free
//   range holds when the bound has no room left and no free slab can go (the free bytes
//   are the tails of partly used slabs, each too short). The pool then grows by the
//   request (stats().overbound_growths), every slab holding blocks but the largest
//   retires (still usable), and once none of them holds a block they are replaced by one
//   slab that takes the pool back to the bound (stats().consolidations). In a step-ordered
//   loop that is the end of the growing step's backward (or the next step's first
//   allocations when its blocks are carried over).
// - Reserve(bytes) is the up-front hint (the longest sequence a run will see): it grows
//   the pool to at least `bytes` with at most one backend allocation (see below).
// - Every method is thread-safe.
// - Misuse is a programming error: Free of an unknown pointer, a double free, or a Free
//   with other `bytes` than Allocate returned prints the problem and aborts. Free of a null
//   block is a no-op; Allocate(0) returns a minimal (256-byte) block.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_HOST_ARENA_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_HOST_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt_offload {

inline constexpr size_t kHostBlockAlignment = 256;

// Where the arena's slabs come from. Implementations need not be thread-safe: the arena
// serializes calls.
class HostMemoryBackend {
 public:
  virtual ~HostMemoryBackend() = default;
  // Returns `bytes` of host memory aligned to at least kHostBlockAlignment.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr, size_t bytes) = 0;
  virtual const char* name() const = 0;
};

// Plain aligned host memory (std::aligned_alloc); for the host backend and CPU tests.
std::unique_ptr<HostMemoryBackend> MakeAlignedHostBackend();

struct HostBlock {
  void* data = nullptr;
  size_t bytes = 0;  // usable bytes (>= requested)
  explicit operator bool() const { return data != nullptr; }
};

struct ArenaOptions {
  // Hard cap on reserved (backend-allocated) bytes.
  size_t byte_cap = std::numeric_limits<size_t>::max();
  // G of the bound above. Growth slabs are sized to the bound, not to multiples of this;
  // a slab holding just the request is rounded up to it while the cap allows.
  size_t slab_granularity = size_t{2} << 20;
  // Requests smaller than this are carved from the high end of a free range, larger ones
  // from the low end: small blocks that outlive their step gather at slab ends instead of
  // splitting the ranges the next step's large blocks need. Only placement; every slab
  // serves every size.
  size_t min_slab_bytes = size_t{16} << 20;
};

struct ArenaStats {
  size_t reserved_bytes = 0;   // held from the backend
  size_t live_bytes = 0;       // handed out and not yet freed
  size_t peak_live_bytes = 0;  // max live_bytes since construction or ResetPeak()
  int64_t live_blocks = 0;
  int64_t allocations = 0;           // successful Allocate calls
  int64_t backend_allocations = 0;   // slabs obtained from the backend
  int64_t backend_frees = 0;         // slabs returned to the backend
  double backend_alloc_seconds = 0;  // wall time spent in backend Allocate
  int64_t cap_rejections = 0;        // Allocate calls refused by the cap
  int64_t backend_failures = 0;      // Allocate calls refused by the backend
  size_t byte_cap = 0;
  // W of the bound: max live bytes since construction, or the largest Reserve if higher.
  size_t high_water_bytes = 0;
  int64_t overbound_growths = 0;  // growths past 1.15 * W + granularity (see the contract)
  int64_t consolidations = 0;     // retired slabs replaced by one (see the contract)
  size_t retiring_bytes = 0;      // slabs waiting to be replaced (see the contract)
  int64_t reserve_calls = 0;      // Reserve calls that reached the backend
};

class HostArena {
 public:
  HostArena(std::unique_ptr<HostMemoryBackend> backend, ArenaOptions options = {});
  ~HostArena();  // returns every slab to the backend; live blocks must have been freed
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  absl::StatusOr<HostBlock> Allocate(size_t bytes);
  void Free(const HostBlock& block);

  // Grows the pool so that reserved_bytes >= `bytes`, with one backend allocation of
  // round_up(bytes - reserved_bytes, slab_granularity) (the exact difference where the
  // rounded one would cross the cap); nothing when reserved_bytes >= bytes already. Called
  // on an empty pool, the pool is that one slab, so a step whose live bytes (each block
  // rounded up to kHostBlockAlignment) stay within `bytes` never reaches the backend.
  // Raises W of the bound to `bytes`. Returns ResourceExhausted naming the cap when
  // `bytes` is above it, or the backend's error; the pool is unchanged then.
  absl::Status Reserve(size_t bytes);

  // Changes the cap. Free slabs are released (largest first) until reserved <= cap where
  // possible; a cap below live bytes is accepted and only blocks new growth.
  void SetByteCap(size_t byte_cap);
  // Returns every completely free slab to the backend.
  void ReleaseFreeSlabs();
  void ResetPeak();
  ArenaStats stats() const;
  const char* backend_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_HOST_ARENA_H_
