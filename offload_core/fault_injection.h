// Fault injection for reliability tests: process-wide counters that the host backends and
// devices consult before each operation. Zero by default (one relaxed atomic load per call).
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_

#include <cstdint>

namespace ckpt_offload::faults {

enum class Fault : int {
  kHostAllocation = 0,  // a backend slab allocation fails
  kCopy = 1,            // a device copy fails
  kEvent = 2,           // an event record/query/wait fails
  kCount = 3,
};

// The next `count` operations of `fault`'s kind fail (count <= 0 clears it).
void FailNext(Fault fault, int64_t count);
// Consumes one pending failure: true when the caller must fail this operation.
bool ShouldFail(Fault fault);
void ClearAll();
const char* Name(Fault fault);

}  // namespace ckpt_offload::faults

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_
