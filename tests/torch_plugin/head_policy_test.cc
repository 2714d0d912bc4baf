// HeadPolicy's first restores: the triggers that the forward's last saving node saved come
// back as backward begins, once; a later save or a later group makes them ordinary triggers.
#include "torch_plugin/csrc/head_policy.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace ckpt_offload::torch_plugin {
namespace {

// An activation: made by autograd from a tensor that needs a gradient.
at::Tensor Activation() {
  return ::torch::ones({16}, ::torch::requires_grad()) * 2;
}

// A forward whose last checkpoint group ended: the head window is open.
void OpenHeadWindow(HeadPolicy& policy) {
  policy.StartForward();
  policy.OnGroupEnd();
  policy.NoteGroupEntry(64);
}

// `policy` sees `tensor` saved by node `saved_by` and files `groups` as what it triggers.
void SaveTrigger(HeadPolicy& policy, const at::Tensor& tensor, uint64_t saved_by,
                 const void* key, std::vector<GroupId> groups) {
  EXPECT_TRUE(policy.TakeTriggeredBy(tensor, saved_by).empty());  // no candidates here
  policy.AddTrigger(key, std::move(groups), saved_by);
}

TEST(HeadPolicyTest, TheLastSavingNodesTriggersAreRestoredFirstAndOnce) {
  HeadPolicy policy;
  OpenHeadWindow(policy);
  const at::Tensor early = Activation(), hidden = Activation(), weight = Activation();
  SaveTrigger(policy, early, 10, &early, {3});
  // One node saves two triggers (its hidden states and another tensor).
  SaveTrigger(policy, hidden, 11, &hidden, {4});
  SaveTrigger(policy, weight, 11, &weight, {5});
  std::vector<GroupId> first = policy.TakeFirstRestores();
  std::sort(first.begin(), first.end());
  EXPECT_EQ(first, (std::vector<GroupId>{4, 5}));
  EXPECT_TRUE(policy.TakeFirstRestores().empty());
  policy.OnBackwardBegin();
  // Their keys restore nothing more; the earlier node's trigger still does, at its unpack.
  EXPECT_TRUE(policy.TakeTrigger(&hidden).empty());
  EXPECT_TRUE(policy.TakeTrigger(&weight).empty());
  EXPECT_EQ(policy.TakeTrigger(&early), (std::vector<GroupId>{3}));
  EXPECT_FALSE(policy.MayHaveTriggers());
}

TEST(HeadPolicyTest, ALaterSaveMakesTheTriggerAnOrdinaryOne) {
  HeadPolicy policy;
  OpenHeadWindow(policy);
  const at::Tensor hidden = Activation(), logits = Activation();
  SaveTrigger(policy, hidden, 11, &hidden, {4});
  // The loss, a later node, saves after it (a model's own cross-entropy after its LM head):
  // the trigger's unpack comes later in backward.
  EXPECT_TRUE(policy.TakeTriggeredBy(logits, 12).empty());
  EXPECT_TRUE(policy.TakeFirstRestores().empty());
  policy.OnBackwardBegin();
  EXPECT_EQ(policy.TakeTrigger(&hidden), (std::vector<GroupId>{4}));
}

TEST(HeadPolicyTest, AGroupAfterTheTriggerOrANewForwardLeavesNoFirstRestores) {
  const at::Tensor hidden = Activation();
  {
    // A projector between a vision tower and the language model: a group begins after it.
    HeadPolicy policy;
    OpenHeadWindow(policy);
    SaveTrigger(policy, hidden, 11, &hidden, {4});
    policy.OnGroupBegin();
    policy.OnGroupEnd();
    EXPECT_TRUE(policy.TakeFirstRestores().empty());
    EXPECT_EQ(policy.TakeTrigger(&hidden), (std::vector<GroupId>{4}));
  }
  {
    HeadPolicy policy;
    OpenHeadWindow(policy);
    SaveTrigger(policy, hidden, 11, &hidden, {4});
    policy.StartForward();  // the last forward saw no backward
    EXPECT_TRUE(policy.TakeFirstRestores().empty());
    EXPECT_FALSE(policy.MayHaveTriggers());
  }
}

}  // namespace
}  // namespace ckpt_offload::torch_plugin
