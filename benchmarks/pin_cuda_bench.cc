// How long the CUDA backend takes to make a slab of pinned host memory, per pin mode: what
// a step that grows the host pool waits for. Needs a GPU; built here, run on the GPU
// machine (tools/gpu_prepare.sh copies it into .gpu_bin).
//
//   pin_cuda_bench [GIB...]     (default: 1 4), 3 rounds, the modes interleaved per round
//
// It links abseil and the CUDA runtime dynamically: on the GPU machine, LD_LIBRARY_PATH as
// tests/gpu/run_gpu_suite.sh sets it (.gpu_deps/absl/lib, torch's lib, nvidia/cu13/lib).
//
// Prints one JSON line per slab: mode, GiB, seconds, seconds per GiB.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "offload_core/device.h"
#include "offload_core/host_arena.h"

namespace ckpt_offload {
namespace {

constexpr int kRounds = 3;

int Run(const std::vector<double>& sizes_gib) {
  using PinMode = CudaDeviceOptions::PinMode;
  struct Mode {
    PinMode pin_mode;
    std::unique_ptr<HostMemoryBackend> backend;
  };
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Mode> modes;
  for (PinMode pin_mode : {PinMode::kHostAlloc, PinMode::kHostRegister}) {
    CudaDeviceOptions options;
    options.pin_mode = pin_mode;
    absl::StatusOr<std::unique_ptr<Device>> device = MakeCudaDevice(options);
    if (!device.ok()) {
      std::fprintf(stderr, "no CUDA device: %s\n", device.status().ToString().c_str());
      return 1;
    }
    modes.push_back({pin_mode, (*device)->MakeHostBackend()});
    devices.push_back(*std::move(device));
  }
  for (int round = 0; round < kRounds; ++round) {
    for (double gib : sizes_gib) {
      const size_t bytes = static_cast<size_t>(gib * (size_t{1} << 30));
      for (Mode& mode : modes) {
        const auto start = std::chrono::steady_clock::now();
        absl::StatusOr<void*> slab = mode.backend->Allocate(bytes);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (!slab.ok()) {
          std::fprintf(stderr, "%s: %s\n", mode.backend->name(), slab.status().ToString().c_str());
          return 1;
        }
        mode.backend->Free(*slab, bytes);
        std::printf(
            "{\"round\": %d, \"method\": \"ckpt_offload %s\", \"gib\": %g, \"seconds\": %.4f, "
            "\"s_per_gib\": %.4f}\n",
            round, mode.backend->name(), gib, seconds, seconds / gib);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace ckpt_offload

int main(int argc, char** argv) {
  std::vector<double> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atof(argv[i]));
  if (sizes.empty()) sizes = {1, 4};
  return ckpt_offload::Run(sizes);
}
