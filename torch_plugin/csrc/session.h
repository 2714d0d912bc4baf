// C++ API for LibTorch training loops (no Python).
//
//   ckpt_offload::torch::Session session({.keep_last = 1, .backend = Backend::kCuda});
//   for (auto& layer : layers) h = ckpt_offload::torch::checkpoint(session, layer_fn, h);
//   loss(h).backward();
//
// checkpoint() runs `fn` without keeping its internals, offloads its input through the
// session's engine, and in backward restores the input (prefetched), recomputes `fn` with
// grad and backpropagates through it. Gradients equal those of running `fn` directly.
#ifndef CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_SESSION_H_
#define CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_SESSION_H_

#include <torch/torch.h>

#include <functional>
#include <memory>

#include "torch_plugin/csrc/tensor_offloader.h"

namespace ckpt_offload::torch {

using torch_plugin::Backend;
using torch_plugin::OffloaderConfig;
using torch_plugin::OffloaderStats;

class Session {
 public:
  // Throws c10::Error naming the bad field.
  explicit Session(OffloaderConfig config = {});
  ~Session();  // drains the engine
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  OffloaderStats stats() const { return offloader_->stats(); }
  torch_plugin::TensorOffloader& offloader() { return *offloader_; }
  // Drops everything (after an exception in a step).
  void Reset() { offloader_->Reset(); }

 private:
  std::shared_ptr<torch_plugin::TensorOffloader> offloader_;
};

using LayerFn = std::function<at::Tensor(const at::Tensor&)>;

at::Tensor checkpoint(Session& session, LayerFn fn, const at::Tensor& input);

}  // namespace ckpt_offload::torch

#endif  // CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_SESSION_H_
