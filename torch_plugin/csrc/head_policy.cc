#include "torch_plugin/csrc/head_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ckpt_offload::torch_plugin {

void HeadPolicy::StartForward() {
  window_open_ = false;
  window_offloaded_ = 0;
  largest_group_entry_bytes_ = 0;
  waiting_.clear();
  triggers_.clear();
  trigger_count_.store(0, std::memory_order_release);
}

void HeadPolicy::OnGroupBegin() {
  // The tensors saved since the last group were not the model's head; those still waiting
  // for a trigger stay where they are.
  window_open_ = false;
  waiting_.clear();
}

void HeadPolicy::OnGroupEnd() {
  window_open_ = true;
  window_offloaded_ = 0;
}

void HeadPolicy::NoteGroupEntry(int64_t bytes) {
  largest_group_entry_bytes_ = std::max(largest_group_entry_bytes_, bytes);
}

void HeadPolicy::OnBackwardBegin() {
  window_open_ = false;
  for (const Waiting& waiting : waiting_) {
    if (!waiting.candidate.expired()) kept_tensors_++;
  }
  waiting_.clear();
}

std::vector<std::shared_ptr<OffloadedStorage>> HeadPolicy::TakeTriggeredBy(
    const at::Tensor& trigger, uint64_t saved_by) {
  TORCH_INTERNAL_ASSERT(window_open_, "ckpt_offload: head trigger outside a head window");
  std::vector<std::shared_ptr<OffloadedStorage>> triggered;
  if (IsMadeOutsideAutograd(trigger)) return triggered;
  std::vector<Waiting> still_waiting;
  for (Waiting& waiting : waiting_) {
    if (waiting.saved_by == saved_by) {
      still_waiting.push_back(std::move(waiting));
    } else if (auto candidate = waiting.candidate.lock()) {
      triggered.push_back(std::move(candidate));
    }
  }
  waiting_ = std::move(still_waiting);
  return triggered;
}

bool HeadPolicy::IsActivation(const at::Tensor& tensor) {
  return !tensor.is_leaf() && !(tensor.is_view() && tensor._base().is_leaf());
}

bool HeadPolicy::IsMadeOutsideAutograd(const at::Tensor& tensor) {
  return tensor.is_leaf() && !tensor.requires_grad() && !tensor.is_view();
}

bool HeadPolicy::MayBecomeCandidate(const at::Tensor& tensor, int64_t span_bytes) const {
  return window_open_ && window_offloaded_ + static_cast<int>(waiting_.size()) < kMaxHeadEntries &&
         span_bytes <= 2 * largest_group_entry_bytes_ && IsActivation(tensor);
}

void HeadPolicy::AddCandidate(const std::shared_ptr<OffloadedStorage>& candidate,
                              uint64_t saved_by) {
  TORCH_INTERNAL_ASSERT(window_open_, "ckpt_offload: head candidate outside a head window");
  waiting_.push_back(Waiting{candidate, saved_by});
}

void HeadPolicy::AddTrigger(const void* trigger_key, std::vector<GroupId> groups) {
  if (groups.empty()) return;
  auto& registered = triggers_[trigger_key];
  registered.insert(registered.end(), groups.begin(), groups.end());
  trigger_count_.store(static_cast<int64_t>(triggers_.size()), std::memory_order_release);
}

std::vector<GroupId> HeadPolicy::TakeTrigger(const void* trigger_key) {
  auto it = triggers_.find(trigger_key);
  if (it == triggers_.end()) return {};
  std::vector<GroupId> groups = std::move(it->second);
  triggers_.erase(it);
  trigger_count_.store(static_cast<int64_t>(triggers_.size()), std::memory_order_release);
  return groups;
}

}  // namespace ckpt_offload::torch_plugin
