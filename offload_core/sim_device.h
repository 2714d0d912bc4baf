// SimDevice: a deterministic discrete-event model of a GPU with one copy engine per
// direction, for testing and planning the offload schedule without a GPU.
//
// Model
// - Virtual clock in microseconds. The host thread has its own time (host_time_us): API
//   calls are instantaneous unless they block (SynchronizeEvent, SynchronizeAll) or the
//   caller advances it (AdvanceHost). Before each call the simulation runs up to host time.
// - Streams are FIFO queues of ops: Compute(duration), copies, event records, event waits.
//   Different streams run concurrently. Copies of one direction share that direction's copy
//   engine (one at a time, in issue order). A copy moves bytes at the direction's bandwidth,
//   or, while both directions are busy, at a share of the bidirectional cap.
// - Copies really move the bytes (memcpy at completion time), so a read that ran ahead of
//   its copy sees stale data, as on a GPU.
// - Events follow CUDA semantics (see device.h); a wait binds to the record current at the
//   time of the StreamWaitEvent call.
//
// Hazards (recorded, never fatal; tests assert there are none)
// - kReadBeforeReady: a Compute reading a device buffer, or an H2D copy reading a host
//   range, starts while a copy writing that memory is still incomplete.
// - kHostReuseInFlight: OnHostBlockFreed for a host range an incomplete copy still touches.
// - kDeviceReleaseInFlight: OnDeviceSourceReleased / FreeDeviceBuffer for device memory an
//   incomplete copy still touches.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_SIM_DEVICE_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_SIM_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "offload_core/device.h"

namespace ckpt_offload {

struct SimDeviceOptions {
  double d2h_gbps = 55.0;        // device->host bandwidth alone (1 GB/s = 1e9 bytes/s)
  double h2d_gbps = 55.0;        // host->device bandwidth alone
  double bidir_gbps = 97.0;      // both directions together
  double copy_latency_us = 0.0;  // fixed cost per copy, before bytes flow
};

struct SimBufferRef {
  const void* data = nullptr;
  size_t bytes = 0;
};

class SimDevice : public Device {
 public:
  explicit SimDevice(SimDeviceOptions options = {});
  ~SimDevice() override;

  // --- Device ---
  const char* name() const override { return "sim"; }
  StreamHandle d2h_stream() const override;
  StreamHandle h2d_stream() const override;
  absl::StatusOr<EventHandle> CreateEvent() override;
  void DestroyEvent(EventHandle event) override;
  absl::Status RecordEvent(EventHandle event, StreamHandle stream) override;
  absl::Status StreamWaitEvent(StreamHandle stream, EventHandle event) override;
  absl::StatusOr<bool> EventDone(EventHandle event) override;
  absl::Status SynchronizeEvent(EventHandle event) override;
  absl::StatusOr<double> ElapsedMs(EventHandle start, EventHandle end) override;
  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                          StreamHandle stream) override;
  absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                            StreamHandle stream) override;
  std::unique_ptr<HostMemoryBackend> MakeHostBackend() override;
  void OnHostBlockFreed(const void* host, size_t bytes) override;
  void OnDeviceSourceReleased(const void* device, size_t bytes) override;

  // --- Simulation controls ---
  // A new stream (e.g. a compute stream). Stream 0 exists from the start.
  StreamHandle CreateStream();
  // Queues `duration_us` of work on `stream` that reads the given device buffers (what it
  // writes concerns no hazard the simulator checks).
  void Compute(StreamHandle stream, double duration_us, std::vector<SimBufferRef> reads = {},
               std::string label = "");
  // "Device memory": real host memory, tracked for hazards. Freed by FreeDeviceBuffer.
  void* AllocateDeviceBuffer(size_t bytes);
  void FreeDeviceBuffer(void* data);

  void AdvanceHost(double us);
  // Runs until every stream is idle; host time becomes the time the last op ended.
  // Error when a stream waits on an event that can never complete.
  absl::Status SynchronizeAll();
  double host_time_us() const;

  struct TimelineEntry {
    StreamHandle stream;
    std::string kind;  // "compute", "d2h", "h2d", "wait"
    double start_us;
    double end_us;
    size_t bytes;
    std::string label;
  };
  std::vector<TimelineEntry> timeline() const;

  enum class HazardKind { kReadBeforeReady, kHostReuseInFlight, kDeviceReleaseInFlight };
  struct Hazard {
    HazardKind kind;
    double time_us;
    std::string detail;
  };
  std::vector<Hazard> hazards() const;
  static const char* HazardName(HazardKind kind);

  // Total time ops on `stream` sat blocked on an event wait (the exposed wait when `stream`
  // is the compute stream).
  double blocked_us(StreamHandle stream) const;
  // Total time `stream` ran compute ops.
  double compute_us(StreamHandle stream) const;
  size_t bytes_copied_to_host() const;
  size_t bytes_copied_to_device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_SIM_DEVICE_H_
