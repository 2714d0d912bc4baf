// Device: the streams, events and copies the offload engine needs, behind one interface.
//
// Contract
// - Streams and events are opaque handles. The compute stream is always supplied by the
//   caller, at every call: the device never captures it (PyTorch code switches streams).
// - The device owns two copy streams, one per direction, so device->host and host->device
//   copies can run at once.
// - Events follow CUDA semantics: RecordEvent captures the work queued on the stream so far;
//   EventDone is true once that work finished (and for an event never recorded);
//   StreamWaitEvent makes later work on the stream wait for it without blocking the host.
// - Every failure is an absl::Status carrying the backend's error text.
// - Calls may come from several threads; implementations serialize internally as needed.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_DEVICE_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload_core/host_arena.h"

namespace ckpt_offload {

using StreamHandle = uintptr_t;  // cudaStream_t for CUDA, an index for SimDevice
using EventHandle = uint64_t;    // 0 is never a valid event

class Device {
 public:
  virtual ~Device() = default;
  virtual const char* name() const = 0;

  virtual StreamHandle d2h_stream() const = 0;
  virtual StreamHandle h2d_stream() const = 0;

  // Events are created with timing so ElapsedMs works.
  virtual absl::StatusOr<EventHandle> CreateEvent() = 0;
  virtual void DestroyEvent(EventHandle event) = 0;
  virtual absl::Status RecordEvent(EventHandle event, StreamHandle stream) = 0;
  virtual absl::Status StreamWaitEvent(StreamHandle stream, EventHandle event) = 0;
  virtual absl::StatusOr<bool> EventDone(EventHandle event) = 0;
  virtual absl::Status SynchronizeEvent(EventHandle event) = 0;
  // Milliseconds from `start` to `end` (negative when `end` completed first); both done.
  virtual absl::StatusOr<double> ElapsedMs(EventHandle start, EventHandle end) = 0;

  // Asynchronous copies queued on `stream`. Host pointers come from MakeHostBackend's memory.
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                                  StreamHandle stream) = 0;
  virtual absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                                    StreamHandle stream) = 0;

  // The host memory this device copies fastest from/to (pinned memory for CUDA).
  virtual std::unique_ptr<HostMemoryBackend> MakeHostBackend() = 0;

  // Observation points for hazard checking (SimDevice); no-ops elsewhere. The engine calls
  // them when it returns a host block to the arena and when it releases a device source.
  virtual void OnHostBlockFreed(const void* host, size_t bytes) {}
  virtual void OnDeviceSourceReleased(const void* device, size_t bytes) {}

  // How this device's host memory is placed on NUMA nodes, one line for logs (e.g. "node 1
  // (GPU 0000:3b:00.0; nodes 0,1 online)" or "no NUMA placement: single NUMA node (node
  // 0)"); empty for devices that do not place host memory. Thread-safe.
  virtual std::string numa_placement() const { return ""; }
};

// Host backend device: "device" memory is host memory, copies are memcpy done at once,
// every event is complete. Lets every engine path run (bit-exactly) on CPU-only machines.
std::unique_ptr<Device> MakeHostDevice();

// CudaDeviceOptions::numa_node values other than a node id.
inline constexpr int kNumaNodeAuto = -2;  // the node of the GPU's PCI slot, when there are several
inline constexpr int kNumaNodeNone = -1;  // no placement: the kernel's default policy

// CUDA runtime device on the current CUDA device; absl::UnavailableError when this build
// has no CUDA support or no GPU is visible, InvalidArgument for a numa_node below -2.
// Defined in cuda_device.cc.
struct CudaDeviceOptions {
  // Pinned host memory: cudaHostAlloc, or mmap + cudaHostRegister. Registering is the
  // default: its slabs are populated by several threads and may use huge pages
  // (numa.h's MapHostMemory), so a step that grows the pool waits less (measured with
  // benchmarks/pin_cuda_bench.cc); copies run at the same speed.
  enum class PinMode { kHostAlloc, kHostRegister };
  PinMode pin_mode = PinMode::kHostRegister;
  // NUMA node the pinned slabs are allocated on (MPOL_PREFERRED): kNumaNodeAuto,
  // kNumaNodeNone or a node id >= 0. Best effort: when the kernel refuses placement the
  // slabs are allocated unplaced and numa_placement() says why (see numa.h).
  int numa_node = kNumaNodeAuto;
};
absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(CudaDeviceOptions options = {});
bool CudaSupportCompiled();

}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_DEVICE_H_
