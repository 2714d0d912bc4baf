// Fault injection for reliability tests (testonly): process-wide counters behind the hook
// points of fault_hooks.h. Zero by default; arming a fault installs the injector.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_

#include <cstdint>

#include "offload_core/fault_hooks.h"

namespace ckpt_offload::faults {

// The next `count` operations of `fault`'s kind fail (count <= 0 clears it). Installs
// ConsumePending as this binary's injector.
void FailNext(Fault fault, int64_t count);
// The injector: consumes one pending failure, true when the caller must fail.
bool ConsumePending(Fault fault);
void ClearAll();
const char* Name(Fault fault);

}  // namespace ckpt_offload::faults

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_FAULT_INJECTION_H_
