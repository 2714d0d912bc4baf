// Internal to OffloadEngine and its tests: the one state of an entry and of a group, the
// legal changes between them (the table in engine.h), and a peer that reads states for
// tests. Not part of the engine's API.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_STATES_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_STATES_H_

#include <cstdint>
#include <optional>

#include "offload_core/engine.h"

namespace ckpt_offload {
namespace engine_internal {

enum class EntryState : uint8_t {
  kNew,                 // being registered by OfferEntry
  kPending,             // its group's D2H has not started; source held
  kOffloading,          // D2H issued, not yet known complete; source held
  kOffloaded,           // D2H complete, source released; the host block holds the data
  kRestoring,           // H2D issued into a restore buffer not yet acquired
  kHandedOut,           // restore acquired; the host block stays for a retained graph
  kResident,            // stays on the device for good (caller's source)
  kReclaimed,           // resident because backward came before its D2H completed
  kDiscardedCopying,    // discarded while its D2H still ran: finished by Poll
  kDiscardedReclaimed,  // discarded reclaimed entry whose D2H still reads the source
  kGone,                // erased
};

enum class GroupState : uint8_t {
  kNew,          // being registered by BeginGroup / BeginEagerGroup
  kInWindow,     // in the keep_last window: its copies have not started
  kKept,         // forward ended while in the window: its entries stay resident
  kCopyStarted,  // copies started (later entries copy as offered); none known in flight
  kCopying,      // D2H copies not yet known complete (counted against the in-flight bound)
  kGone,         // erased
};

const char* StateName(EntryState state);
const char* StateName(GroupState state);

// The transition table of engine.h (Reset drops entries and groups in bulk, outside it).
constexpr bool IsLegalTransition(EntryState from, EntryState to) {
  using S = EntryState;
  switch (from) {
    case S::kNew:
      return to == S::kPending || to == S::kResident;
    case S::kPending:
      return to == S::kOffloading || to == S::kResident || to == S::kGone;
    case S::kOffloading:
      return to == S::kOffloaded || to == S::kReclaimed || to == S::kDiscardedCopying;
    case S::kOffloaded:
    case S::kHandedOut:
      return to == S::kRestoring || to == S::kGone;
    case S::kRestoring:
      return to == S::kHandedOut || to == S::kGone;
    case S::kResident:
      return to == S::kGone;
    case S::kReclaimed:
      return to == S::kDiscardedReclaimed || to == S::kGone;
    case S::kDiscardedCopying:
    case S::kDiscardedReclaimed:
      return to == S::kGone;
    case S::kGone:
      return false;
  }
  return false;
}

constexpr bool IsLegalTransition(GroupState from, GroupState to) {
  using S = GroupState;
  switch (from) {
    case S::kNew:
      return to == S::kInWindow || to == S::kCopyStarted;
    case S::kInWindow:
      return to == S::kCopyStarted || to == S::kKept;
    case S::kCopyStarted:
      return to == S::kCopying || to == S::kGone;
    case S::kCopying:
      return to == S::kCopyStarted;
    case S::kKept:
      return to == S::kGone;
    case S::kGone:
      return false;
  }
  return false;
}

inline const char* KindName(EntryState) { return "entry"; }
inline const char* KindName(GroupState) { return "group"; }

// Aborts, naming both states, when `from` -> `to` is not in the table. Debug builds only:
// with NDEBUG it compiles to nothing.
[[noreturn]] void FailTransition(const char* kind, const char* from, const char* to);
template <typename State>
inline void CheckTransition(State from, State to) {
#ifndef NDEBUG
  if (!IsLegalTransition(from, to)) FailTransition(KindName(from), StateName(from), StateName(to));
#else
  (void)from;
  (void)to;
#endif
}

// Device bytes the engine counts for an entry in `state` (EngineStats::device_held_bytes):
// a source it still needs, or a restore buffer not yet handed out.
constexpr bool HoldsDeviceBytes(EntryState state) {
  return state == EntryState::kPending || state == EntryState::kOffloading ||
         state == EntryState::kDiscardedCopying || state == EntryState::kRestoring ||
         state == EntryState::kDiscardedReclaimed;
}
// The caller's source is still the engine's to hand back (ReleaseSource on Reset).
constexpr bool HoldsSource(EntryState state) {
  return state == EntryState::kPending || state == EntryState::kOffloading ||
         state == EntryState::kDiscardedCopying || state == EntryState::kResident ||
         state == EntryState::kReclaimed || state == EntryState::kDiscardedReclaimed;
}
constexpr bool IsDiscarded(EntryState state) {
  return state == EntryState::kDiscardedCopying || state == EntryState::kDiscardedReclaimed;
}

// Tests read states through this; nullopt: no such entry or group (erased or never made).
struct EngineTestPeer {
  static std::optional<EntryState> StateOf(const OffloadEngine& engine, EntryId entry);
  static std::optional<GroupState> GroupStateOf(const OffloadEngine& engine, GroupId group);
};

}  // namespace engine_internal
}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_STATES_H_
