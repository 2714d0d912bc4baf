// OffloadEngine: see engine.h for the schedule and its invariants.
//
// Implementation notes
// - One mutex guards all state; forward (pack) and backward (unpack) run on different
//   threads in PyTorch, but each call is short (bookkeeping plus async copy launches).
// - Events are shared (refcounted) because a deferred host-block free or an exposed-wait
//   measurement may outlive the group that recorded the event, and pooled because the
//   per-tensor paths would otherwise create and destroy several per call. A query that
//   saw an event complete is remembered until the event is recorded again.
// - Poll() settles work whose events completed: releases sources of finished D2H copies,
//   frees guarded host blocks and restore buffers, accumulates exposed-wait figures. It
//   runs at the start of every public call, so nothing waits for a dedicated thread.
#include "offload_core/engine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "offload_core/engine_states.h"
#include "offload_core/status_macros.h"

namespace ckpt_offload {
namespace engine_internal {

const char* StateName(EntryState state) {
  switch (state) {
    case EntryState::kNew:
      return "kNew";
    case EntryState::kPending:
      return "kPending";
    case EntryState::kOffloading:
      return "kOffloading";
    case EntryState::kOffloaded:
      return "kOffloaded";
    case EntryState::kRestoring:
      return "kRestoring";
    case EntryState::kHandedOut:
      return "kHandedOut";
    case EntryState::kResident:
      return "kResident";
    case EntryState::kReclaimed:
      return "kReclaimed";
    case EntryState::kDiscardedCopying:
      return "kDiscardedCopying";
    case EntryState::kDiscardedReclaimed:
      return "kDiscardedReclaimed";
    case EntryState::kGone:
      return "kGone";
  }
  return "?";
}

const char* StateName(GroupState state) {
  switch (state) {
    case GroupState::kNew:
      return "kNew";
    case GroupState::kInWindow:
      return "kInWindow";
    case GroupState::kKept:
      return "kKept";
    case GroupState::kCopyStarted:
      return "kCopyStarted";
    case GroupState::kCopying:
      return "kCopying";
    case GroupState::kGone:
      return "kGone";
  }
  return "?";
}

void FailTransition(const char* kind, const char* from, const char* to) {
  std::fprintf(stderr, "OffloadEngine: illegal %s transition %s -> %s\n", kind, from, to);
  std::abort();
}

}  // namespace engine_internal

namespace {

using engine_internal::EntryState;
using engine_internal::GroupState;

// The engine's lock: a std::mutex carrying the thread-safety annotations absl::Mutex has.
// absl::Mutex itself would hide the engine's ordering from TSan: the system abseil is not
// built with it, so every guarded access would read as a race.
class ABSL_LOCKABLE EngineMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE EngineLock {
 public:
  explicit EngineLock(EngineMutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~EngineLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  EngineLock(const EngineLock&) = delete;
  EngineLock& operator=(const EngineLock&) = delete;

 private:
  EngineMutex* mu_;
};

// Device events are recycled: creating and destroying one per use would double the device
// calls on the per-tensor paths (and cudaEventCreate/cudaEventDestroy are not free).
// Re-recording a recycled event is safe: a wait binds to the record current when it was
// queued, and nobody queries an event that went back to the pool.
class EventPool {
 public:
  explicit EventPool(Device* device) : device_(device) {}
  ~EventPool() {
    for (EventHandle event : free_) device_->DestroyEvent(event);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  absl::StatusOr<EventHandle> Take() {
    if (free_.empty()) return device_->CreateEvent();
    EventHandle event = free_.back();
    free_.pop_back();
    return event;
  }
  void Return(EventHandle event) { free_.push_back(event); }

 private:
  Device* device_;
  std::vector<EventHandle> free_;
};

// A pooled event shared by the places that must wait on it; it returns to the pool with
// its last user. Only touched with the engine's lock held.
class SharedEvent {
 public:
  SharedEvent(EventPool* pool, EventHandle handle) : pool_(pool), handle_(handle) {}
  ~SharedEvent() { pool_->Return(handle_); }
  SharedEvent(const SharedEvent&) = delete;
  SharedEvent& operator=(const SharedEvent&) = delete;
  EventHandle handle() const { return handle_; }

  // A query saw the current record complete (cleared by every record): later checks need
  // no device call. Poll asks about the same few events on every engine call.
  bool known_done = false;

 private:
  EventPool* pool_;
  EventHandle handle_;
};
using EventPtr = std::shared_ptr<SharedEvent>;

struct Entry {
  GroupId group = 0;
  const void* source = nullptr;
  SourceToken source_token = 0;
  size_t bytes = 0;
  EntryState state = EntryState::kNew;  // changed only by Impl::SetState
  HostBlock host;                       // kOffloading .. kHandedOut
  void* restore = nullptr;              // kRestoring: the buffer its H2D writes
};

struct Group {
  std::vector<EntryId> entries;
  bool eager = false;  // BeginEagerGroup: outside the keep_last window, counted apart
  GroupState state = GroupState::kNew;  // changed only by Impl::SetGroupState
  EventPtr d2h_done;                    // recorded on the D2H stream after this group's copies
  EventPtr h2d_done;  // recorded on the H2D stream after this group's last restore
};

// Work that may only happen once its guarding events completed.
struct DeferredHostFree {
  HostBlock block;
  std::vector<EventPtr> guards;
};
struct DeferredRestoreDrop {
  EntryId entry;
  void* data;
  size_t bytes;
  EventPtr guard;
};
struct PendingWait {
  EventPtr compute_ready;  // compute stream reached the wait
  EventPtr h2d_done;       // the copy it waited for finished
};

}  // namespace

absl::Status ValidateEngineOptions(const EngineOptions& options) {
  if (options.keep_last < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_last must be >= 0 (got ", options.keep_last, ")"));
  }
  if (options.prefetch_depth < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefetch_depth must be >= 0 (got ", options.prefetch_depth, ")"));
  }
  if (options.max_inflight_d2h_groups < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_inflight_d2h_groups must be >= 1 (got ",
                                                   options.max_inflight_d2h_groups, ")"));
  }
  return absl::OkStatus();
}

struct OffloadEngine::Impl {
  Impl(Device* device, Client* client, EngineOptions options)
      : device(device),
        client(client),
        options(options),
        arena(device->MakeHostBackend(), options.arena),
        event_pool(device),
        prefetch_on_acquire(options.prefetch_on_acquire) {}

  Device* device;
  Client* client;
  EngineOptions options;
  HostArena arena;
  // Declared before every EventPtr holder: it must outlive them.
  EventPool event_pool ABSL_GUARDED_BY(mu);

  // The engine's one lock (engine.h: lock order). `arena` locks itself; `device`, `client`
  // and `options` do not change after construction.
  mutable EngineMutex mu;
  std::unordered_map<EntryId, Entry> entries ABSL_GUARDED_BY(mu);
  std::map<GroupId, Group> groups ABSL_GUARDED_BY(mu);
  // kInWindow groups, oldest first (the order the window lets them go).
  std::deque<GroupId> pending ABSL_GUARDED_BY(mu);
  // kCopying groups in the order their copies were recorded (Poll settles them in order).
  std::deque<GroupId> d2h_inflight ABSL_GUARDED_BY(mu);
  std::vector<DeferredHostFree> deferred_frees ABSL_GUARDED_BY(mu);
  std::vector<DeferredRestoreDrop> deferred_drops ABSL_GUARDED_BY(mu);
  // kDiscardedReclaimed entries and the D2H event that releases each.
  std::vector<std::pair<EntryId, EventPtr>> deferred_releases ABSL_GUARDED_BY(mu);
  std::vector<PendingWait> pending_waits ABSL_GUARDED_BY(mu);
  bool in_backward ABSL_GUARDED_BY(mu) = false;
  bool prefetch_on_acquire ABSL_GUARDED_BY(mu) = true;  // options.prefetch_on_acquire, settable
  GroupId last_acquired ABSL_GUARDED_BY(mu) = 0;        // checkpoint group of the latest Acquire
  GroupId next_group ABSL_GUARDED_BY(mu) = 1;
  EntryId next_entry ABSL_GUARDED_BY(mu) = 1;
  // Ids below this and absent from `entries` died in a Reset.
  EntryId reset_watermark ABSL_GUARDED_BY(mu) = 1;
  EngineStats counters ABSL_GUARDED_BY(mu);
  EventPtr compute_mark ABSL_GUARDED_BY(mu);  // re-recorded by every StreamAfterCompute

  // --- helpers (mu held) ---

  absl::StatusOr<EventPtr> NewEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    CKPT_ASSIGN_OR_RETURN(EventHandle handle, event_pool.Take());
    return std::make_shared<SharedEvent>(&event_pool, handle);
  }

  absl::Status Record(const EventPtr& event, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    event->known_done = false;
    return device->RecordEvent(event->handle(), stream);
  }

  // True when `event` is null or complete.
  absl::StatusOr<bool> Done(const EventPtr& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!event || event->known_done) return true;
    CKPT_ASSIGN_OR_RETURN(bool done, device->EventDone(event->handle()));
    event->known_done = done;
    return done;
  }

  void AddHeld(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    counters.device_held_bytes += bytes;
    counters.peak_device_held_bytes =
        std::max(counters.peak_device_held_bytes, counters.device_held_bytes);
  }
  void SubHeld(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    counters.device_held_bytes -= bytes;
  }

  // The one place an entry's state changes: checks the change against the table (debug
  // builds) and keeps device_held_bytes in step with the states that hold device memory.
  // `to` == kGone erases the entry (and `entry` with it).
  void SetState(EntryId id, Entry& entry, EntryState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    engine_internal::CheckTransition(entry.state, to);
    const bool held_before = engine_internal::HoldsDeviceBytes(entry.state);
    const bool held_after = engine_internal::HoldsDeviceBytes(to);
    if (held_after && !held_before) AddHeld(entry.bytes);
    if (held_before && !held_after) SubHeld(entry.bytes);
    entry.state = to;
    if (to == EntryState::kGone) EraseEntry(id);
  }

  // The one place a group's state changes. `pending` and `d2h_inflight` keep the order of
  // kInWindow and kCopying groups; membership is the state.
  void SetGroupState(Group& group, GroupState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    engine_internal::CheckTransition(group.state, to);
    group.state = to;
  }

  // Hands the source back to the caller: `entry` is leaving a state that holds it.
  void ReleaseSourceOf(EntryId id, const Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    device->OnDeviceSourceReleased(entry.source, entry.bytes);
    client->ReleaseSource(id, entry.source_token);
  }

  // Orders `stream` after the work queued on `compute` so far.
  absl::Status StreamAfterCompute(StreamHandle stream, StreamHandle compute)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    // One event serves every call: the wait binds to the record just made.
    if (!compute_mark) {
      CKPT_ASSIGN_OR_RETURN(compute_mark, NewEvent());
    }
    CKPT_RETURN_IF_ERROR(Record(compute_mark, compute));
    return device->StreamWaitEvent(stream, compute_mark->handle());
  }

  // Issues the D2H copy of one entry (its group's D2H stream ordering is set up by the
  // caller). A refused host block keeps the entry on the device.
  absl::Status IssueD2H(EntryId id, Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::StatusOr<HostBlock> block = arena.Allocate(entry.bytes);
    if (!block.ok()) {
      SetState(id, entry, EntryState::kResident);
      if (groups.at(entry.group).eager) {
        counters.eager_cap_fallbacks++;
      } else {
        counters.cap_fallbacks++;
      }
      return absl::OkStatus();
    }
    absl::Status copied =
        device->CopyToHost(block->data, entry.source, entry.bytes, device->d2h_stream());
    if (!copied.ok()) {
      // Nothing was queued: the block goes straight back and the entry stays on the
      // device, so an engine that is not Reset still hands out intact data.
      FreeHostBlock(*block);
      SetState(id, entry, EntryState::kResident);
      return copied;
    }
    entry.host = *block;
    SetState(id, entry, EntryState::kOffloading);
    if (groups.at(entry.group).eager) {
      counters.eager_offloaded_tensors++;
      counters.eager_offloaded_bytes += entry.bytes;
    } else {
      counters.offloaded_tensors++;
      counters.offloaded_bytes += entry.bytes;
    }
    return absl::OkStatus();
  }

  absl::Status RecordD2HDone(GroupId gid, Group& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!group.d2h_done) {
      CKPT_ASSIGN_OR_RETURN(group.d2h_done, NewEvent());
    }
    CKPT_RETURN_IF_ERROR(Record(group.d2h_done, device->d2h_stream()));
    if (group.state != GroupState::kCopying) {
      SetGroupState(group, GroupState::kCopying);
      d2h_inflight.push_back(gid);
    }
    return absl::OkStatus();
  }

  // Keeps at most max_inflight_d2h_groups groups copying: waits for the oldest.
  absl::Status BoundInflight() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (static_cast<int>(d2h_inflight.size()) >= options.max_inflight_d2h_groups) {
      auto it = groups.find(d2h_inflight.front());
      if (it != groups.end() && it->second.d2h_done) {
        CKPT_RETURN_IF_ERROR(device->SynchronizeEvent(it->second.d2h_done->handle()));
      }
      size_t before = d2h_inflight.size();
      CKPT_RETURN_IF_ERROR(Poll());
      if (d2h_inflight.size() == before) PopInflight();  // nothing to wait on
    }
    return absl::OkStatus();
  }

  absl::Status StartOffload(GroupId gid, StreamHandle compute) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Group& group = groups.at(gid);
    SetGroupState(group, GroupState::kCopyStarted);
    bool any = false;
    for (EntryId id : group.entries) {
      if (entries.at(id).state == EntryState::kPending) any = true;
    }
    if (!any) return absl::OkStatus();  // keep_last == 0: entries arrive after this
    // Only a group that will copy counts against the in-flight bound.
    CKPT_RETURN_IF_ERROR(BoundInflight());
    CKPT_RETURN_IF_ERROR(StreamAfterCompute(device->d2h_stream(), compute));
    absl::Status issued = absl::OkStatus();
    bool any_issued = false;
    for (EntryId id : group.entries) {
      Entry& entry = entries.at(id);
      if (entry.state != EntryState::kPending) continue;
      if (!issued.ok()) {
        // After a failure the rest stay on the device: the group has left `pending`, so
        // nothing else would ever move them out of kPending.
        SetState(id, entry, EntryState::kResident);
        continue;
      }
      issued = IssueD2H(id, entry);
      any_issued = any_issued || entry.state == EntryState::kOffloading;
    }
    // Copies queued before a failure still need their completion event: Poll and Reset
    // find them through it.
    if (any_issued) CKPT_RETURN_IF_ERROR(RecordD2HDone(gid, group));
    return issued;
  }

  // A group begins after backward started: a new forward (next micro-batch or step).
  void LeaveBackward() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!in_backward) return;
    in_backward = false;
    last_acquired = 0;
    KeepWindowResident();
    EraseEmptyGroups();
  }

  // Starts the copies of the oldest pending groups until at most `keep` are left.
  absl::Status OffloadPendingBeyond(size_t keep, StreamHandle compute)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (pending.size() > keep) {
      GroupId oldest = pending.front();
      pending.pop_front();
      CKPT_RETURN_IF_ERROR(StartOffload(oldest, compute));
    }
    return absl::OkStatus();
  }

  // The window's groups leave it without copying: the forward ended.
  void KeepWindowResident() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (GroupId gid : pending) SetGroupState(groups.at(gid), GroupState::kKept);
    pending.clear();
  }

  // The oldest kCopying group is no longer counted in flight.
  void PopInflight() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = groups.find(d2h_inflight.front());
    if (it != groups.end()) SetGroupState(it->second, GroupState::kCopyStarted);
    d2h_inflight.pop_front();
  }

  // An entry of `group` is offloaded and has never been restored.
  bool WaitsForRestore(const Group& group) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (EntryId id : group.entries) {
      const EntryState state = entries.at(id).state;
      if (state == EntryState::kOffloading || state == EntryState::kOffloaded) return true;
    }
    return false;
  }

  // Forward ended: the current forward's pending groups stay on the device.
  void EnterBackward() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (in_backward) return;
    in_backward = true;
    for (GroupId gid : pending) {
      for (EntryId id : groups.at(gid).entries) {
        Entry& entry = entries.at(id);
        if (entry.state != EntryState::kPending) continue;
        SetState(id, entry, EntryState::kResident);
        counters.kept_resident_tensors++;
      }
    }
    KeepWindowResident();
  }

  // A group whose completion record failed (RecordD2HDone returned an error after its copies
  // were queued) has copies that no tracked event covers: its d2h_done reports done at once.
  // A record on the D2H stream now covers them (the stream runs in order). Reclaim's deferred
  // free and release, and a restore's wait, need an event that really waits for them.
  absl::Status TrackUntrackedD2H(GroupId gid, Group& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    bool copying = false;
    for (EntryId id : group.entries) {
      copying = copying || entries.at(id).state == EntryState::kOffloading;
    }
    if (!copying) return absl::OkStatus();
    if (group.state == GroupState::kCopying) return absl::OkStatus();
    return RecordD2HDone(gid, group);
  }

  // Entries of `group` whose D2H has not completed still have their device source: backward
  // needs them now, so they stay on the device (no H2D, no second device buffer) and the
  // host copy is dropped once the D2H finished writing it.
  void ReclaimHeldSources(Group& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (EntryId id : group.entries) {
      Entry& entry = entries.at(id);
      if (entry.state != EntryState::kOffloading) continue;
      SetState(id, entry, EntryState::kReclaimed);
      if (!group.eager) counters.reclaimed_tensors++;
      if (entry.host) {
        deferred_frees.push_back({entry.host, {group.d2h_done}});
        entry.host = HostBlock{};
      }
    }
  }

  // prefetch_depth 0 asks for memory first: wait for the forward's last copies so their
  // sources leave the device before backward allocates.
  absl::Status DrainForwardCopies() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (GroupId gid : d2h_inflight) {
      auto it = groups.find(gid);
      if (it != groups.end() && it->second.d2h_done) {
        CKPT_RETURN_IF_ERROR(device->SynchronizeEvent(it->second.d2h_done->handle()));
      }
    }
    return Poll();
  }

  // Issues H2D for the entries of `gid` that need it, or for `only` (a retained graph's
  // second restore of one entry).
  absl::Status IssueRestore(GroupId gid, StreamHandle compute, bool prefetch, EntryId only = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Group& group = groups.at(gid);
    CKPT_RETURN_IF_ERROR(TrackUntrackedD2H(gid, group));
    ReclaimHeldSources(group);  // no entry of `group` is kOffloading after this
    std::vector<EntryId> todo;
    for (EntryId id : group.entries) {
      const EntryState state = entries.at(id).state;
      if (only != 0 && id != only) continue;
      // A retained graph asks again per entry (kHandedOut), never for the whole group.
      if (state == EntryState::kOffloaded || (only != 0 && state == EntryState::kHandedOut)) {
        todo.push_back(id);
      }
    }
    if (todo.empty()) return absl::OkStatus();
    const StreamHandle h2d = device->h2d_stream();
    // The restore buffers may be memory the compute stream used just before.
    CKPT_RETURN_IF_ERROR(StreamAfterCompute(h2d, compute));
    CKPT_ASSIGN_OR_RETURN(bool d2h_finished, Done(group.d2h_done));
    if (!d2h_finished) {
      CKPT_RETURN_IF_ERROR(device->StreamWaitEvent(h2d, group.d2h_done->handle()));
    }
    absl::Status issued = absl::OkStatus();
    bool any_issued = false;
    for (EntryId id : todo) {
      Entry& entry = entries.at(id);
      absl::StatusOr<void*> buffer = client->AllocateRestore(id, entry.bytes);
      if (!buffer.ok()) {
        issued = buffer.status();
        break;
      }
      issued = device->CopyToDevice(*buffer, entry.host.data, entry.bytes, h2d);
      if (!issued.ok()) {
        // Nothing was queued into it: hand it back now rather than as a restore.
        client->DropRestore(id, *buffer);
        break;
      }
      entry.restore = *buffer;
      SetState(id, entry, EntryState::kRestoring);
      any_issued = true;
      if (group.eager) {
        counters.eager_restored_tensors++;
        counters.eager_restored_bytes += entry.bytes;
      } else {
        counters.restored_tensors++;
        counters.restored_bytes += entry.bytes;
        if (prefetch) counters.prefetched_tensors++;
      }
    }
    // The copies queued before a failure need the event too: Acquire and Reset wait on it.
    if (any_issued) {
      CKPT_ASSIGN_OR_RETURN(EventPtr done, NewEvent());
      CKPT_RETURN_IF_ERROR(Record(done, h2d));
      group.h2d_done = std::move(done);
    }
    return issued;
  }

  // Makes sure the next prefetch_depth offloaded groups below `gid` are being restored.
  absl::Status Prefetch(GroupId gid, StreamHandle compute) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    int counted = 0;
    for (auto it = std::make_reverse_iterator(groups.lower_bound(gid));
         it != groups.rend() && counted < options.prefetch_depth; ++it) {
      const bool waiting = WaitsForRestore(it->second);
      bool issued = false;  // already prefetched, not yet acquired
      for (EntryId id : it->second.entries) {
        if (entries.at(id).state == EntryState::kRestoring) issued = true;
      }
      if (!waiting && !issued) continue;
      counted++;
      if (waiting) CKPT_RETURN_IF_ERROR(IssueRestore(it->first, compute, /*prefetch=*/true));
    }
    return absl::OkStatus();
  }

  // Groups that never got an entry are otherwise never erased (only EraseEntry and Poll
  // look at a group again); without this sweep every step would leave them behind and
  // Prefetch's scan below each acquired group would keep growing.
  void EraseEmptyGroups() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = groups.begin(); it != groups.end();) {
      if (it->second.entries.empty() && MayErase(it->second)) {
        SetGroupState(it->second, GroupState::kGone);
        it = groups.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Neither in the keep_last window nor counted in flight.
  static bool MayErase(const Group& group) {
    return group.state == GroupState::kKept || group.state == GroupState::kCopyStarted;
  }

  void MaybeEraseGroup(GroupId gid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = groups.find(gid);
    if (it == groups.end() || !it->second.entries.empty()) return;
    if (!MayErase(it->second)) return;
    // The forward's newest group may still be receiving entries (keep_last 0 offloads each
    // entry as it is offered; a refused one is discarded at once).
    if (!in_backward && gid == next_group - 1) return;
    SetGroupState(it->second, GroupState::kGone);
    groups.erase(it);
  }

  void EraseEntry(EntryId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = entries.find(id);
    if (it == entries.end()) return;
    GroupId gid = it->second.group;
    entries.erase(it);
    auto git = groups.find(gid);
    if (git != groups.end()) {
      auto& list = git->second.entries;
      list.erase(std::remove(list.begin(), list.end(), id), list.end());
    }
    MaybeEraseGroup(gid);
  }

  void FreeHostBlock(const HostBlock& block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    device->OnHostBlockFreed(block.data, block.bytes);
    arena.Free(block);
  }

  // Settles everything whose events completed. Errors come from event queries.
  absl::Status Poll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!d2h_inflight.empty()) {
      GroupId gid = d2h_inflight.front();
      auto git = groups.find(gid);
      if (git != groups.end()) {
        CKPT_ASSIGN_OR_RETURN(bool done, Done(git->second.d2h_done));
        if (!done) break;
        std::vector<EntryId> finished = git->second.entries;
        for (EntryId id : finished) {
          Entry& entry = entries.at(id);
          if (entry.state == EntryState::kOffloading) {
            SetState(id, entry, EntryState::kOffloaded);
            ReleaseSourceOf(id, entry);
          } else if (entry.state == EntryState::kDiscardedCopying) {
            ReleaseSourceOf(id, entry);
            deferred_frees.push_back({entry.host, {git->second.h2d_done}});
            SetState(id, entry, EntryState::kGone);
          }
        }
      }
      PopInflight();
      MaybeEraseGroup(gid);
    }
    for (size_t i = 0; i < deferred_frees.size();) {
      bool ready = true;
      for (const EventPtr& guard : deferred_frees[i].guards) {
        CKPT_ASSIGN_OR_RETURN(bool done, Done(guard));
        ready = ready && done;
      }
      if (!ready) {
        ++i;
        continue;
      }
      FreeHostBlock(deferred_frees[i].block);
      deferred_frees[i] = std::move(deferred_frees.back());
      deferred_frees.pop_back();
    }
    for (size_t i = 0; i < deferred_releases.size();) {
      CKPT_ASSIGN_OR_RETURN(bool done, Done(deferred_releases[i].second));
      if (!done) {
        ++i;
        continue;
      }
      const EntryId id = deferred_releases[i].first;
      Entry& entry = entries.at(id);
      ReleaseSourceOf(id, entry);
      SetState(id, entry, EntryState::kGone);
      deferred_releases[i] = std::move(deferred_releases.back());
      deferred_releases.pop_back();
    }
    for (size_t i = 0; i < deferred_drops.size();) {
      CKPT_ASSIGN_OR_RETURN(bool done, Done(deferred_drops[i].guard));
      if (!done) {
        ++i;
        continue;
      }
      DropRestore(deferred_drops[i]);
      deferred_drops[i] = std::move(deferred_drops.back());
      deferred_drops.pop_back();
    }
    for (size_t i = 0; i < pending_waits.size();) {
      CKPT_ASSIGN_OR_RETURN(bool ready_done, Done(pending_waits[i].compute_ready));
      CKPT_ASSIGN_OR_RETURN(bool copy_done, Done(pending_waits[i].h2d_done));
      if (!ready_done || !copy_done) {
        ++i;
        continue;
      }
      CKPT_ASSIGN_OR_RETURN(double ms, device->ElapsedMs(pending_waits[i].compute_ready->handle(),
                                                         pending_waits[i].h2d_done->handle()));
      if (ms > 0) counters.exposed_wait_ms += ms;
      pending_waits[i] = std::move(pending_waits.back());
      pending_waits.pop_back();
    }
    return absl::OkStatus();
  }

  void DropRestore(const DeferredRestoreDrop& drop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    SubHeld(drop.bytes);
    client->DropRestore(drop.entry, drop.data);
  }

  absl::Status SynchronizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Status first = absl::OkStatus();
    auto wait = [&](const EventPtr& event) {
      if (!event || event->known_done) return;
      absl::Status status = device->SynchronizeEvent(event->handle());
      if (status.ok()) event->known_done = true;
      if (first.ok() && !status.ok()) first = status;
    };
    for (auto& [gid, group] : groups) {
      wait(group.d2h_done);
      wait(group.h2d_done);
    }
    for (const auto& free : deferred_frees) {
      for (const EventPtr& guard : free.guards) wait(guard);
    }
    for (const auto& drop : deferred_drops) wait(drop.guard);
    for (const auto& pending_wait : pending_waits) {
      wait(pending_wait.compute_ready);
      wait(pending_wait.h2d_done);
    }
    // Draining both copy streams also covers copies that no group event tracks (a call
    // failed between queueing a copy and recording its event).
    for (StreamHandle stream : {device->d2h_stream(), device->h2d_stream()}) {
      absl::StatusOr<EventPtr> drained = NewEvent();
      if (!drained.ok()) {
        if (first.ok()) first = drained.status();
        continue;
      }
      absl::Status recorded = Record(*drained, stream);
      if (!recorded.ok()) {
        if (first.ok()) first = recorded;
        continue;
      }
      wait(*drained);
    }
    absl::Status polled = Poll();
    if (first.ok() && !polled.ok()) first = polled;
    return first;
  }
};

OffloadEngine::OffloadEngine() = default;

absl::StatusOr<std::unique_ptr<OffloadEngine>> OffloadEngine::Create(Device* device, Client* client,
                                                                     EngineOptions options) {
  if (device == nullptr) return absl::InvalidArgumentError("device must not be null");
  if (client == nullptr) return absl::InvalidArgumentError("client must not be null");
  CKPT_RETURN_IF_ERROR(ValidateEngineOptions(options));
  std::unique_ptr<OffloadEngine> engine(new OffloadEngine());
  engine->impl_ = std::make_unique<Impl>(device, client, options);
  return engine;
}

OffloadEngine::~OffloadEngine() {
  if (impl_) Reset().IgnoreError();
}

absl::StatusOr<GroupId> OffloadEngine::BeginGroup(StreamHandle compute) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  s.LeaveBackward();
  // The groups that fall out of the keep_last window once this one joins it start their
  // copies first, so a failure leaves no group the caller never heard of.
  const int keep = std::max(s.options.keep_last - 1, 0);
  CKPT_RETURN_IF_ERROR(s.OffloadPendingBeyond(static_cast<size_t>(keep), compute));
  GroupId gid = s.next_group++;
  Group& group = s.groups[gid];
  s.counters.groups++;
  if (s.options.keep_last == 0) {
    s.SetGroupState(group, GroupState::kCopyStarted);  // each entry copies as it is offered
  } else {
    s.SetGroupState(group, GroupState::kInWindow);
    s.pending.push_back(gid);
  }
  return gid;
}

absl::StatusOr<GroupId> OffloadEngine::BeginEagerGroup() {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  s.LeaveBackward();
  GroupId gid = s.next_group++;
  Group& group = s.groups[gid];
  group.eager = true;
  s.SetGroupState(group, GroupState::kCopyStarted);  // each entry copies as it is offered
  return gid;
}

absl::Status OffloadEngine::PrefetchGroup(GroupId gid, StreamHandle compute) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  auto it = s.groups.find(gid);
  if (it == s.groups.end()) return absl::OkStatus();
  if (s.WaitsForRestore(it->second)) {
    CKPT_RETURN_IF_ERROR(s.IssueRestore(gid, compute, /*prefetch=*/true));
  }
  return s.Prefetch(gid, compute);
}

absl::Status OffloadEngine::PrefetchBelowAcquired(StreamHandle compute) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  if (!s.in_backward) return absl::OkStatus();
  // Nothing acquired yet: every group lies below the point backward has reached.
  return s.Prefetch(s.last_acquired != 0 ? s.last_acquired : s.next_group, compute);
}

void OffloadEngine::SetPrefetchOnAcquire(bool on) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  s.prefetch_on_acquire = on;
}

absl::Status OffloadEngine::OffloadPendingGroups(StreamHandle compute) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  if (s.in_backward) return absl::OkStatus();
  return s.OffloadPendingBeyond(0, compute);
}

absl::Status OffloadEngine::EndForward() {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  if (s.in_backward) return absl::OkStatus();
  s.EnterBackward();
  return s.DrainForwardCopies();
}

absl::StatusOr<OffloadEngine::Offer> OffloadEngine::OfferEntry(GroupId gid, const void* device_src,
                                                               size_t bytes, SourceToken source,
                                                               StreamHandle compute) {
  if (device_src == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_src must not be null (bytes = ", bytes, ")"));
  }
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  CKPT_RETURN_IF_ERROR(s.Poll());
  auto git = s.groups.find(gid);
  if (git == s.groups.end()) {
    return absl::NotFoundError(absl::StrCat("unknown group ", gid));
  }
  EntryId id = s.next_entry++;
  Entry& entry = s.entries[id];
  entry.group = gid;
  entry.source = device_src;
  entry.source_token = source;
  entry.bytes = bytes;
  git->second.entries.push_back(id);
  const GroupState group_state = git->second.state;
  if (bytes == 0) {
    // Nothing to move; a host block of zero bytes would only cost an allocation.
    s.SetState(id, entry, EntryState::kResident);
    return Offer{id, false};
  }
  if (group_state == GroupState::kKept) {
    // The group's forward already ended (backward started): nothing to overlap with.
    s.SetState(id, entry, EntryState::kResident);
    s.counters.kept_resident_tensors++;
    return Offer{id, false};
  }
  s.SetState(id, entry, EntryState::kPending);
  if (group_state == GroupState::kInWindow) return Offer{id, true};

  // keep_last == 0 (or a late entry): offload right away. A group already copying does
  // not add to the in-flight group count, so only a new one waits for the bound; waiting on
  // its own earlier entries would stall the host once per tensor.
  absl::Status status = group_state == GroupState::kCopying ? absl::OkStatus() : s.BoundInflight();
  if (status.ok()) status = s.StreamAfterCompute(s.device->d2h_stream(), compute);
  if (status.ok()) status = s.IssueD2H(id, s.entries.at(id));
  if (!status.ok()) {
    // No copy of this entry is queued (IssueD2H undoes a failed one). The caller never
    // learns its id and keeps its memory, so the engine forgets the entry.
    s.SetState(id, s.entries.at(id), EntryState::kGone);
    return status;
  }
  if (s.entries.at(id).state == EntryState::kResident) return Offer{id, false};
  CKPT_RETURN_IF_ERROR(s.RecordD2HDone(gid, s.groups.at(gid)));
  return Offer{id, true};
}

absl::StatusOr<OffloadEngine::Acquired> OffloadEngine::Acquire(EntryId id, StreamHandle compute) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  auto it = s.entries.find(id);
  if (it == s.entries.end() || engine_internal::IsDiscarded(it->second.state)) {
    if (id > 0 && id < s.reset_watermark) {
      return absl::FailedPreconditionError(
          absl::StrCat("saved tensor ", id,
                       " was dropped when the offload engine was reset (the step "
                       "that saved it raised an exception)"));
    }
    return absl::NotFoundError(absl::StrCat("unknown or discarded entry ", id));
  }
  CKPT_RETURN_IF_ERROR(s.Poll());
  if (!s.in_backward) {
    s.EnterBackward();
    if (s.options.prefetch_depth == 0) CKPT_RETURN_IF_ERROR(s.DrainForwardCopies());
  }
  Entry& entry = s.entries.at(id);
  const GroupId gid = entry.group;
  if (entry.state == EntryState::kPending) {
    return absl::InternalError(absl::StrCat("entry ", id, " still pending in backward"));
  }
  if (entry.state == EntryState::kOffloading || entry.state == EntryState::kOffloaded ||
      entry.state == EntryState::kHandedOut) {
    CKPT_RETURN_IF_ERROR(s.IssueRestore(gid, compute, /*prefetch=*/false,
                                        entry.state == EntryState::kHandedOut ? id : 0));
  }
  const EntryState state = s.entries.at(id).state;
  const bool resident = state == EntryState::kResident || state == EntryState::kReclaimed;
  // Prefetch before the hand-over: its H2D copies queue behind this group's anyway, and a
  // failure here must not lose a buffer already handed out (the engine would forget it,
  // the caller would never receive it).
  const bool eager = s.groups.at(gid).eager;
  if (!eager) s.last_acquired = gid;
  if (eager || s.prefetch_on_acquire) CKPT_RETURN_IF_ERROR(s.Prefetch(gid, compute));
  if (resident) return Acquired{true, nullptr};

  Group& group = s.groups.at(gid);
  CKPT_ASSIGN_OR_RETURN(bool copied, s.Done(group.h2d_done));
  if (!copied) {
    CKPT_ASSIGN_OR_RETURN(EventPtr ready, s.NewEvent());
    CKPT_RETURN_IF_ERROR(s.Record(ready, compute));
    s.pending_waits.push_back({ready, group.h2d_done});
  }
  CKPT_RETURN_IF_ERROR(s.device->StreamWaitEvent(compute, group.h2d_done->handle()));
  Entry& acquired = s.entries.at(id);
  Acquired result{false, acquired.restore};
  acquired.restore = nullptr;
  s.SetState(id, acquired, EntryState::kHandedOut);
  return result;
}

bool OffloadEngine::Discard(EntryId id) {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  auto it = s.entries.find(id);
  if (it == s.entries.end() || engine_internal::IsDiscarded(it->second.state)) return false;
  s.Poll().IgnoreError();
  it = s.entries.find(id);
  if (it == s.entries.end()) return false;
  Entry& entry = it->second;
  Group& group = s.groups.at(entry.group);
  switch (entry.state) {
    case EntryState::kPending:
      // The caller dropped the source itself; nothing was copied.
      s.SetState(id, entry, EntryState::kGone);
      return false;
    case EntryState::kResident:
    case EntryState::kReclaimed: {
      auto done = s.Done(group.d2h_done);
      if (entry.state == EntryState::kReclaimed && !(done.ok() && *done)) {
        // The caller let go but the copy still reads the source: the engine alone holds it.
        s.SetState(id, entry, EntryState::kDiscardedReclaimed);
        s.deferred_releases.push_back({id, group.d2h_done});
        return true;
      }
      s.SetState(id, entry, EntryState::kGone);
      return false;
    }
    case EntryState::kOffloading:
      // The copy still reads the source and writes the host block: Poll finishes this.
      s.SetState(id, entry, EntryState::kDiscardedCopying);
      return true;
    case EntryState::kRestoring:
      // The buffer's bytes stay counted until its deferred drop (not the entry's now).
      s.deferred_drops.push_back({id, entry.restore, entry.bytes, group.h2d_done});
      s.counters.device_held_bytes += entry.bytes;
      [[fallthrough]];
    case EntryState::kOffloaded:
    case EntryState::kHandedOut:
      s.deferred_frees.push_back({entry.host, {group.h2d_done}});
      s.SetState(id, entry, EntryState::kGone);
      s.Poll().IgnoreError();
      return false;
    case EntryState::kNew:
    case EntryState::kDiscardedCopying:
    case EntryState::kDiscardedReclaimed:
    case EntryState::kGone:
      break;
  }
  return false;
}

absl::Status OffloadEngine::Reset() {
  Impl& s = *impl_;
  EngineLock lock(&s.mu);
  absl::Status status = s.SynchronizeLocked();
  // Every entry and group is dropped whatever its state (outside the transition table).
  for (auto& [id, entry] : s.entries) {
    if (entry.state == EntryState::kRestoring) {
      s.DropRestore({id, entry.restore, entry.bytes, nullptr});
    }
    // Discarded entries whose copy was in flight included: the caller still holds them.
    if (engine_internal::HoldsSource(entry.state)) s.ReleaseSourceOf(id, entry);
    if (entry.host) s.FreeHostBlock(entry.host);
  }
  for (const auto& free : s.deferred_frees) s.FreeHostBlock(free.block);
  for (const auto& drop : s.deferred_drops) s.DropRestore(drop);
  s.deferred_frees.clear();
  s.deferred_drops.clear();
  s.deferred_releases.clear();
  s.pending_waits.clear();
  s.entries.clear();
  s.groups.clear();
  s.pending.clear();
  s.d2h_inflight.clear();
  s.in_backward = false;
  s.last_acquired = 0;
  s.counters.device_held_bytes = 0;
  s.reset_watermark = s.next_entry;
  return status;
}

absl::Status OffloadEngine::Synchronize() {
  EngineLock lock(&impl_->mu);
  return impl_->SynchronizeLocked();
}

EngineStats OffloadEngine::stats() const {
  EngineLock lock(&impl_->mu);
  EngineStats stats = impl_->counters;
  stats.arena = impl_->arena.stats();
  return stats;
}

void OffloadEngine::ResetStats() {
  EngineLock lock(&impl_->mu);
  const size_t held = impl_->counters.device_held_bytes;
  impl_->counters = EngineStats{};
  impl_->counters.device_held_bytes = held;
  impl_->counters.peak_device_held_bytes = held;
  impl_->arena.ResetPeak();
}

absl::Status OffloadEngine::ReserveHost(size_t bytes) { return impl_->arena.Reserve(bytes); }

HostArena& OffloadEngine::arena() { return impl_->arena; }

namespace engine_internal {

std::optional<EntryState> EngineTestPeer::StateOf(const OffloadEngine& engine, EntryId entry) {
  EngineLock lock(&engine.impl_->mu);
  auto it = engine.impl_->entries.find(entry);
  if (it == engine.impl_->entries.end()) return std::nullopt;
  return it->second.state;
}

std::optional<GroupState> EngineTestPeer::GroupStateOf(const OffloadEngine& engine, GroupId group) {
  EngineLock lock(&engine.impl_->mu);
  auto it = engine.impl_->groups.find(group);
  if (it == engine.impl_->groups.end()) return std::nullopt;
  return it->second.state;
}

}  // namespace engine_internal
}  // namespace ckpt_offload
