// Hook points for fault injection. The host backends and devices ask ShouldFail() before
// each operation a reliability test may make fail. Nothing here fails anything: with no
// injector installed (every shipped build) ShouldFail is one atomic load and returns false.
// The injector is the test-only //offload_core:fault_injection (fault_injection.h).
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_HOOKS_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_HOOKS_H_

#include <atomic>

namespace ckpt_offload::faults {

enum class Fault : int {
  kHostAllocation = 0,  // a backend slab allocation fails
  kCopy = 1,            // a device copy fails
  kEvent = 2,           // an event record/query/wait fails
  kCount = 3,
};

// Answers whether the caller must fail this operation (and consumes that failure).
using Injector = bool (*)(Fault fault);

// The installed injector, or null. ckpt_offload._C exposes its address (as the capsule
// _fault_hook) so that a test-only Python module can install one.
inline std::atomic<Injector> injector{nullptr};

// True when an injector is installed and says this operation fails.
inline bool ShouldFail(Fault fault) {
  const Injector inject = injector.load(std::memory_order_acquire);
  return inject != nullptr && inject(fault);
}

}  // namespace ckpt_offload::faults

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_HOOKS_H_
