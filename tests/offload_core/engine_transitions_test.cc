// The entry and group state tables of engine.h, driven through OffloadEngine's public API on
// the simulated device: every legal transition is taken by some scenario below (checked by
// EveryLegalTransitionIsDriven), with the held-bytes and stats counters each one moves; an
// illegal transition aborts a debug build.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "offload_core/engine.h"
#include "offload_core/engine_states.h"
#include "offload_core/sim_device.h"

namespace ckpt_offload {
namespace {

using engine_internal::EngineTestPeer;
using engine_internal::EntryState;
using engine_internal::GroupState;

// 550,000 bytes at 55 GB/s take 10 us: a copy issued at host time t is done at t + 10.
constexpr size_t kB = 550000;
constexpr double kPastTheCopiesUs = 50;  // two copies back to back end by 20

// Transitions seen, as (from, to) pairs of each kind.
struct Seen {
  std::set<std::pair<EntryState, EntryState>> entries;
  std::set<std::pair<GroupState, GroupState>> groups;
};

// Sources filed by token before each offer; restore buffers kept until the rig goes.
// Single-threaded: the engine calls back on the test's thread.
class Client : public OffloadEngine::Client {
 public:
  explicit Client(SimDevice* sim) : sim_(sim) {}
  ~Client() override {
    for (const auto& [token, data] : sources_) sim_->FreeDeviceBuffer(data);
    for (void* data : restores_) sim_->FreeDeviceBuffer(data);
  }

  SourceToken NewSource(size_t bytes, void** data) {
    *data = sim_->AllocateDeviceBuffer(bytes == 0 ? 1 : bytes);
    const SourceToken token = next_token_++;
    sources_[token] = *data;
    return token;
  }
  bool Released(SourceToken token) const { return released_.count(token) > 0; }
  int dropped_restores() const { return dropped_restores_; }

  void ReleaseSource(EntryId, SourceToken source) override {
    EXPECT_TRUE(sources_.count(source) > 0) << "token " << source << " was never filed";
    EXPECT_TRUE(released_.insert(source).second) << "token " << source << " released twice";
  }
  absl::StatusOr<void*> AllocateRestore(EntryId, size_t bytes) override {
    void* data = sim_->AllocateDeviceBuffer(bytes);
    restores_.insert(data);
    return data;
  }
  void DropRestore(EntryId, void* data) override {
    EXPECT_EQ(restores_.erase(data), 1u);
    sim_->FreeDeviceBuffer(data);
    dropped_restores_++;
  }

 private:
  SimDevice* sim_;
  std::map<SourceToken, void*> sources_;
  std::set<SourceToken> released_;
  std::set<void*> restores_;
  SourceToken next_token_ = 1;
  int dropped_restores_ = 0;
};

class Rig {
 public:
  Rig(Seen* seen, EngineOptions options) : seen_(seen), client_(&sim_) {
    compute_ = sim_.CreateStream();
    auto engine = OffloadEngine::Create(&sim_, &client_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (engine.ok()) engine_ = std::move(*engine);
  }
  ~Rig() {
    EXPECT_TRUE(engine_->Reset().ok());
    EXPECT_EQ(engine_->stats().arena.live_bytes, 0u);
    EXPECT_TRUE(sim_.SynchronizeAll().ok());
    for (const auto& hazard : sim_.hazards()) {
      ADD_FAILURE() << SimDevice::HazardName(hazard.kind) << ": " << hazard.detail;
    }
    engine_.reset();
  }

  OffloadEngine& engine() { return *engine_; }
  Client& client() { return client_; }
  StreamHandle compute() const { return compute_; }
  EngineStats stats() const { return engine_->stats(); }
  size_t held() const { return engine_->stats().device_held_bytes; }

  GroupId BeginGroup() {
    auto group = engine_->BeginGroup(compute_);
    EXPECT_TRUE(group.ok()) << group.status();
    return group.value_or(0);
  }
  struct Offered {
    EntryId entry;
    SourceToken token;
    bool will_offload;
  };
  Offered Offer(GroupId group, size_t bytes) {
    void* data = nullptr;
    const SourceToken token = client_.NewSource(bytes, &data);
    auto offer = engine_->OfferEntry(group, data, bytes, token, compute_);
    EXPECT_TRUE(offer.ok()) << offer.status();
    if (!offer.ok()) return {0, token, false};
    return {offer->entry, token, offer->will_offload};
  }
  // Acquires `entry`; returns whether it came back resident.
  bool Acquire(EntryId entry) {
    auto acquired = engine_->Acquire(entry, compute_);
    EXPECT_TRUE(acquired.ok()) << acquired.status();
    if (!acquired.ok()) return false;
    EXPECT_EQ(acquired->resident, acquired->device_data == nullptr);
    return acquired->resident;
  }
  // Lets every copy issued so far complete and the engine settle them.
  void LetCopiesFinish() {
    sim_.AdvanceHost(kPastTheCopiesUs);
    EXPECT_TRUE(engine_->Synchronize().ok());
  }

  // `entry` is in `to` now, having passed through `via` (changes inside one engine call)
  // since it was last looked at (first look: from kNew). kGone: erased.
  void ExpectEntry(EntryId entry, EntryState to, std::vector<EntryState> via = {}) {
    std::optional<EntryState> now = EngineTestPeer::StateOf(*engine_, entry);
    const EntryState state = now.value_or(EntryState::kGone);
    EXPECT_EQ(state, to) << "entry " << entry << " is " << engine_internal::StateName(state)
                         << ", expected " << engine_internal::StateName(to);
    auto last = entry_seen_.find(entry);
    EntryState from = last == entry_seen_.end() ? EntryState::kNew : last->second;
    via.push_back(to);
    for (EntryState next : via) {
      if (next == from) continue;
      EXPECT_TRUE(engine_internal::IsLegalTransition(from, next))
          << engine_internal::StateName(from) << " -> " << engine_internal::StateName(next);
      seen_->entries.insert({from, next});
      from = next;
    }
    entry_seen_[entry] = to;
  }
  void ExpectGroup(GroupId group, GroupState to, std::vector<GroupState> via = {}) {
    std::optional<GroupState> now = EngineTestPeer::GroupStateOf(*engine_, group);
    const GroupState state = now.value_or(GroupState::kGone);
    EXPECT_EQ(state, to) << "group " << group << " is " << engine_internal::StateName(state)
                         << ", expected " << engine_internal::StateName(to);
    auto last = group_seen_.find(group);
    GroupState from = last == group_seen_.end() ? GroupState::kNew : last->second;
    via.push_back(to);
    for (GroupState next : via) {
      if (next == from) continue;
      EXPECT_TRUE(engine_internal::IsLegalTransition(from, next))
          << engine_internal::StateName(from) << " -> " << engine_internal::StateName(next);
      seen_->groups.insert({from, next});
      from = next;
    }
    group_seen_[group] = to;
  }

 private:
  Seen* seen_;
  SimDevice sim_;
  Client client_;
  StreamHandle compute_ = 0;
  std::unique_ptr<OffloadEngine> engine_;
  std::map<EntryId, EntryState> entry_seen_;
  std::map<GroupId, GroupState> group_seen_;
};

EngineOptions Options(int keep_last, int prefetch_depth) {
  EngineOptions options;
  options.keep_last = keep_last;
  options.prefetch_depth = prefetch_depth;
  return options;
}

// keep_last 1: a group copies once the next one begins; the kept group stays resident;
// backward restores, hands out, restores again (a retained graph), and discards.
void WindowCopyRestoreHandOutDiscard(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/1, /*prefetch_depth=*/1));
  const GroupId g1 = rig.BeginGroup();
  rig.ExpectGroup(g1, GroupState::kInWindow);
  const Rig::Offered e1 = rig.Offer(g1, kB);
  EXPECT_TRUE(e1.will_offload);
  rig.ExpectEntry(e1.entry, EntryState::kPending);
  EXPECT_EQ(rig.held(), kB);

  // g1 leaves the window: its copy starts and is in flight.
  const GroupId g2 = rig.BeginGroup();
  rig.ExpectGroup(g2, GroupState::kInWindow);
  rig.ExpectGroup(g1, GroupState::kCopying, {GroupState::kCopyStarted});
  rig.ExpectEntry(e1.entry, EntryState::kOffloading);
  const Rig::Offered e2 = rig.Offer(g2, kB);
  rig.ExpectEntry(e2.entry, EntryState::kPending);
  EXPECT_EQ(rig.held(), 2 * kB);
  EXPECT_EQ(rig.stats().offloaded_tensors, 1);

  rig.LetCopiesFinish();
  rig.ExpectEntry(e1.entry, EntryState::kOffloaded);
  rig.ExpectGroup(g1, GroupState::kCopyStarted);
  EXPECT_TRUE(rig.client().Released(e1.token));
  EXPECT_EQ(rig.held(), kB);

  // Forward ends: the window's group stays resident, and so does a late entry of it.
  ASSERT_TRUE(rig.engine().EndForward().ok());
  rig.ExpectGroup(g2, GroupState::kKept);
  rig.ExpectEntry(e2.entry, EntryState::kResident);
  EXPECT_EQ(rig.held(), 0u);
  const Rig::Offered e3 = rig.Offer(g2, kB);
  EXPECT_FALSE(e3.will_offload);
  rig.ExpectEntry(e3.entry, EntryState::kResident);
  EXPECT_EQ(rig.stats().kept_resident_tensors, 2);

  // Backward: g2 is resident; acquiring it prefetches g1.
  EXPECT_TRUE(rig.Acquire(e2.entry));
  rig.ExpectEntry(e1.entry, EntryState::kRestoring);
  EXPECT_EQ(rig.held(), kB);
  EXPECT_EQ(rig.stats().prefetched_tensors, 1);
  EXPECT_FALSE(rig.Acquire(e1.entry));
  rig.ExpectEntry(e1.entry, EntryState::kHandedOut);
  EXPECT_EQ(rig.held(), 0u);
  // A retained graph asks again: restored and handed out within the one call.
  EXPECT_FALSE(rig.Acquire(e1.entry));
  rig.ExpectEntry(e1.entry, EntryState::kHandedOut,
                  {EntryState::kRestoring, EntryState::kHandedOut});
  EXPECT_EQ(rig.stats().restored_tensors, 2);
  EXPECT_EQ(rig.held(), 0u);

  EXPECT_FALSE(rig.engine().Discard(e1.entry));
  rig.ExpectEntry(e1.entry, EntryState::kGone);
  rig.ExpectGroup(g1, GroupState::kGone);
  EXPECT_FALSE(rig.engine().Discard(e2.entry));
  rig.ExpectEntry(e2.entry, EntryState::kGone);
  EXPECT_FALSE(rig.engine().Discard(e3.entry));
  rig.ExpectEntry(e3.entry, EntryState::kGone);
  rig.ExpectGroup(g2, GroupState::kGone);
  EXPECT_FALSE(rig.client().Released(e2.token));  // the caller's own: Discard said so
  EXPECT_EQ(rig.held(), 0u);
}

// The caller drops an entry before its copy started; a zero-byte entry is resident at once.
void PendingDiscardedAndZeroBytes(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/1, /*prefetch_depth=*/1));
  const GroupId g = rig.BeginGroup();
  const Rig::Offered pending = rig.Offer(g, kB);
  rig.ExpectEntry(pending.entry, EntryState::kPending);
  EXPECT_EQ(rig.held(), kB);
  EXPECT_FALSE(rig.engine().Discard(pending.entry));
  rig.ExpectEntry(pending.entry, EntryState::kGone);
  EXPECT_EQ(rig.held(), 0u);
  const Rig::Offered empty = rig.Offer(g, 0);
  EXPECT_FALSE(empty.will_offload);
  rig.ExpectEntry(empty.entry, EntryState::kResident);
  EXPECT_EQ(rig.held(), 0u);
  EXPECT_FALSE(rig.client().Released(pending.token));
}

// keep_last 0: each entry copies as it is offered. Backward comes before the copy ended: the
// entry is reclaimed, then discarded while the copy still reads it.
void ReclaimedDiscardedMidCopy(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/0, /*prefetch_depth=*/1));
  const GroupId g = rig.BeginGroup();
  rig.ExpectGroup(g, GroupState::kCopyStarted);
  const Rig::Offered e = rig.Offer(g, kB);
  EXPECT_TRUE(e.will_offload);
  rig.ExpectEntry(e.entry, EntryState::kOffloading, {EntryState::kPending});
  rig.ExpectGroup(g, GroupState::kCopying);
  EXPECT_EQ(rig.held(), kB);

  EXPECT_TRUE(rig.Acquire(e.entry));
  rig.ExpectEntry(e.entry, EntryState::kReclaimed);
  EXPECT_EQ(rig.stats().reclaimed_tensors, 1);
  EXPECT_EQ(rig.held(), 0u);
  EXPECT_TRUE(rig.engine().Discard(e.entry));  // the copy still reads the source
  rig.ExpectEntry(e.entry, EntryState::kDiscardedReclaimed);
  EXPECT_EQ(rig.held(), kB);
  EXPECT_FALSE(rig.client().Released(e.token));

  rig.LetCopiesFinish();
  rig.ExpectEntry(e.entry, EntryState::kGone);
  EXPECT_TRUE(rig.client().Released(e.token));
  EXPECT_EQ(rig.held(), 0u);
}

// As above, but the handle dies after the copy ended: the source is the caller's at once.
void ReclaimedDiscardedAfterCopy(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/0, /*prefetch_depth=*/1));
  const GroupId g = rig.BeginGroup();
  const Rig::Offered e = rig.Offer(g, kB);
  rig.ExpectEntry(e.entry, EntryState::kOffloading, {EntryState::kPending});
  EXPECT_TRUE(rig.Acquire(e.entry));
  rig.ExpectEntry(e.entry, EntryState::kReclaimed);
  rig.LetCopiesFinish();
  rig.ExpectEntry(e.entry, EntryState::kReclaimed);
  EXPECT_FALSE(rig.engine().Discard(e.entry));
  rig.ExpectEntry(e.entry, EntryState::kGone);
  EXPECT_FALSE(rig.client().Released(e.token));
  EXPECT_EQ(rig.held(), 0u);
}

// Discarded while its copy runs: the engine holds the source until the copy ends.
void DiscardedWhileCopying(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/0, /*prefetch_depth=*/1));
  const GroupId g = rig.BeginGroup();
  const Rig::Offered e = rig.Offer(g, kB);
  rig.ExpectEntry(e.entry, EntryState::kOffloading, {EntryState::kPending});
  EXPECT_TRUE(rig.engine().Discard(e.entry));
  rig.ExpectEntry(e.entry, EntryState::kDiscardedCopying);
  EXPECT_EQ(rig.held(), kB);
  EXPECT_EQ(rig.engine().Acquire(e.entry, rig.compute()).status().code(),
            absl::StatusCode::kNotFound);
  rig.LetCopiesFinish();
  rig.ExpectEntry(e.entry, EntryState::kGone);
  rig.ExpectGroup(g, GroupState::kCopyStarted, {GroupState::kCopyStarted, GroupState::kCopying});
  EXPECT_TRUE(rig.client().Released(e.token));
  EXPECT_EQ(rig.held(), 0u);
}

// Offloaded entries discarded before and after their restore was issued.
void OffloadedAndRestoringDiscarded(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/0, /*prefetch_depth=*/0));
  const GroupId g1 = rig.BeginGroup();
  const Rig::Offered e1 = rig.Offer(g1, kB);
  const GroupId g2 = rig.BeginGroup();
  const Rig::Offered e2 = rig.Offer(g2, kB);
  rig.LetCopiesFinish();
  rig.ExpectEntry(e1.entry, EntryState::kOffloaded,
                  {EntryState::kPending, EntryState::kOffloading});
  rig.ExpectEntry(e2.entry, EntryState::kOffloaded,
                  {EntryState::kPending, EntryState::kOffloading});
  EXPECT_EQ(rig.held(), 0u);

  EXPECT_FALSE(rig.engine().Discard(e1.entry));
  rig.ExpectEntry(e1.entry, EntryState::kGone);

  ASSERT_TRUE(rig.engine().PrefetchGroup(g2, rig.compute()).ok());
  rig.ExpectEntry(e2.entry, EntryState::kRestoring);
  EXPECT_EQ(rig.held(), kB);
  EXPECT_FALSE(rig.engine().Discard(e2.entry));
  rig.ExpectEntry(e2.entry, EntryState::kGone);
  EXPECT_EQ(rig.held(), kB);  // the restore buffer counts until it is dropped
  rig.LetCopiesFinish();
  EXPECT_EQ(rig.client().dropped_restores(), 1);
  EXPECT_EQ(rig.held(), 0u);
}

// The arena refuses a block (cap of one byte): the entry stays on the device.
void ArenaRefusal(Seen* seen) {
  EngineOptions options = Options(/*keep_last=*/0, /*prefetch_depth=*/1);
  options.arena.byte_cap = 1;
  Rig rig(seen, options);
  const GroupId g = rig.BeginGroup();
  const Rig::Offered e = rig.Offer(g, kB);
  EXPECT_FALSE(e.will_offload);
  rig.ExpectEntry(e.entry, EntryState::kResident, {EntryState::kPending});
  EXPECT_EQ(rig.stats().cap_fallbacks, 1);
  EXPECT_EQ(rig.held(), 0u);
  rig.ExpectGroup(g, GroupState::kCopyStarted);
}

// Groups that copy as offered from the start, and a window left early.
void EagerAndEarlyStartedGroups(Seen* seen) {
  Rig rig(seen, Options(/*keep_last=*/2, /*prefetch_depth=*/1));
  auto eager = rig.engine().BeginEagerGroup();
  ASSERT_TRUE(eager.ok());
  rig.ExpectGroup(*eager, GroupState::kCopyStarted);
  const GroupId g = rig.BeginGroup();
  rig.ExpectGroup(g, GroupState::kInWindow);
  ASSERT_TRUE(rig.engine().OffloadPendingGroups(rig.compute()).ok());
  rig.ExpectGroup(g, GroupState::kCopyStarted);  // no entries: nothing in flight
  const Rig::Offered e = rig.Offer(g, kB);
  rig.ExpectEntry(e.entry, EntryState::kOffloading, {EntryState::kPending});
  rig.ExpectGroup(g, GroupState::kCopying);
  const Rig::Offered head = rig.Offer(*eager, kB);
  rig.ExpectEntry(head.entry, EntryState::kOffloading, {EntryState::kPending});
  EXPECT_EQ(rig.stats().eager_offloaded_tensors, 1);
}

using Scenario = void (*)(Seen*);
const std::vector<std::pair<std::string, Scenario>>& Scenarios() {
  static const auto* scenarios = new std::vector<std::pair<std::string, Scenario>>{
      {"WindowCopyRestoreHandOutDiscard", WindowCopyRestoreHandOutDiscard},
      {"PendingDiscardedAndZeroBytes", PendingDiscardedAndZeroBytes},
      {"ReclaimedDiscardedMidCopy", ReclaimedDiscardedMidCopy},
      {"ReclaimedDiscardedAfterCopy", ReclaimedDiscardedAfterCopy},
      {"DiscardedWhileCopying", DiscardedWhileCopying},
      {"OffloadedAndRestoringDiscarded", OffloadedAndRestoringDiscarded},
      {"ArenaRefusal", ArenaRefusal},
      {"EagerAndEarlyStartedGroups", EagerAndEarlyStartedGroups},
  };
  return *scenarios;
}

class EngineTransitionsTest : public ::testing::TestWithParam<size_t> {};

TEST_P(EngineTransitionsTest, Scenario) {
  Seen seen;
  Scenarios()[GetParam()].second(&seen);
}

INSTANTIATE_TEST_SUITE_P(All, EngineTransitionsTest,
                         ::testing::Range<size_t>(0, Scenarios().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return Scenarios()[info.param].first;
                         });

template <typename State>
std::set<std::pair<State, State>> LegalTransitions() {
  std::set<std::pair<State, State>> legal;
  for (int from = 0; from <= static_cast<int>(State::kGone); ++from) {
    for (int to = 0; to <= static_cast<int>(State::kGone); ++to) {
      if (engine_internal::IsLegalTransition(static_cast<State>(from), static_cast<State>(to))) {
        legal.insert({static_cast<State>(from), static_cast<State>(to)});
      }
    }
  }
  return legal;
}

template <typename State>
std::string Missing(const std::set<std::pair<State, State>>& legal,
                    const std::set<std::pair<State, State>>& seen) {
  std::string missing;
  for (const auto& [from, to] : legal) {
    if (seen.count({from, to}) == 0) {
      absl::StrAppend(&missing, " ", engine_internal::StateName(from), "->",
                      engine_internal::StateName(to));
    }
  }
  return missing;
}

TEST(EngineTransitions, EveryLegalTransitionIsDriven) {
  Seen seen;
  for (const auto& [name, scenario] : Scenarios()) {
    SCOPED_TRACE(name);
    scenario(&seen);
  }
  EXPECT_EQ(Missing(LegalTransitions<EntryState>(), seen.entries), "");
  EXPECT_EQ(Missing(LegalTransitions<GroupState>(), seen.groups), "");
}

// The table engine.h documents, pair by pair.
TEST(EngineTransitions, TableIsTheDocumentedOne) {
  using E = EntryState;
  const std::set<std::pair<E, E>> entries = {
      {E::kNew, E::kPending},
      {E::kNew, E::kResident},
      {E::kPending, E::kOffloading},
      {E::kPending, E::kResident},
      {E::kPending, E::kGone},
      {E::kOffloading, E::kOffloaded},
      {E::kOffloading, E::kReclaimed},
      {E::kOffloading, E::kDiscardedCopying},
      {E::kDiscardedCopying, E::kGone},
      {E::kOffloaded, E::kRestoring},
      {E::kHandedOut, E::kRestoring},
      {E::kRestoring, E::kHandedOut},
      {E::kOffloaded, E::kGone},
      {E::kHandedOut, E::kGone},
      {E::kRestoring, E::kGone},
      {E::kResident, E::kGone},
      {E::kReclaimed, E::kGone},
      {E::kReclaimed, E::kDiscardedReclaimed},
      {E::kDiscardedReclaimed, E::kGone},
  };
  EXPECT_EQ(LegalTransitions<EntryState>(), entries);
  using G = GroupState;
  const std::set<std::pair<G, G>> groups = {
      {G::kNew, G::kInWindow},     {G::kNew, G::kCopyStarted},     {G::kInWindow, G::kCopyStarted},
      {G::kInWindow, G::kKept},    {G::kCopyStarted, G::kCopying}, {G::kCopying, G::kCopyStarted},
      {G::kCopyStarted, G::kGone}, {G::kKept, G::kGone},
  };
  EXPECT_EQ(LegalTransitions<GroupState>(), groups);
}

TEST(EngineTransitionsDeathTest, IllegalTransitionAbortsInDebugBuilds) {
#ifdef NDEBUG
  GTEST_SKIP() << "the check compiles to nothing with NDEBUG";
#else
  EXPECT_DEATH(engine_internal::CheckTransition(EntryState::kPending, EntryState::kRestoring),
               "illegal entry transition kPending -> kRestoring");
  EXPECT_DEATH(engine_internal::CheckTransition(EntryState::kGone, EntryState::kPending),
               "illegal entry transition kGone -> kPending");
  EXPECT_DEATH(engine_internal::CheckTransition(GroupState::kKept, GroupState::kCopying),
               "illegal group transition kKept -> kCopying");
#endif
}

}  // namespace
}  // namespace ckpt_offload
