// Built when no CUDA toolkit was found: the CUDA backend reports itself unavailable.
#include "offload_core/device.h"

namespace ckpt_offload {

bool CudaSupportCompiled() { return false; }

absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(CudaDeviceOptions) {
  return absl::UnavailableError("ckpt_offload was built without CUDA support");
}

}  // namespace ckpt_offload
