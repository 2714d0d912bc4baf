// Tests for SimDevice: timing model, event semantics, data movement, hazards, determinism
// and fault injection.
#include "offload_core/sim_device.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "offload_core/fault_injection.h"

namespace ckpt_offload {
namespace {

constexpr double kGB = 1e9;
// bytes / (GB/s) in microseconds.
double CopyUs(double bytes, double gbps) { return bytes / (gbps * 1e3); }

using Entry = SimDevice::TimelineEntry;

std::vector<Entry> EntriesOf(const SimDevice& sim, const std::string& kind) {
  std::vector<Entry> out;
  for (const Entry& e : sim.timeline()) {
    if (e.kind == kind) out.push_back(e);
  }
  return out;
}

size_t CountKind(const std::vector<Entry>& timeline, const std::string& kind) {
  size_t n = 0;
  for (const Entry& e : timeline) n += e.kind == kind ? 1 : 0;
  return n;
}

size_t CountHazards(const SimDevice& sim, SimDevice::HazardKind kind) {
  size_t n = 0;
  for (const auto& h : sim.hazards()) n += h.kind == kind ? 1 : 0;
  return n;
}

EventHandle NewEvent(SimDevice& sim) {
  absl::StatusOr<EventHandle> event = sim.CreateEvent();
  EXPECT_TRUE(event.ok()) << event.status();
  return event.value_or(0);
}

// Copies move real bytes, so the timing tests keep buffers small and scale bandwidth
// down instead: 1 MB at 1e-3 times the bandwidth takes as long as 1 GB at full speed.
constexpr size_t kMB = 1000 * 1000;

SimDeviceOptions ScaledOptions(double d2h = 55, double h2d = 55, double bidir = 97) {
  SimDeviceOptions options;
  options.d2h_gbps = d2h * 1e-3;
  options.h2d_gbps = h2d * 1e-3;
  options.bidir_gbps = bidir * 1e-3;
  return options;
}

// A device buffer and a host buffer of `bytes` each.
struct Buffers {
  Buffers(SimDevice& sim, size_t bytes) : sim(sim), bytes(bytes) {
    device = sim.AllocateDeviceBuffer(bytes);
    host.resize(bytes);
  }
  ~Buffers() { sim.FreeDeviceBuffer(device); }
  SimDevice& sim;
  size_t bytes;
  void* device;
  std::vector<uint8_t> host;
};

TEST(SimDeviceTest, CopyTimeIsBytesOverBandwidth) {
  SimDevice sim(ScaledOptions(/*d2h=*/40, /*h2d=*/50, /*bidir=*/97));
  Buffers a(sim, kMB);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  const double d2h_us = CopyUs(kGB, 40);
  EXPECT_DOUBLE_EQ(sim.host_time_us(), d2h_us);

  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), kMB, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), d2h_us + CopyUs(kGB, 50));

  std::vector<Entry> d2h = EntriesOf(sim, "d2h");
  std::vector<Entry> h2d = EntriesOf(sim, "h2d");
  ASSERT_EQ(d2h.size(), 1u);
  ASSERT_EQ(h2d.size(), 1u);
  EXPECT_EQ(d2h[0].stream, sim.d2h_stream());
  EXPECT_EQ(d2h[0].bytes, kMB);
  EXPECT_DOUBLE_EQ(d2h[0].start_us, 0);
  EXPECT_DOUBLE_EQ(d2h[0].end_us, d2h_us);
  EXPECT_DOUBLE_EQ(h2d[0].start_us, d2h_us);
  EXPECT_DOUBLE_EQ(h2d[0].end_us - h2d[0].start_us, CopyUs(kGB, 50));
  EXPECT_EQ(sim.bytes_copied_to_host(), kMB);
  EXPECT_EQ(sim.bytes_copied_to_device(), kMB);
}

TEST(SimDeviceTest, CopyLatencyIsAddedBeforeBytesFlow) {
  SimDeviceOptions options;
  options.copy_latency_us = 10;
  SimDevice sim(options);
  Buffers a(sim, 55000);  // 1 us at 55 GB/s
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, 0, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  std::vector<Entry> d2h = EntriesOf(sim, "d2h");
  ASSERT_EQ(d2h.size(), 2u);
  EXPECT_DOUBLE_EQ(d2h[0].end_us, 11);
  // A zero-byte copy still pays the latency and holds the engine.
  EXPECT_DOUBLE_EQ(d2h[1].start_us, 11);
  EXPECT_DOUBLE_EQ(d2h[1].end_us, 21);
}

TEST(SimDeviceTest, BothDirectionsAtOnceShareTheBidirectionalCap) {
  SimDevice sim(ScaledOptions());
  Buffers a(sim, kMB), b(sim, kMB);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToDevice(b.device, b.host.data(), kMB, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  // 2 x 1 GB take 2e9 / 97e3 us together, not 1e9 / 55e3.
  EXPECT_NEAR(sim.host_time_us(), 2 * kGB / 97e3, 1e-6);
  for (const Entry& e : sim.timeline()) {
    EXPECT_DOUBLE_EQ(e.start_us, 0) << e.kind;
    EXPECT_NEAR(e.end_us, 2 * kGB / 97e3, 1e-6) << e.kind;
  }
}

TEST(SimDeviceTest, BandwidthChangesWhenTheOtherDirectionEnds) {
  SimDevice sim(ScaledOptions());
  Buffers a(sim, kMB), b(sim, kMB / 2);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToDevice(b.device, b.host.data(), kMB / 2, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  // Both at 48.5 until the half-size H2D ends, then D2H alone at 55 for its other half.
  const double h2d_end = CopyUs(kGB / 2, 48.5);
  const double d2h_end = h2d_end + CopyUs(kGB / 2, 55);
  ASSERT_EQ(EntriesOf(sim, "h2d").size(), 1u);
  ASSERT_EQ(EntriesOf(sim, "d2h").size(), 1u);
  EXPECT_NEAR(EntriesOf(sim, "h2d")[0].end_us, h2d_end, 1e-6);
  EXPECT_NEAR(EntriesOf(sim, "d2h")[0].end_us, d2h_end, 1e-6);
}

TEST(SimDeviceTest, SlowDirectionLeavesTheRestOfTheCapToTheOther) {
  // d2h can use only 20 of the 60 GB/s cap, so h2d gets 40 (more than half).
  SimDevice sim(ScaledOptions(/*d2h=*/20, /*h2d=*/55, /*bidir=*/60));
  Buffers a(sim, kMB), b(sim, kMB);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToDevice(b.device, b.host.data(), kMB, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  const double h2d_end = CopyUs(kGB, 40);
  EXPECT_NEAR(EntriesOf(sim, "h2d")[0].end_us, h2d_end, 1e-6);
  // d2h runs at 20 throughout (alone it still cannot exceed 20).
  EXPECT_NEAR(EntriesOf(sim, "d2h")[0].end_us, CopyUs(kGB, 20), 1e-6);
}

TEST(SimDeviceTest, LatencyPhaseDoesNotTakeBandwidth) {
  SimDeviceOptions options;
  options.copy_latency_us = 5;
  SimDevice sim(options);
  Buffers a(sim, 55000 * 10), b(sim, 55000);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  sim.AdvanceHost(8);  // d2h moves bytes alone at 55 GB/s from t=5
  ASSERT_TRUE(sim.CopyToDevice(b.device, b.host.data(), b.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  // t in [5, 13): d2h alone (8 us of its 10). t in [13, ...): both at 48.5 until one ends.
  // h2d: 55000 bytes at 48.5 -> 1.134 us; d2h has 2 us * 55 = 110000 bytes left at 13.
  const double h2d_end = 13 + 55000.0 / 48.5e3;
  const double d2h_left = 110000.0 - 48.5e3 * (h2d_end - 13);
  EXPECT_NEAR(EntriesOf(sim, "h2d")[0].end_us, h2d_end, 1e-9);
  EXPECT_NEAR(EntriesOf(sim, "d2h")[0].end_us, h2d_end + d2h_left / 55e3, 1e-9);
}

TEST(SimDeviceTest, CopiesOfOneDirectionRunOneAtATimeInIssueOrder) {
  SimDevice sim(ScaledOptions());
  const StreamHandle other = sim.CreateStream();
  Buffers a(sim, kMB), b(sim, kMB), c(sim, kMB);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToHost(b.host.data(), b.device, kMB, other).ok());
  ASSERT_TRUE(sim.CopyToHost(c.host.data(), c.device, kMB, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  const double one = CopyUs(kGB, 55);
  std::vector<Entry> d2h = EntriesOf(sim, "d2h");
  ASSERT_EQ(d2h.size(), 3u);
  EXPECT_EQ(d2h[0].stream, sim.d2h_stream());
  EXPECT_EQ(d2h[1].stream, other);
  EXPECT_EQ(d2h[2].stream, sim.d2h_stream());
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(d2h[i].start_us, i * one, 1e-6);
    EXPECT_NEAR(d2h[i].end_us, (i + 1) * one, 1e-6);
  }
  EXPECT_NEAR(sim.host_time_us(), 3 * one, 1e-6);
}

TEST(SimDeviceTest, ReadyCopyIsNotHeldBehindAnEarlierCopyStillWaitingOnItsStream) {
  SimDevice sim;
  const StreamHandle s1 = sim.CreateStream();
  Buffers a(sim, 55000), b(sim, 55000);
  sim.Compute(s1, 100);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, s1).ok());  // issued first
  ASSERT_TRUE(sim.CopyToHost(b.host.data(), b.device, b.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  std::vector<Entry> d2h = EntriesOf(sim, "d2h");
  ASSERT_EQ(d2h.size(), 2u);
  EXPECT_EQ(d2h[0].stream, sim.d2h_stream());
  EXPECT_DOUBLE_EQ(d2h[0].start_us, 0);
  EXPECT_EQ(d2h[1].stream, s1);
  EXPECT_DOUBLE_EQ(d2h[1].start_us, 100);
}

TEST(SimDeviceTest, ComputeWaitsOnHostToDeviceCopyThroughAnEvent) {
  SimDevice sim(ScaledOptions());
  const StreamHandle compute = sim.CreateStream();
  Buffers a(sim, kMB);
  const EventHandle ready = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), kMB, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(ready, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.StreamWaitEvent(compute, ready).ok());
  sim.Compute(compute, 100, {{a.device, kMB}}, "layer");
  ASSERT_TRUE(sim.SynchronizeAll().ok());

  const double copy_us = CopyUs(kGB, 55);
  std::vector<Entry> computes = EntriesOf(sim, "compute");
  ASSERT_EQ(computes.size(), 1u);
  EXPECT_EQ(computes[0].label, "layer");
  EXPECT_DOUBLE_EQ(computes[0].start_us, copy_us);
  EXPECT_DOUBLE_EQ(computes[0].end_us, copy_us + 100);
  std::vector<Entry> waits = EntriesOf(sim, "wait");
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].stream, compute);
  EXPECT_DOUBLE_EQ(waits[0].start_us, 0);
  EXPECT_DOUBLE_EQ(waits[0].end_us, copy_us);
  EXPECT_DOUBLE_EQ(sim.blocked_us(compute), copy_us);
  EXPECT_DOUBLE_EQ(sim.compute_us(compute), 100);
  EXPECT_DOUBLE_EQ(sim.blocked_us(sim.h2d_stream()), 0);
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(SimDeviceTest, BlockedTimeIsExactlyTheExposedStall) {
  SimDevice sim;
  const StreamHandle compute = sim.CreateStream();
  Buffers a(sim, 55000 * 1000);  // 1000 us at 55 GB/s
  const EventHandle ready = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(ready, sim.h2d_stream()).ok());
  sim.Compute(compute, 300);  // overlaps the first 300 us of the copy
  ASSERT_TRUE(sim.StreamWaitEvent(compute, ready).ok());
  sim.Compute(compute, 50, {{a.device, a.bytes}});
  // While the wait is still blocking, blocked_us counts up to now.
  sim.AdvanceHost(500);
  EXPECT_DOUBLE_EQ(sim.blocked_us(compute), 200);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.blocked_us(compute), 700);
  EXPECT_DOUBLE_EQ(sim.compute_us(compute), 350);
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 1050);

  // A second round where the copy finished long ago: no stall at all.
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), 55000, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(ready, sim.h2d_stream()).ok());
  sim.Compute(compute, 10);
  ASSERT_TRUE(sim.StreamWaitEvent(compute, ready).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.blocked_us(compute), 700);
  EXPECT_EQ(EntriesOf(sim, "wait").size(), 1u);
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(SimDeviceTest, EventQueriesFollowCudaSemantics) {
  SimDevice sim;
  const StreamHandle s = sim.CreateStream();
  const EventHandle event = NewEvent(sim);

  // Never recorded: done, synchronizing returns at once.
  EXPECT_EQ(sim.EventDone(event).value_or(false), true);
  ASSERT_TRUE(sim.SynchronizeEvent(event).ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 0);

  sim.Compute(s, 100);
  ASSERT_TRUE(sim.RecordEvent(event, s).ok());
  EXPECT_EQ(sim.EventDone(event).value_or(true), false);
  sim.AdvanceHost(99);
  EXPECT_EQ(sim.EventDone(event).value_or(true), false);
  sim.AdvanceHost(1);
  EXPECT_EQ(sim.EventDone(event).value_or(false), true);

  // Re-recording resets it.
  sim.Compute(s, 40);
  ASSERT_TRUE(sim.RecordEvent(event, s).ok());
  EXPECT_EQ(sim.EventDone(event).value_or(true), false);
  ASSERT_TRUE(sim.SynchronizeEvent(event).ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 140);
  EXPECT_EQ(sim.EventDone(event).value_or(false), true);

  // Synchronizing on a done event does not move host time.
  sim.AdvanceHost(10);
  ASSERT_TRUE(sim.SynchronizeEvent(event).ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 150);

  // A record on an idle stream completes at once.
  ASSERT_TRUE(sim.RecordEvent(event, s).ok());
  EXPECT_EQ(sim.EventDone(event).value_or(false), true);

  EXPECT_EQ(sim.EventDone(12345).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim.RecordEvent(event, 99).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim.StreamWaitEvent(99, event).code(), absl::StatusCode::kInvalidArgument);
  sim.DestroyEvent(event);
  EXPECT_EQ(sim.EventDone(event).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SimDeviceTest, WaitBindsToTheRecordCurrentAtCallTime) {
  SimDevice sim;
  const StreamHandle producer = sim.CreateStream();
  const StreamHandle consumer = sim.CreateStream();
  const EventHandle event = NewEvent(sim);
  sim.Compute(producer, 100);
  ASSERT_TRUE(sim.RecordEvent(event, producer).ok());
  ASSERT_TRUE(sim.StreamWaitEvent(consumer, event).ok());
  // Re-recorded after the wait was issued: the wait keeps waiting for the first record.
  sim.Compute(producer, 1000);
  ASSERT_TRUE(sim.RecordEvent(event, producer).ok());
  sim.Compute(consumer, 10, {}, "consumer");
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  std::vector<Entry> computes = EntriesOf(sim, "compute");
  bool found = false;
  for (const Entry& e : computes) {
    if (e.label != "consumer") continue;
    found = true;
    EXPECT_DOUBLE_EQ(e.start_us, 100);
  }
  EXPECT_TRUE(found);
  EXPECT_DOUBLE_EQ(sim.blocked_us(consumer), 100);
}

TEST(SimDeviceTest, WaitOnNeverRecordedEventIsANoOp) {
  SimDevice sim;
  const StreamHandle s = sim.CreateStream();
  const EventHandle event = NewEvent(sim);
  ASSERT_TRUE(sim.StreamWaitEvent(s, event).ok());
  // Recording after the wait does not retroactively bind it.
  sim.Compute(sim.d2h_stream(), 500);
  ASSERT_TRUE(sim.RecordEvent(event, sim.d2h_stream()).ok());
  sim.Compute(s, 10, {}, "free");
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  for (const Entry& e : EntriesOf(sim, "compute")) {
    if (e.label == "free") {
      EXPECT_DOUBLE_EQ(e.start_us, 0);
    }
  }
  EXPECT_DOUBLE_EQ(sim.blocked_us(s), 0);
}

TEST(SimDeviceTest, DestroyedEventStillReleasesItsPendingWaits) {
  SimDevice sim;
  const StreamHandle producer = sim.CreateStream();
  const StreamHandle consumer = sim.CreateStream();
  const EventHandle event = NewEvent(sim);
  sim.Compute(producer, 100);
  ASSERT_TRUE(sim.RecordEvent(event, producer).ok());
  ASSERT_TRUE(sim.StreamWaitEvent(consumer, event).ok());
  sim.DestroyEvent(event);
  sim.Compute(consumer, 10);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 110);
}

TEST(SimDeviceTest, ElapsedMsUsesCompletionTimes) {
  SimDevice sim;
  const StreamHandle s = sim.CreateStream();
  const EventHandle start = NewEvent(sim);
  const EventHandle end = NewEvent(sim);
  const EventHandle never = NewEvent(sim);
  sim.Compute(s, 100);
  ASSERT_TRUE(sim.RecordEvent(start, s).ok());
  sim.Compute(s, 2500);
  ASSERT_TRUE(sim.RecordEvent(end, s).ok());

  absl::StatusOr<double> pending = sim.ElapsedMs(start, end);
  EXPECT_EQ(pending.status().code(), absl::StatusCode::kFailedPrecondition) << pending.status();
  ASSERT_TRUE(sim.SynchronizeEvent(end).ok());
  EXPECT_DOUBLE_EQ(sim.ElapsedMs(start, end).value_or(-1), 2.5);
  EXPECT_DOUBLE_EQ(sim.ElapsedMs(end, start).value_or(0), -2.5);
  EXPECT_EQ(sim.ElapsedMs(start, never).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim.ElapsedMs(start, 999).status().code(), absl::StatusCode::kInvalidArgument);

  // Events on different streams compare on the one clock.
  const EventHandle other = NewEvent(sim);
  const StreamHandle s2 = sim.CreateStream();
  sim.Compute(s2, 1000);
  ASSERT_TRUE(sim.RecordEvent(other, s2).ok());
  ASSERT_TRUE(sim.SynchronizeEvent(other).ok());
  EXPECT_DOUBLE_EQ(sim.ElapsedMs(start, other).value_or(0), (2600.0 + 1000.0 - 100.0) / 1e3);
}

TEST(SimDeviceTest, CopiesReallyMoveTheBytesAtCompletion) {
  SimDevice sim;
  constexpr size_t kBytes = 55000 * 4;  // 4 us each way
  auto* source = static_cast<uint8_t*>(sim.AllocateDeviceBuffer(kBytes));
  auto* restored = static_cast<uint8_t*>(sim.AllocateDeviceBuffer(kBytes));
  std::vector<uint8_t> host(kBytes, 0);
  for (size_t i = 0; i < kBytes; ++i) source[i] = static_cast<uint8_t>(i * 131 + 7);
  std::memset(restored, 0, kBytes);

  const EventHandle offloaded = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToHost(host.data(), source, kBytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(offloaded, sim.d2h_stream()).ok());
  // Halfway through, nothing has landed yet: a reader running ahead sees stale bytes.
  sim.AdvanceHost(2);
  EXPECT_EQ(host[0], 0);
  EXPECT_EQ(host[kBytes - 1], 0);
  ASSERT_TRUE(sim.StreamWaitEvent(sim.h2d_stream(), offloaded).ok());
  ASSERT_TRUE(sim.CopyToDevice(restored, host.data(), kBytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_EQ(std::memcmp(host.data(), source, kBytes), 0);
  EXPECT_EQ(std::memcmp(restored, source, kBytes), 0);
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 8);
  EXPECT_TRUE(sim.hazards().empty());
  sim.FreeDeviceBuffer(source);
  sim.FreeDeviceBuffer(restored);
}

// --- Hazards ---

TEST(SimDeviceTest, ComputeReadingBeforeItsCopyIsAHazard) {
  SimDevice sim;
  const StreamHandle compute = sim.CreateStream();
  Buffers a(sim, 55000 * 10);
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  // No wait: the compute starts at once, while the copy is still writing its input.
  sim.Compute(compute, 5, {{static_cast<uint8_t*>(a.device) + 100, 8}}, "early");
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  ASSERT_EQ(sim.hazards().size(), 1u);
  EXPECT_EQ(sim.hazards()[0].kind, SimDevice::HazardKind::kReadBeforeReady);
  EXPECT_DOUBLE_EQ(sim.hazards()[0].time_us, 0);
  EXPECT_NE(sim.hazards()[0].detail.find("early"), std::string::npos);
  EXPECT_STREQ(SimDevice::HazardName(sim.hazards()[0].kind), "read_before_ready");
}

TEST(SimDeviceTest, ComputeOrderedAfterItsCopyHasNoHazard) {
  SimDevice sim;
  const StreamHandle compute = sim.CreateStream();
  Buffers a(sim, 55000 * 10), unrelated(sim, 64);
  const EventHandle ready = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(ready, sim.h2d_stream()).ok());
  // Reading other memory while the copy runs is fine.
  sim.Compute(compute, 5, {{unrelated.device, unrelated.bytes}});
  ASSERT_TRUE(sim.StreamWaitEvent(compute, ready).ok());
  sim.Compute(compute, 5, {{a.device, a.bytes}});
  // Same-stream ordering is enough too.
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, compute).ok());
  sim.Compute(compute, 5, {{a.device, a.bytes}});
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(SimDeviceTest, ComputeReadingWhatALaterCopyOverwritesIsNotReadBeforeReady) {
  SimDevice sim;
  const StreamHandle compute = sim.CreateStream();
  Buffers a(sim, 55000 * 1000);  // 1000 us
  sim.Compute(compute, 100);
  sim.Compute(compute, 5, {{a.device, a.bytes}});  // starts at 100, mid-copy
  // Issued after the reader: a write-after-read, which this rule does not cover.
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_EQ(CountHazards(sim, SimDevice::HazardKind::kReadBeforeReady), 0u);
}

TEST(SimDeviceTest, HostToDeviceReadingAnUnfinishedOffloadIsAHazard) {
  SimDevice sim;
  Buffers a(sim, 55000 * 10), b(sim, 55000 * 10);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToDevice(b.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  ASSERT_EQ(sim.hazards().size(), 1u);
  EXPECT_EQ(sim.hazards()[0].kind, SimDevice::HazardKind::kReadBeforeReady);
}

TEST(SimDeviceTest, HostToDeviceOrderedAfterItsOffloadHasNoHazard) {
  SimDevice sim;
  Buffers a(sim, 55000 * 10), b(sim, 55000 * 10), c(sim, 55000 * 10);
  const EventHandle offloaded = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(offloaded, sim.d2h_stream()).ok());
  // An H2D from a different host range may overlap the offload.
  ASSERT_TRUE(sim.CopyToDevice(c.device, c.host.data(), c.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.StreamWaitEvent(sim.h2d_stream(), offloaded).ok());
  ASSERT_TRUE(sim.CopyToDevice(b.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(SimDeviceTest, FreeingAHostBlockWhileACopyTouchesItIsAHazard) {
  SimDevice sim;
  Buffers a(sim, 55000 * 10), b(sim, 55000 * 10), c(sim, 55000 * 10);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  // Queued behind the first copy: not started, still in flight for the hazard rule.
  ASSERT_TRUE(sim.CopyToHost(b.host.data(), b.device, b.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.CopyToDevice(c.device, c.host.data(), c.bytes, sim.h2d_stream()).ok());
  sim.OnHostBlockFreed(a.host.data() + a.bytes - 1, 1);  // only the last byte
  sim.OnHostBlockFreed(b.host.data(), b.bytes);
  sim.OnHostBlockFreed(c.host.data(), c.bytes);  // an H2D's source counts too
  EXPECT_EQ(CountHazards(sim, SimDevice::HazardKind::kHostReuseInFlight), 3u);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  sim.OnHostBlockFreed(a.host.data(), a.bytes);
  sim.OnHostBlockFreed(b.host.data(), b.bytes);
  EXPECT_EQ(CountHazards(sim, SimDevice::HazardKind::kHostReuseInFlight), 3u);
  EXPECT_STREQ(SimDevice::HazardName(SimDevice::HazardKind::kHostReuseInFlight),
               "host_reuse_in_flight");
}

TEST(SimDeviceTest, FreeingAHostBlockAfterItsCopyCompletedIsFine) {
  SimDevice sim;
  Buffers a(sim, 55000 * 10);
  const EventHandle done = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(done, sim.d2h_stream()).ok());
  // Disjoint memory is not affected by the copy.
  std::vector<uint8_t> other(64);
  sim.OnHostBlockFreed(other.data(), other.size());
  ASSERT_TRUE(sim.SynchronizeEvent(done).ok());
  sim.OnHostBlockFreed(a.host.data(), a.bytes);
  // Exactly at the completion instant counts as complete.
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 10);
  EXPECT_TRUE(sim.hazards().empty());
}

TEST(SimDeviceTest, ReleasingADeviceSourceInFlightIsAHazard) {
  SimDevice sim;
  Buffers a(sim, 55000 * 10);
  ASSERT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());
  sim.AdvanceHost(5);
  sim.OnDeviceSourceReleased(a.device, a.bytes);
  // The host side of that copy is not device memory.
  sim.OnDeviceSourceReleased(a.host.data(), a.bytes);
  ASSERT_EQ(sim.hazards().size(), 1u);
  EXPECT_EQ(sim.hazards()[0].kind, SimDevice::HazardKind::kDeviceReleaseInFlight);
  EXPECT_DOUBLE_EQ(sim.hazards()[0].time_us, 5);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  sim.OnDeviceSourceReleased(a.device, a.bytes);
  EXPECT_EQ(sim.hazards().size(), 1u);
  EXPECT_STREQ(SimDevice::HazardName(SimDevice::HazardKind::kDeviceReleaseInFlight),
               "device_release_in_flight");
}

TEST(SimDeviceTest, FreeingADeviceBufferAnH2DWritesIsAHazardAndStaysMemorySafe) {
  SimDevice sim;
  std::vector<uint8_t> host(55000 * 10, 0xab);
  void* target = sim.AllocateDeviceBuffer(host.size());
  ASSERT_TRUE(sim.CopyToDevice(target, host.data(), host.size(), sim.h2d_stream()).ok());
  sim.FreeDeviceBuffer(target);  // the copy lands later; the sim keeps the memory alive
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_EQ(CountHazards(sim, SimDevice::HazardKind::kDeviceReleaseInFlight), 1u);

  void* ok = sim.AllocateDeviceBuffer(host.size());
  ASSERT_TRUE(sim.CopyToDevice(ok, host.data(), host.size(), sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  sim.FreeDeviceBuffer(ok);
  EXPECT_EQ(CountHazards(sim, SimDevice::HazardKind::kDeviceReleaseInFlight), 1u);
}

// --- Whole-run properties ---

// A small offload/prefetch schedule with a compute stream, run on a fresh device.
struct RunResult {
  std::vector<Entry> timeline;
  std::vector<SimDevice::Hazard> hazards;
  double blocked_us;
  double host_us;
};

RunResult RunSchedule() {
  SimDeviceOptions options;
  options.copy_latency_us = 3;
  SimDevice sim(options);
  const StreamHandle compute = sim.CreateStream();
  constexpr int kLayers = 4;
  constexpr size_t kBytes = 55000 * 37;
  std::vector<void*> device(kLayers);
  std::vector<std::vector<uint8_t>> host(kLayers, std::vector<uint8_t>(kBytes));
  std::vector<EventHandle> produced(kLayers), offloaded(kLayers), restored(kLayers);
  for (int i = 0; i < kLayers; ++i) {
    device[i] = sim.AllocateDeviceBuffer(kBytes);
    produced[i] = sim.CreateEvent().value();
    offloaded[i] = sim.CreateEvent().value();
    restored[i] = sim.CreateEvent().value();
  }
  for (int i = 0; i < kLayers; ++i) {  // forward
    sim.Compute(compute, 20 + 3 * i, {}, "fwd");
    (void)sim.RecordEvent(produced[i], compute);
    (void)sim.StreamWaitEvent(sim.d2h_stream(), produced[i]);
    (void)sim.CopyToHost(host[i].data(), device[i], kBytes, sim.d2h_stream());
    (void)sim.RecordEvent(offloaded[i], sim.d2h_stream());
    sim.AdvanceHost(1.5);
  }
  for (int i = kLayers - 1; i >= 0; --i) {  // backward
    (void)sim.StreamWaitEvent(sim.h2d_stream(), offloaded[i]);
    (void)sim.CopyToDevice(device[i], host[i].data(), kBytes, sim.h2d_stream());
    (void)sim.RecordEvent(restored[i], sim.h2d_stream());
    (void)sim.StreamWaitEvent(compute, restored[i]);
    sim.Compute(compute, 40, {{device[i], kBytes}}, "bwd");
    sim.AdvanceHost(0.7);
  }
  (void)sim.SynchronizeAll();
  for (int i = 0; i < kLayers; ++i) sim.FreeDeviceBuffer(device[i]);
  return RunResult{sim.timeline(), sim.hazards(), sim.blocked_us(compute), sim.host_time_us()};
}

TEST(SimDeviceTest, IdenticalRunsGiveIdenticalTimelines) {
  const RunResult first = RunSchedule();
  const RunResult second = RunSchedule();
  EXPECT_TRUE(first.hazards.empty());
  EXPECT_GT(first.blocked_us, 0);
  ASSERT_EQ(first.timeline.size(), second.timeline.size());
  EXPECT_EQ(first.timeline.size(), 4u * 4u + CountKind(first.timeline, "wait"));
  for (size_t i = 0; i < first.timeline.size(); ++i) {
    const Entry& a = first.timeline[i];
    const Entry& b = second.timeline[i];
    EXPECT_EQ(a.stream, b.stream) << i;
    EXPECT_EQ(a.kind, b.kind) << i;
    EXPECT_EQ(a.start_us, b.start_us) << i;  // bit-identical, not just close
    EXPECT_EQ(a.end_us, b.end_us) << i;
    EXPECT_EQ(a.bytes, b.bytes) << i;
    EXPECT_EQ(a.label, b.label) << i;
  }
  EXPECT_EQ(first.blocked_us, second.blocked_us);
  EXPECT_EQ(first.host_us, second.host_us);
}

TEST(SimDeviceTest, SynchronizeAllMovesHostTimeToTheLastOpEnd) {
  SimDevice sim;
  const StreamHandle s = sim.CreateStream();
  sim.Compute(s, 250);
  sim.Compute(sim.CreateStream(), 90);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 250);
  // Host time never goes back.
  sim.AdvanceHost(1000);
  sim.Compute(s, 5);
  sim.AdvanceHost(10);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 1260);
  EXPECT_DOUBLE_EQ(sim.compute_us(s), 255);
}

TEST(SimDeviceTest, WaitingForWorkThatCanNeverFinishIsAnError) {
  SimDeviceOptions options;
  options.h2d_gbps = 0;  // a copy engine that never moves a byte
  SimDevice sim(options);
  Buffers a(sim, 1000);
  const EventHandle event = NewEvent(sim);
  ASSERT_TRUE(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).ok());
  ASSERT_TRUE(sim.RecordEvent(event, sim.h2d_stream()).ok());
  absl::Status status = sim.SynchronizeEvent(event);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("never complete"), std::string::npos) << status;
  EXPECT_EQ(sim.SynchronizeAll().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(sim.EventDone(event).value_or(true), false);
}

TEST(SimDeviceTest, BadArgumentsAreRejected) {
  SimDevice sim;
  Buffers a(sim, 16);
  EXPECT_EQ(sim.CopyToHost(a.host.data(), a.device, 16, 42).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim.CopyToDevice(nullptr, a.host.data(), 16, sim.h2d_stream()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(sim.CopyToDevice(nullptr, nullptr, 0, sim.h2d_stream()).ok());
  EXPECT_EQ(sim.blocked_us(42), 0);
  EXPECT_EQ(sim.compute_us(42), 0);
  ASSERT_TRUE(sim.SynchronizeAll().ok());
}

TEST(SimDeviceTest, InjectedFaultsFailCopiesAndEventCalls) {
  faults::ClearAll();
  SimDevice sim;
  Buffers a(sim, 55000);
  const EventHandle event = NewEvent(sim);

  faults::FailNext(faults::Fault::kCopy, 2);
  absl::Status status = sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream());
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("injected"), std::string::npos) << status;
  EXPECT_EQ(sim.CopyToDevice(a.device, a.host.data(), a.bytes, sim.h2d_stream()).code(),
            absl::StatusCode::kInternal);
  // A failed call queued nothing.
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_TRUE(sim.timeline().empty());
  EXPECT_EQ(sim.bytes_copied_to_host(), 0u);
  EXPECT_TRUE(sim.CopyToHost(a.host.data(), a.device, a.bytes, sim.d2h_stream()).ok());

  faults::FailNext(faults::Fault::kEvent, 5);
  EXPECT_EQ(sim.RecordEvent(event, sim.d2h_stream()).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(sim.StreamWaitEvent(sim.h2d_stream(), event).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(sim.EventDone(event).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(sim.SynchronizeEvent(event).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(sim.ElapsedMs(event, event).status().code(), absl::StatusCode::kInternal);
  // Exhausted: calls work again.
  EXPECT_TRUE(sim.RecordEvent(event, sim.d2h_stream()).ok());
  EXPECT_EQ(sim.EventDone(event).value_or(true), false);  // behind the copy
  ASSERT_TRUE(sim.SynchronizeEvent(event).ok());
  EXPECT_DOUBLE_EQ(sim.host_time_us(), 1);
  faults::ClearAll();
}

TEST(SimDeviceTest, HostBackendGivesAlignedMemory) {
  SimDevice sim;
  std::unique_ptr<HostMemoryBackend> backend = sim.MakeHostBackend();
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<void*> block = backend->Allocate(size_t{1} << 20);
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*block) % kHostBlockAlignment, 0u);
  backend->Free(*block, size_t{1} << 20);
}

TEST(SimDeviceTest, ConcurrentCallersAreSerialized) {
  SimDevice sim;
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&sim, t] {
      const StreamHandle stream = sim.CreateStream();
      const EventHandle event = sim.CreateEvent().value();
      std::vector<uint8_t> host(1024, static_cast<uint8_t>(t));
      void* device = sim.AllocateDeviceBuffer(host.size());
      for (int i = 0; i < kRounds; ++i) {
        EXPECT_TRUE(sim.CopyToDevice(device, host.data(), host.size(), stream).ok());
        sim.Compute(stream, 1, {{device, host.size()}});
        EXPECT_TRUE(sim.RecordEvent(event, stream).ok());
        EXPECT_TRUE(sim.EventDone(event).ok());
        if (i % 10 == 0) {
          EXPECT_TRUE(sim.SynchronizeEvent(event).ok());
        }
        sim.AdvanceHost(0.5);
        (void)sim.timeline();
        (void)sim.blocked_us(stream);
      }
      EXPECT_TRUE(sim.SynchronizeEvent(event).ok());
      sim.FreeDeviceBuffer(device);
      sim.DestroyEvent(event);
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_TRUE(sim.SynchronizeAll().ok());
  EXPECT_EQ(sim.bytes_copied_to_device(), size_t{kThreads} * kRounds * 1024);
  EXPECT_TRUE(sim.hazards().empty());
}

}  // namespace
}  // namespace ckpt_offload
