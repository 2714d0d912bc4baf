// HostArena: a pool of host memory (pinned for CUDA, plain aligned for the host backend)
// that offloaded activations are copied into.
//
// Contract
// - Allocate(bytes) returns a block of at least `bytes`, aligned to kHostBlockAlignment, or
//   absl::ResourceExhaustedError when serving it would take reserved bytes past the byte cap
//   (the cap is never exceeded, the call never aborts) or the backend error when the backend
//   refused memory. Callers fall back (the torch plugin keeps the tensor on the device).
// - Free(block) returns a block obtained from Allocate of this arena, exactly once.
// - Memory is reused across steps and across changing sizes; backend allocations happen only
//   when no free range fits (see the design note in host_arena.cc).
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
  // Slabs are sized in multiples of this.
  size_t slab_granularity = size_t{2} << 20;
  // Requests smaller than this share slabs of this size.
  size_t min_slab_bytes = size_t{16} << 20;
};

struct ArenaStats {
  size_t reserved_bytes = 0;    // held from the backend
  size_t live_bytes = 0;        // handed out and not yet freed
  size_t peak_live_bytes = 0;   // max live_bytes since construction or ResetPeak()
  int64_t live_blocks = 0;
  int64_t allocations = 0;           // successful Allocate calls
  int64_t backend_allocations = 0;   // slabs obtained from the backend
  int64_t backend_frees = 0;         // slabs returned to the backend
  double backend_alloc_seconds = 0;  // wall time spent in backend Allocate
  int64_t cap_rejections = 0;        // Allocate calls refused by the cap
  int64_t backend_failures = 0;      // Allocate calls refused by the backend
  size_t byte_cap = 0;
};

class HostArena {
 public:
  HostArena(std::unique_ptr<HostMemoryBackend> backend, ArenaOptions options = {});
  ~HostArena();  // returns every slab to the backend; live blocks must have been freed
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  absl::StatusOr<HostBlock> Allocate(size_t bytes);
  void Free(const HostBlock& block);

  // Changes the cap. Free slabs are released until reserved <= cap where possible; a cap
  // below live bytes is accepted and only blocks new growth.
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
