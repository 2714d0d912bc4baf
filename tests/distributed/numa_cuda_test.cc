// NUMA placement of the CUDA backend's pinned slabs, on a real GPU (tagged "gpu": run on
// the GPU machine like tests/gpu). Covers CudaDeviceOptions::numa_node's auto, none and
// explicit settings for both pin modes, and a refused placement falling back to
// unplaced pinned memory that still copies. Skipped when no GPU is visible.
#include <numaif.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "offload_core/device.h"
#include "offload_core/numa.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ckpt_offload {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

#ifndef CKPT_OFFLOAD_WITH_CUDA

TEST(CudaNumaTest, WithoutCudaTheDeviceIsUnavailable) {
  CudaDeviceOptions options;
  options.numa_node = 0;
  EXPECT_EQ(MakeCudaDevice(options).status().code(), absl::StatusCode::kUnavailable);
}

#else  // CKPT_OFFLOAD_WITH_CUDA

using PinMode = CudaDeviceOptions::PinMode;
constexpr size_t kMiB = size_t{1} << 20;

TEST(CudaNumaOptionsTest, RejectsNumaNodeBelowAuto) {
  CudaDeviceOptions options;
  options.numa_node = -3;
  absl::StatusOr<std::unique_ptr<Device> > device = MakeCudaDevice(options);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(device.status().message()), HasSubstr("numa_node: -3"));
}

int ThreadPolicyMode() {
  int mode = -1;
  unsigned long mask[16] = {};
  EXPECT_EQ(get_mempolicy(&mode, mask, 16 * 64 + 1, nullptr, 0), 0) << std::strerror(errno);
  return mode;
}

class CudaNumaTest : public ::testing::TestWithParam<PinMode> {
 protected:
  // The device for `numa_node`, or skips the test when there is no GPU.
  std::unique_ptr<Device> MakeDevice(int numa_node) {
    CudaDeviceOptions options;
    options.pin_mode = GetParam();
    options.numa_node = numa_node;
    absl::StatusOr<std::unique_ptr<Device> > device = MakeCudaDevice(options);
    if (absl::IsUnavailable(device.status())) return nullptr;
    EXPECT_TRUE(device.ok()) << device.status();
    return device.ok() ? std::move(*device) : nullptr;
  }

  // Allocates `bytes` of pinned memory, copies a pattern to the GPU and back through it.
  void ExpectPinnedRoundTrip(Device& device, HostMemoryBackend& backend, size_t bytes) {
    absl::StatusOr<void*> host = backend.Allocate(bytes);
    ASSERT_TRUE(host.ok()) << host.status();
    std::memset(*host, 0x5a, bytes);
    void* gpu = nullptr;
    ASSERT_EQ(cudaMalloc(&gpu, bytes), cudaSuccess);
    ASSERT_TRUE(device.CopyToDevice(gpu, *host, bytes, device.h2d_stream()).ok());
    ASSERT_EQ(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(device.h2d_stream())),
              cudaSuccess);
    std::memset(*host, 0, bytes);
    ASSERT_TRUE(device.CopyToHost(*host, gpu, bytes, device.d2h_stream()).ok());
    ASSERT_EQ(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(device.d2h_stream())),
              cudaSuccess);
    EXPECT_EQ(static_cast<unsigned char*>(*host)[bytes - 1], 0x5a);
    cudaFree(gpu);
    backend.Free(*host, bytes);
  }
};

TEST_P(CudaNumaTest, AutoFollowsTheGpusPciSlot) {
  std::unique_ptr<Device> device = MakeDevice(kNumaNodeAuto);
  if (device == nullptr) GTEST_SKIP() << "no CUDA device";
  int current = 0;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  char bus_id[64] = {};
  ASSERT_EQ(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), current), cudaSuccess);
  const numa::NumaChoice expected = numa::ChooseNumaNode(bus_id);
  std::printf("GPU %s: %s\n", bus_id, device->numa_placement().c_str());
  EXPECT_EQ(device->numa_placement(), expected.reason);
  std::unique_ptr<HostMemoryBackend> backend = device->MakeHostBackend();
  ExpectPinnedRoundTrip(*device, *backend, 4 * kMiB);
}

TEST_P(CudaNumaTest, NoneLeavesPlacementToTheKernel) {
  std::unique_ptr<Device> device = MakeDevice(kNumaNodeNone);
  if (device == nullptr) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(device->numa_placement(), "no NUMA placement: disabled (numa_node = -1)");
  std::unique_ptr<HostMemoryBackend> backend = device->MakeHostBackend();
  ExpectPinnedRoundTrip(*device, *backend, 4 * kMiB);
}

TEST_P(CudaNumaTest, ExplicitNodePlacesTheSlabs) {
  std::unique_ptr<Device> device = MakeDevice(0);
  if (device == nullptr) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<HostMemoryBackend> backend = device->MakeHostBackend();
  const int mode_before = ThreadPolicyMode();
  const size_t bytes = 8 * kMiB;
  absl::StatusOr<void*> host = backend->Allocate(bytes);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(ThreadPolicyMode(), mode_before);  // cudaHostAlloc's policy scope was undone
  std::printf("%s: %s\n", backend->name(), device->numa_placement().c_str());
  if (device->numa_placement() == "node 0 (requested)") {
    absl::StatusOr<int> node = numa::NodeOfAddress(static_cast<char*>(*host) + bytes / 2);
    if (GetParam() == PinMode::kHostRegister) {
      ASSERT_TRUE(node.ok()) << node.status();
      EXPECT_EQ(*node, 0);
    } else {
      // The driver maps cudaHostAlloc memory itself; the kernel may not say where it is.
      std::printf("cudaHostAlloc page node: %s\n",
                  node.ok() ? std::to_string(*node).c_str() : node.status().ToString().c_str());
    }
  } else {
    EXPECT_THAT(device->numa_placement(), StartsWith("no NUMA placement: "));
  }
  backend->Free(*host, bytes);
  ExpectPinnedRoundTrip(*device, *backend, bytes);
}

TEST_P(CudaNumaTest, RefusedPlacementFallsBackToUnplacedPinnedMemory) {
  std::unique_ptr<Device> device = MakeDevice(1000);  // never an online node
  if (device == nullptr) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(device->numa_placement(), "node 1000 (requested)");
  std::unique_ptr<HostMemoryBackend> backend = device->MakeHostBackend();
  ExpectPinnedRoundTrip(*device, *backend, 4 * kMiB);
  const std::string call = GetParam() == PinMode::kHostRegister ? "mbind" : "set_mempolicy";
  EXPECT_THAT(device->numa_placement(),
              StartsWith("no NUMA placement: " + call + "(MPOL_PREFERRED, node 1000) failed: "));
  EXPECT_THAT(device->numa_placement(), HasSubstr("(wanted node 1000 (requested))"));
  // Placement stays off for later slabs and for backends made afterwards.
  std::unique_ptr<HostMemoryBackend> second = device->MakeHostBackend();
  ExpectPinnedRoundTrip(*device, *second, 4 * kMiB);
  EXPECT_THAT(device->numa_placement(), StartsWith("no NUMA placement: " + call));
}

INSTANTIATE_TEST_SUITE_P(PinModes, CudaNumaTest,
                         ::testing::Values(PinMode::kHostAlloc, PinMode::kHostRegister),
                         [](const ::testing::TestParamInfo<PinMode>& info) {
                           return info.param == PinMode::kHostAlloc ? "HostAlloc" : "HostRegister";
                         });

#endif  // CKPT_OFFLOAD_WITH_CUDA

}  // namespace
}  // namespace ckpt_offload
