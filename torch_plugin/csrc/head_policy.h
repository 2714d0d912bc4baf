// HeadPolicy: which tensors saved after the checkpointed layers are copied out, and when
// they come back. Those tensors are a model's *head* (the final norm, the LM head and the
// loss of a language model): no checkpoint group holds them, and backward needs them first.
//
// Contract
// - Windows. A head *window* opens when a checkpoint group ends and closes when the next
//   group begins, when backward begins (the first unpack after a forward) or when a forward
//   starts. Only tensors saved while a window is open are considered.
// - Candidates. A tensor saved in an open window may be copied out when it is produced by
//   autograd (not a leaf, nor a view of one: no parameters or their transposes, labels or
//   buffers), is eligible for offload, and is at most twice the forward's largest
//   checkpoint-group entry (hidden-state sized: a language model's logits stay).
// - Budget. At most kMaxHeadEntries candidates per window, offloaded or waiting. A window
//   that a later group closes was not the head, and the next window starts with the whole
//   budget again: a vision tower's projector, saved between the tower's layers and the
//   language model's, leaves the LM head its budget.
// - Triggers. A candidate is handed to the engine only when a later saved tensor of at least
//   min_offload_bytes on another storage (its *trigger*) comes in the same window. The
//   trigger's first unpack in backward restores it ahead of need: backward runs the head in
//   reverse, so a candidate's own backward comes right after its trigger's. A tensor saved
//   by the node that saved a candidate is no trigger for it: that node unpacks both at
//   once, so the restore would come when backward already waits for it (a Linear's weight
//   and input; Cut Cross-Entropy's classifier and hidden states). Nor is a tensor made
//   outside autograd (a leaf that needs no gradient and is no view): a fused loss's gradient
//   computed in forward (Liger's), whose backward only scales it and is over before a
//   restore could finish. Candidates that nothing large follows stay where they are
//   (counted as kept when backward begins).
//
// HeadPolicy decides; TensorOffloader acts (engine calls, storage bookkeeping) and reports
// back through the transitions below.
//
// Thread-safety: none of its own. TensorOffloader owns one and calls it with its engine_mu_
// held (the member is ABSL_GUARDED_BY that mutex), except MayHaveTriggers().
#ifndef CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_HEAD_POLICY_H_
#define CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_HEAD_POLICY_H_

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "offload_core/engine.h"

namespace ckpt_offload::torch_plugin {

class OffloadedStorage;

// Head candidates per window at most (a language model's head has few: the final norm's
// input, the LM head's input).
inline constexpr int kMaxHeadEntries = 4;

class HeadPolicy {
 public:
  HeadPolicy() = default;
  HeadPolicy(const HeadPolicy&) = delete;
  HeadPolicy& operator=(const HeadPolicy&) = delete;

  // Transitions of the forward.
  // A forward starts (its first group), or the offloader resets: every window, candidate
  // and trigger of the last forward is forgotten.
  void StartForward();
  // A checkpoint group begins: the open window (if any) was not the head. Its waiting
  // candidates stay where they are; its triggers still restore what they triggered.
  void OnGroupBegin();
  // A checkpoint group that the offloader opened ended: a window opens.
  void OnGroupEnd();
  // A group entry of `bytes` was offloaded: candidates may be up to twice the largest.
  void NoteGroupEntry(int64_t bytes);
  // Backward began: the window closes; candidates still waiting count as kept.
  void OnBackwardBegin();

  bool window_open() const { return window_open_; }

  // Saving a tensor in the open window.
  // Nodes are named by autograd's sequence number at the save (at::sequence_number::peek():
  // one value for all tensors one node saves, another for the next node's).
  // The live candidates that `trigger`, saved now by node `saved_by`, triggers: those saved
  // by earlier nodes, none when `trigger` was made outside autograd. The caller hands each
  // to the engine and reports NoteCandidateOffloaded() for those it took.
  // REQUIRES: window_open().
  std::vector<std::shared_ptr<OffloadedStorage>> TakeTriggeredBy(const at::Tensor& trigger,
                                                                 uint64_t saved_by);
  void NoteCandidateOffloaded() { window_offloaded_++; }
  // Whether `tensor`, covering `span_bytes` of its storage, may become a candidate, by the
  // window, the budget, its origin and its size (eligibility is the caller's to check).
  bool MayBecomeCandidate(const at::Tensor& tensor, int64_t span_bytes) const;
  // REQUIRES: MayBecomeCandidate(the tensor) was true.
  void AddCandidate(const std::shared_ptr<OffloadedStorage>& candidate, uint64_t saved_by);

  // Trigger keys: a saved handle's identity that lives as long as the handle (a kept
  // tensor's TensorImpl, a packed one's OffloadedStorage).
  // Records that the first unpack of `trigger_key` restores `groups` (eager engine groups).
  void AddTrigger(const void* trigger_key, std::vector<GroupId> groups);
  // The groups to restore at `trigger_key`'s unpack, once: empty for any other key.
  std::vector<GroupId> TakeTrigger(const void* trigger_key);
  // A snapshot that may be read without the offloader's lock: false means no trigger was
  // registered when it was taken, so an unpack can skip taking the lock.
  bool MayHaveTriggers() const { return trigger_count_.load(std::memory_order_acquire) > 0; }

  // Candidates that backward found still waiting (stats: head_kept_tensors).
  int64_t kept_tensors() const { return kept_tensors_; }
  void ResetStats() { kept_tensors_ = 0; }

  // Whether `tensor` is an activation: produced by autograd and not a view of a leaf. A
  // trainable weight's transpose (saved by a full fine-tune's LM head) lives on in its
  // parameter, so copying it out would free nothing.
  static bool IsActivation(const at::Tensor& tensor);
  // Whether `tensor` was made outside autograd: a leaf that needs no gradient, not a view.
  static bool IsMadeOutsideAutograd(const at::Tensor& tensor);

 private:
  bool window_open_ = false;
  int window_offloaded_ = 0;               // candidates of the open window handed to the engine
  int64_t largest_group_entry_bytes_ = 0;  // in this forward
  struct Waiting {
    std::weak_ptr<OffloadedStorage> candidate;
    uint64_t saved_by;  // the saving node's sequence number
  };
  std::vector<Waiting> waiting_;  // candidates without a trigger
  std::unordered_map<const void*, std::vector<GroupId>> triggers_;
  std::atomic<int64_t> trigger_count_{0};  // triggers_.size(), for MayHaveTriggers()
  int64_t kept_tensors_ = 0;
};

}  // namespace ckpt_offload::torch_plugin

#endif  // CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_HEAD_POLICY_H_
