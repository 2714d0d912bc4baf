// The host backend: "device" memory is host memory and every copy is a memcpy done at
// once, so every event is complete as soon as it is recorded.
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "offload_core/device.h"
#include "offload_core/fault_hooks.h"

namespace ckpt_offload {
namespace {

class HostDevice : public Device {
 public:
  const char* name() const override { return "host"; }
  StreamHandle d2h_stream() const override { return 1; }
  StreamHandle h2d_stream() const override { return 2; }

  absl::StatusOr<EventHandle> CreateEvent() override {
    std::lock_guard<std::mutex> lock(mu_);
    EventHandle event = next_event_++;
    events_.insert(event);
    return event;
  }
  void DestroyEvent(EventHandle event) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.erase(event);
  }
  absl::Status RecordEvent(EventHandle event, StreamHandle) override {
    return CheckEvent(event, "record");
  }
  absl::Status StreamWaitEvent(StreamHandle, EventHandle event) override {
    return CheckEvent(event, "wait");
  }
  absl::StatusOr<bool> EventDone(EventHandle event) override {
    absl::Status status = CheckEvent(event, "query");
    if (!status.ok()) return status;
    return true;
  }
  absl::Status SynchronizeEvent(EventHandle event) override {
    return CheckEvent(event, "synchronize");
  }
  absl::StatusOr<double> ElapsedMs(EventHandle start, EventHandle end) override {
    absl::Status status = CheckEvent(start, "elapsed");
    if (!status.ok()) return status;
    status = CheckEvent(end, "elapsed");
    if (!status.ok()) return status;
    return 0.0;
  }
  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                          StreamHandle) override {
    return Copy(host_dst, device_src, bytes, "device->host");
  }
  absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                            StreamHandle) override {
    return Copy(device_dst, host_src, bytes, "host->device");
  }
  std::unique_ptr<HostMemoryBackend> MakeHostBackend() override { return MakeAlignedHostBackend(); }

 private:
  absl::Status CheckEvent(EventHandle event, const char* what) {
    if (faults::ShouldFail(faults::Fault::kEvent)) {
      return absl::InternalError(absl::StrCat("host device: injected event ", what, " failure"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.count(event) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("host device: unknown event ", event));
    }
    return absl::OkStatus();
  }
  static absl::Status Copy(void* dst, const void* src, size_t bytes, const char* what) {
    if (faults::ShouldFail(faults::Fault::kCopy)) {
      return absl::InternalError(absl::StrCat("host device: injected ", what, " copy failure"));
    }
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  std::mutex mu_;
  EventHandle next_event_ = 1;
  std::unordered_set<EventHandle> events_;
};

}  // namespace

std::unique_ptr<Device> MakeHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace ckpt_offload
