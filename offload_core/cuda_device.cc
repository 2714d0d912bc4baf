// The CUDA backend: two copy streams and pinned host memory, through the CUDA runtime API
// only (no kernels, so a plain C++ compiler builds it).
//
// Design note
// - The copy streams are created non-blocking: the caller's compute stream is often the
//   legacy default stream, and a blocking stream would serialize with it, which defeats
//   the overlap the engine exists for.
// - Handles are the CUDA objects themselves (cudaStream_t / cudaEvent_t as integers). The
//   device also remembers which events it created, so a stale or foreign handle is an
//   InvalidArgument error instead of undefined behaviour inside the driver.
// - Every CUDA error is turned into an absl::Status naming the call and carrying CUDA's
//   own error name and text, and the thread's CUDA "last error" is then cleared: the error
//   was reported through the Status, and leaving it set would make the caller's next
//   cudaGetLastError() check (PyTorch does one after every kernel launch) blame itself.
// - Pinned memory is portable (cudaHostAllocPortable / cudaHostRegisterPortable): it is
//   then pinned for every CUDA context in the process, so a block stays usable, at full
//   speed, even if the process later works with another device. It costs nothing extra.
//   Write-combined memory is avoided: it makes host reads of offloaded data very slow.
// - NUMA: pinned slabs are placed on the node of the GPU's PCI slot (numa.h chooses it;
//   CudaDeviceOptions::numa_node overrides). kHostRegister slabs are mbind()-ed before their
//   pages are faulted in; cudaHostAlloc gets the allocating thread's policy set around the
//   call. The first refused placement ends placement for the device and the backends it
//   made (the kernel would refuse the next one alike); numa_placement() keeps the reason.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "offload_core/device.h"
#include "offload_core/fault_hooks.h"
#include "offload_core/numa.h"

namespace ckpt_offload {
namespace {

// The status for a failed CUDA call `call` (e.g. "cudaMemcpyAsync(device->host)").
absl::Status CudaStatus(cudaError_t error, const std::string& call) {
  (void)cudaGetLastError();  // reported here; see the design note
  std::string message =
      absl::StrCat(call, " failed: ", cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return absl::InvalidArgumentError(message);
    case cudaErrorNotReady:
      return absl::FailedPreconditionError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status Check(cudaError_t error, const char* call) {
  return error == cudaSuccess ? absl::OkStatus() : CudaStatus(error, call);
}

cudaStream_t ToStream(StreamHandle stream) { return reinterpret_cast<cudaStream_t>(stream); }
StreamHandle FromStream(cudaStream_t stream) { return reinterpret_cast<StreamHandle>(stream); }
cudaEvent_t ToEvent(EventHandle event) {
  return reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(event));
}
EventHandle FromEvent(cudaEvent_t event) {
  return static_cast<EventHandle>(reinterpret_cast<uintptr_t>(event));
}

// Makes `device` current for the scope's lifetime when it is not already; objects that
// CUDA creates on "the current device" (events, pinned-memory contexts) must land on the
// device this backend was made for, whatever the calling thread last selected.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device) {
    int current = -1;
    status_ = Check(cudaGetDevice(&current), "cudaGetDevice");
    if (!status_.ok() || current == device) return;
    status_ = Check(cudaSetDevice(device), "cudaSetDevice");
    if (status_.ok()) previous_ = current;
  }
  ~ScopedCudaDevice() {
    if (previous_ >= 0) (void)Check(cudaSetDevice(previous_), "cudaSetDevice");
  }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
  int previous_ = -1;  // the device to restore, or -1
};

size_t PageSize() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

size_t RoundUpToPage(size_t bytes) {
  const size_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

// The NUMA node a device's pinned slabs go to, shared by the device and every host
// backend it made: the choice made at creation, until a placement fails. Thread-safe.
class NumaPlacementState {
 public:
  explicit NumaPlacementState(numa::NumaChoice choice)
      : node_(choice.node), description_(std::move(choice.reason)) {}

  // The node to place the next slab on; unset when there is none (or no longer one).
  std::optional<int> node() const {
    std::lock_guard<std::mutex> lock(mu_);
    return node_;
  }

  // Ends placement after a refusal of it (`why`: the failed call and the system's text).
  void RecordFailure(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!node_.has_value()) return;
    description_ = absl::StrCat("no NUMA placement: ", why, " (wanted ", description_, ")");
    node_.reset();
  }

  std::string description() const {
    std::lock_guard<std::mutex> lock(mu_);
    return description_;
  }

 private:
  mutable std::mutex mu_;
  std::optional<int> node_;
  std::string description_;
};

// The node for `options.numa_node` on CUDA device `device`; see CudaDeviceOptions.
numa::NumaChoice ChooseNumaNode(int numa_node, int device) {
  if (numa_node == kNumaNodeNone) {
    return {std::nullopt, "no NUMA placement: disabled (numa_node = -1)"};
  }
  if (numa_node >= 0) return {numa_node, absl::StrCat("node ", numa_node, " (requested)")};
  char bus_id[64] = {};
  const cudaError_t error = cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device);
  if (error != cudaSuccess) {
    return {std::nullopt, absl::StrCat("no NUMA placement: ",
                                       CudaStatus(error, "cudaDeviceGetPCIBusId").message())};
  }
  return numa::ChooseNumaNode(bus_id);
}

// Pinned host memory for the arena. Not thread-safe (the arena serializes calls).
class PinnedHostBackend : public HostMemoryBackend {
 public:
  PinnedHostBackend(CudaDeviceOptions::PinMode mode, int device,
                    std::shared_ptr<NumaPlacementState> numa)
      : mode_(mode), device_(device), numa_(std::move(numa)) {}

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (faults::ShouldFail(faults::Fault::kHostAllocation)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(name(), ": injected host allocation failure (", bytes, " bytes)"));
    }
    if (bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": allocation of 0 bytes"));
    }
    ScopedCudaDevice scoped(device_);
    if (!scoped.status().ok()) return scoped.status();
    absl::StatusOr<void*> block =
        mode_ == CudaDeviceOptions::PinMode::kHostAlloc ? HostAlloc(bytes) : MapAndRegister(bytes);
    if (block.ok() && reinterpret_cast<uintptr_t>(*block) % kHostBlockAlignment != 0) {
      // Both paths return page-aligned memory; this guards the contract, not a real case.
      Free(*block, bytes);
      return absl::InternalError(
          absl::StrCat(name(), ": block not aligned to ", kHostBlockAlignment, " bytes"));
    }
    return block;
  }

  void Free(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    // Free has no error channel; CudaStatus still clears the thread's CUDA error.
    if (mode_ == CudaDeviceOptions::PinMode::kHostAlloc) {
      (void)Check(cudaFreeHost(ptr), "cudaFreeHost");
      return;
    }
    (void)Check(cudaHostUnregister(ptr), "cudaHostUnregister");
    numa::UnmapHostMemory(ptr, RoundUpToPage(bytes));
  }

  const char* name() const override {
    return mode_ == CudaDeviceOptions::PinMode::kHostAlloc ? "cuda_host_alloc"
                                                           : "cuda_host_register";
  }

 private:
  absl::StatusOr<void*> HostAlloc(size_t bytes) {
    void* ptr = nullptr;
    // The driver allocates the pages in this thread, under this thread's policy.
    const std::optional<int> node = numa_->node();
    numa::ScopedPreferredNode preferred(node);
    if (node.has_value() && !preferred.placement().placed) {
      numa_->RecordFailure(preferred.placement().reason);
    }
    const cudaError_t error = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (error != cudaSuccess) {
      return CudaStatus(error, absl::StrCat("cudaHostAlloc(", bytes, " bytes)"));
    }
    return ptr;
  }

  absl::StatusOr<void*> MapAndRegister(size_t bytes) {
    const size_t mapped = RoundUpToPage(bytes);
    // MapHostMemory returns the pages resident (on the node, when placed), so
    // cudaHostRegister only has to pin them; the cost is paid there either way, since
    // pinning needs them resident.
    const std::optional<int> node = numa_->node();
    numa::Placement placement;
    absl::StatusOr<void*> mapping = numa::MapHostMemory(mapped, node, &placement);
    if (!mapping.ok()) return mapping.status();
    if (node.has_value() && !placement.placed) numa_->RecordFailure(placement.reason);
    void* ptr = *mapping;
    const cudaError_t error = cudaHostRegister(ptr, mapped, cudaHostRegisterPortable);
    if (error != cudaSuccess) {
      numa::UnmapHostMemory(ptr, mapped);
      return CudaStatus(error, absl::StrCat("cudaHostRegister(", mapped, " bytes)"));
    }
    return ptr;
  }

  const CudaDeviceOptions::PinMode mode_;
  const int device_;
  const std::shared_ptr<NumaPlacementState> numa_;
};

class CudaDevice : public Device {
 public:
  // Creates the copy streams on `device` (the current device at the call).
  static absl::StatusOr<std::unique_ptr<Device>> Create(CudaDeviceOptions options, int device) {
    std::unique_ptr<CudaDevice> cuda(new CudaDevice(
        options, device,
        std::make_shared<NumaPlacementState>(ChooseNumaNode(options.numa_node, device))));
    cudaStream_t* streams[] = {&cuda->d2h_, &cuda->h2d_};
    for (cudaStream_t* stream : streams) {
      absl::Status status = Check(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags");
      if (!status.ok()) return status;  // the destructor drops what was made
    }
    return std::unique_ptr<Device>(std::move(cuda));
  }

  ~CudaDevice() override {
    // Copies still running touch host blocks and device buffers whose owners may free
    // them right after the device goes away: let them land first. Errors are ignored
    // (at process exit the runtime may already be unloading).
    for (cudaStream_t stream : {d2h_, h2d_}) {
      if (stream == nullptr) continue;
      (void)Check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      (void)Check(cudaStreamDestroy(stream), "cudaStreamDestroy");
    }
    for (EventHandle event : events_) {
      (void)Check(cudaEventDestroy(ToEvent(event)), "cudaEventDestroy");
    }
  }

  const char* name() const override { return "cuda"; }
  StreamHandle d2h_stream() const override { return FromStream(d2h_); }
  StreamHandle h2d_stream() const override { return FromStream(h2d_); }

  absl::StatusOr<EventHandle> CreateEvent() override {
    ScopedCudaDevice scoped(device_);
    if (!scoped.status().ok()) return scoped.status();
    cudaEvent_t event = nullptr;
    // Timing stays on (cudaEventDefault) so ElapsedMs works.
    const cudaError_t error = cudaEventCreateWithFlags(&event, cudaEventDefault);
    if (error != cudaSuccess) return CudaStatus(error, "cudaEventCreateWithFlags");
    std::lock_guard<std::mutex> lock(mu_);
    events_.insert(FromEvent(event));
    return FromEvent(event);
  }

  void DestroyEvent(EventHandle event) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (events_.erase(event) == 0) return;
    }
    // Allowed with work pending: CUDA releases the event once its record completes.
    (void)Check(cudaEventDestroy(ToEvent(event)), "cudaEventDestroy");
  }

  absl::Status RecordEvent(EventHandle event, StreamHandle stream) override {
    if (absl::Status status = CheckEvent(event, "record"); !status.ok()) return status;
    return Check(cudaEventRecord(ToEvent(event), ToStream(stream)), "cudaEventRecord");
  }

  absl::Status StreamWaitEvent(StreamHandle stream, EventHandle event) override {
    if (absl::Status status = CheckEvent(event, "wait"); !status.ok()) return status;
    return Check(cudaStreamWaitEvent(ToStream(stream), ToEvent(event), 0), "cudaStreamWaitEvent");
  }

  absl::StatusOr<bool> EventDone(EventHandle event) override {
    if (absl::Status status = CheckEvent(event, "query"); !status.ok()) return status;
    const cudaError_t error = cudaEventQuery(ToEvent(event));
    if (error == cudaSuccess) return true;
    if (error == cudaErrorNotReady) {
      // Not a failure, but the runtime still records it as the thread's last error.
      (void)cudaGetLastError();
      return false;
    }
    return CudaStatus(error, "cudaEventQuery");
  }

  absl::Status SynchronizeEvent(EventHandle event) override {
    if (absl::Status status = CheckEvent(event, "synchronize"); !status.ok()) return status;
    return Check(cudaEventSynchronize(ToEvent(event)), "cudaEventSynchronize");
  }

  absl::StatusOr<double> ElapsedMs(EventHandle start, EventHandle end) override {
    if (absl::Status status = CheckEvent(start, "elapsed time"); !status.ok()) return status;
    if (absl::Status status = CheckKnown(end, "elapsed time"); !status.ok()) return status;
    float ms = 0;
    // cudaErrorNotReady (not done yet) maps to FailedPrecondition, like SimDevice.
    const cudaError_t error = cudaEventElapsedTime(&ms, ToEvent(start), ToEvent(end));
    if (error != cudaSuccess) return CudaStatus(error, "cudaEventElapsedTime");
    return static_cast<double>(ms);
  }

  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                          StreamHandle stream) override {
    return Copy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, stream,
                "cudaMemcpyAsync(device->host)");
  }

  absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                            StreamHandle stream) override {
    return Copy(device_dst, host_src, bytes, cudaMemcpyHostToDevice, stream,
                "cudaMemcpyAsync(host->device)");
  }

  std::unique_ptr<HostMemoryBackend> MakeHostBackend() override {
    return std::make_unique<PinnedHostBackend>(options_.pin_mode, device_, numa_);
  }

  std::string numa_placement() const override { return numa_->description(); }

 private:
  CudaDevice(CudaDeviceOptions options, int device, std::shared_ptr<NumaPlacementState> numa)
      : options_(options), device_(device), numa_(std::move(numa)) {}

  absl::Status CheckKnown(EventHandle event, const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.count(event) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda device: ", what, " of unknown event ", event));
    }
    return absl::OkStatus();
  }

  // Injected failures first (one per call, as in the other backends), then the handle.
  absl::Status CheckEvent(EventHandle event, const char* what) {
    if (faults::ShouldFail(faults::Fault::kEvent)) {
      return absl::InternalError(absl::StrCat("cuda device: injected event ", what, " failure"));
    }
    return CheckKnown(event, what);
  }

  static absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                           StreamHandle stream, const char* call) {
    if (faults::ShouldFail(faults::Fault::kCopy)) {
      return absl::InternalError(absl::StrCat("cuda device: injected copy failure in ", call));
    }
    if (bytes == 0) return absl::OkStatus();
    const cudaError_t error = cudaMemcpyAsync(dst, src, bytes, kind, ToStream(stream));
    if (error != cudaSuccess) return CudaStatus(error, absl::StrCat(call, " of ", bytes, " bytes"));
    return absl::OkStatus();
  }

  const CudaDeviceOptions options_;
  const int device_;
  const std::shared_ptr<NumaPlacementState> numa_;
  cudaStream_t d2h_ = nullptr;
  cudaStream_t h2d_ = nullptr;

  std::mutex mu_;
  std::unordered_set<EventHandle> events_;  // created and not yet destroyed
};

}  // namespace

bool CudaSupportCompiled() { return true; }

absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(CudaDeviceOptions options) {
  if (options.numa_node < kNumaNodeAuto) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaDeviceOptions::numa_node: ", options.numa_node,
                     " is not a node id (>= 0), kNumaNodeNone (-1) or kNumaNodeAuto (-2)"));
  }
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    // No driver, no device, driver too old, ...: all mean "no CUDA here" to the caller.
    (void)cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: cudaGetDeviceCount failed: ", cudaGetErrorName(error), ": ",
                     cudaGetErrorString(error)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: cudaGetDeviceCount found 0");
  int device = 0;
  if (absl::Status status = Check(cudaGetDevice(&device), "cudaGetDevice"); !status.ok()) {
    return status;
  }
  return CudaDevice::Create(options, device);
}

}  // namespace ckpt_offload
