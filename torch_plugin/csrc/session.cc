#include "torch_plugin/csrc/session.h"

#include <utility>

namespace ckpt_offload::torch {
namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

// Keeps the packed input (or the input, kept, when it was not offloaded) for backward.
struct SavedInput : public ::torch::CustomClassHolder {
  torch_plugin::SavedTensor input;
  LayerFn fn;
  Session* session = nullptr;
};

class CheckpointFunction : public ::torch::autograd::Function<CheckpointFunction> {
 public:
  // `grad_anchor` requires grad so the output does even when `input` does not: the
  // parameters `fn` uses are not inputs of this Function.
  static at::Tensor forward(AutogradContext* ctx, at::Tensor input, at::Tensor grad_anchor,
                            Session* session, LayerFn fn) {
    auto saved = c10::make_intrusive<SavedInput>();
    torch_plugin::TensorOffloader& offloader = session->offloader();
    offloader.BeginGroup({input});
    saved->input = offloader.Pack(input);
    offloader.EndGroup();
    saved->fn = fn;
    saved->session = session;
    at::Tensor output;
    {
      at::NoGradGuard no_grad;
      output = fn(input);
    }
    ctx->saved_data["input"] = c10::IValue::make_capsule(saved);
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved =
        c10::static_intrusive_pointer_cast<SavedInput>(ctx->saved_data["input"].toCapsule());
    // Both unpacks raise autograd's in-place error if `input` was modified since forward.
    torch_plugin::TensorOffloader& offloader = saved->session->offloader();
    at::Tensor restored = saved->input.packed ? offloader.Unpack(*saved->input.packed)
                                              : offloader.UnpackKept(*saved->input.kept);
    at::Tensor input = restored.detach().requires_grad_(true);
    at::Tensor output;
    {
      at::AutoGradMode grad_mode(true);
      output = saved->fn(input);
    }
    ::torch::autograd::backward({output}, {grad_outputs[0]});
    return {input.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Session::Session(OffloaderConfig config) {
  auto made = torch_plugin::TensorOffloader::Create(config);
  TORCH_CHECK(made.ok(), "ckpt_offload: ", made.status().ToString());
  offloader_ = std::move(*made);
}

Session::~Session() {
  try {
    offloader_->Reset();
  } catch (const c10::Error&) {
    // Destructors must not throw; the engine already released what it could.
  }
}

at::Tensor checkpoint(Session& session, LayerFn fn, const at::Tensor& input) {
  static const at::Tensor grad_anchor = at::empty({0}).requires_grad_(true);
  return CheckpointFunction::apply(input, grad_anchor, &session, std::move(fn));
}

}  // namespace ckpt_offload::torch
