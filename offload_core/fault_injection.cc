#include "offload_core/fault_injection.h"

#include <atomic>

namespace ckpt_offload::faults {
namespace {

std::atomic<int64_t> pending[static_cast<int>(Fault::kCount)];

}  // namespace

void FailNext(Fault fault, int64_t count) {
  pending[static_cast<int>(fault)].store(count > 0 ? count : 0, std::memory_order_relaxed);
  injector.store(&ConsumePending, std::memory_order_release);
}

bool ConsumePending(Fault fault) {
  std::atomic<int64_t>& counter = pending[static_cast<int>(fault)];
  int64_t left = counter.load(std::memory_order_relaxed);
  while (left > 0) {
    if (counter.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

void ClearAll() {
  for (auto& counter : pending) counter.store(0, std::memory_order_relaxed);
}

const char* Name(Fault fault) {
  switch (fault) {
    case Fault::kHostAllocation:
      return "host_allocation";
    case Fault::kCopy:
      return "copy";
    case Fault::kEvent:
      return "event";
    case Fault::kCount:
      break;
  }
  return "unknown";
}

}  // namespace ckpt_offload::faults
