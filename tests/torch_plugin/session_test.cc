// The C++ API trains a torch::nn stack with offloaded checkpoints and matches the gradients
// of the same stack run directly, bit for bit.
#include "torch_plugin/csrc/session.h"

#include <torch/torch.h>

#include <vector>

#include "gtest/gtest.h"

namespace ckpt_offload::torch {
namespace {

struct Stack {
  Stack(int layers, int hidden, const at::Device& device) {
    ::torch::manual_seed(0);
    for (int i = 0; i < layers; ++i) {
      ups.push_back(::torch::nn::Linear(hidden, 2 * hidden));
      downs.push_back(::torch::nn::Linear(2 * hidden, hidden));
      ups.back()->to(device);
      downs.back()->to(device);
    }
  }
  at::Tensor Layer(int i, const at::Tensor& x) {
    return x + downs[i]->forward(::torch::gelu(ups[i]->forward(x)));
  }
  std::vector<at::Tensor> Grads() {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < ups.size(); ++i) {
      for (auto* module : {ups[i].get(), downs[i].get()}) {
        for (auto& p : module->parameters()) out.push_back(p.grad().clone());
      }
    }
    return out;
  }
  void ZeroGrad() {
    for (size_t i = 0; i < ups.size(); ++i) {
      for (auto* module : {ups[i].get(), downs[i].get()}) {
        for (auto& p : module->parameters()) p.mutable_grad() = at::Tensor();
      }
    }
  }
  std::vector<::torch::nn::Linear> ups, downs;
};

OffloaderConfig MakeConfig(Backend backend, int keep_last, int prefetch_depth) {
  OffloaderConfig config;
  config.backend = backend;
  config.keep_last = keep_last;
  config.prefetch_depth = prefetch_depth;
  config.min_offload_bytes = 0;
  return config;
}

struct Case {
  Backend backend;  // kHost runs on CPU tensors, kCuda on the GPU (skipped without one)
  int keep_last;
  int prefetch_depth;
};

class SessionTest : public ::testing::TestWithParam<Case> {};

TEST_P(SessionTest, OffloadedCheckpointGradientsEqualDirectRun) {
  const Case c = GetParam();
  const int keep_last = c.keep_last;
  const bool cuda = c.backend == Backend::kCuda;
  if (cuda && !::torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  constexpr int kLayers = 5;
  Stack stack(kLayers, 32, device);
  at::Tensor x = ::torch::randn({4, 16, 32}).to(device);

  at::Tensor h = x;
  for (int i = 0; i < kLayers; ++i) h = stack.Layer(i, h);
  at::Tensor reference_loss = h.pow(2).mean();
  reference_loss.backward();
  std::vector<at::Tensor> reference = stack.Grads();
  stack.ZeroGrad();

  Session session(MakeConfig(c.backend, keep_last, c.prefetch_depth));
  h = x;
  for (int i = 0; i < kLayers; ++i) {
    h = checkpoint(
        session, [&stack, i](const at::Tensor& in) { return stack.Layer(i, in); }, h);
  }
  at::Tensor loss = h.pow(2).mean();
  loss.backward();
  std::vector<at::Tensor> got = stack.Grads();

  EXPECT_TRUE(::torch::equal(reference_loss, loss));
  ASSERT_EQ(reference.size(), got.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(::torch::equal(reference[i], got[i])) << i;

  const OffloaderStats stats = session.stats();
  EXPECT_EQ(stats.engine.offloaded_tensors, kLayers - keep_last);
  EXPECT_EQ(stats.engine.kept_resident_tensors, keep_last);
  EXPECT_EQ(stats.engine.restored_tensors, kLayers - keep_last);
  if (c.prefetch_depth > 0) {
    EXPECT_GE(stats.engine.prefetched_tensors, kLayers - keep_last - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(HostBackend, SessionTest,
                         ::testing::Values(Case{Backend::kHost, 0, 0}, Case{Backend::kHost, 1, 1},
                                           Case{Backend::kHost, 2, 1}, Case{Backend::kHost, 1, 2}));

// Runs on the GPU machine (tests/gpu/run_gpu_suite.sh); skipped where no GPU is visible.
INSTANTIATE_TEST_SUITE_P(CudaBackend, SessionTest,
                         ::testing::Values(Case{Backend::kCuda, 0, 0}, Case{Backend::kCuda, 1, 1},
                                           Case{Backend::kCuda, 2, 2}));

TEST(SessionConfig, BadFieldIsNamed) {
  OffloaderConfig config = MakeConfig(Backend::kHost, -1, 1);
  try {
    Session session(config);
    FAIL() << "expected an error";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("keep_last"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace ckpt_offload::torch
