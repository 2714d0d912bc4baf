#include "offload_core/fault_injection.h"

#include "gtest/gtest.h"

namespace ckpt_offload::faults {
namespace {

TEST(FaultInjection, FailsExactlyTheRequestedNumberOfTimes) {
  ClearAll();
  FailNext(Fault::kCopy, 2);
  EXPECT_TRUE(ShouldFail(Fault::kCopy));
  EXPECT_TRUE(ShouldFail(Fault::kCopy));
  EXPECT_FALSE(ShouldFail(Fault::kCopy));
}

TEST(FaultInjection, KindsAreIndependent) {
  ClearAll();
  FailNext(Fault::kEvent, 1);
  EXPECT_FALSE(ShouldFail(Fault::kCopy));
  EXPECT_FALSE(ShouldFail(Fault::kHostAllocation));
  EXPECT_TRUE(ShouldFail(Fault::kEvent));
}

TEST(FaultInjection, ClearAllCancelsPendingFailures) {
  FailNext(Fault::kHostAllocation, 5);
  ClearAll();
  EXPECT_FALSE(ShouldFail(Fault::kHostAllocation));
}

}  // namespace
}  // namespace ckpt_offload::faults
