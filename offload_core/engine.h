// OffloadEngine: schedules device->host offload of checkpointed layers' saved inputs during
// forward and their prefetched host->device restore during backward.
//
// Vocabulary
// - A *group* is the saved inputs of one checkpointed layer; groups are registered in
//   forward order (BeginGroup) and consumed in reverse during backward (Acquire).
// - An *entry* is one saved tensor's bytes (a contiguous device range) inside a group. The
//   caller (torch plugin, tests) owns the device memory; the engine only borrows it.
//
// Schedule (N = keep_last, P = prefetch_depth)
// - Forward: group i's device->host copy starts when group i+N is registered (N = 0: when
//   each entry is offered), after the D2H stream waits on an event recorded on the caller's
//   compute stream. When forward ends (the first Acquire), the last N groups stay resident.
//   The device source is handed back (Client::ReleaseSource) only once its copy completed.
//   At most max_inflight_d2h_groups groups have copies in flight; beyond that the host
//   waits for the oldest, which bounds the device memory the engine holds.
// - Backward: Acquire(entry) of group j makes sure j's host->device copy was issued (after
//   j's D2H and after the compute stream's current work), makes the compute stream wait
//   only on j's own H2D event, and issues H2D for the next P offloaded groups below j.
//   A restored buffer belongs to the caller once Acquire returns; the engine keeps no
//   reference to it. An entry whose D2H has not completed when backward needs it is
//   *reclaimed*: its source is still on the device, so it is used as is (no H2D).
//   With P = 0 the first Acquire of a backward waits for the forward's last D2H copies, so
//   their sources are off the device before backward allocates (memory first).
// - EndForward() does at once what the first Acquire would do, and drains the forward's
//   D2H copies for every P: a caller that sees backward begin (its first saved-tensor use,
//   usually the loss's, where a language model's activation peak is) calls it, so that the
//   sources are off the device before that peak allocates.
// - An *eager* group (BeginEagerGroup) stands outside the keep_last window: each entry is
//   copied out as it is offered, and PrefetchGroup(g) restores it ahead of its Acquire
//   when the caller knows its backward is near. For tensors saved after the checkpointed
//   layers (a model's head), whose backward order the group order does not give.
// - Host blocks live until Discard(entry) (the caller's saved-tensor handle died), so a
//   retained graph can be restored again. A block returns to the arena only after every copy
//   touching it completed.
// - Reset() drains everything: waits for copies, releases every source, frees every host
//   block. Entries alive in the caller then fail Acquire with FailedPrecondition.
// - Errors (a device call failed): the failing call hands nothing over (BeginGroup begins
//   no group; OfferEntry registers no entry, the caller keeps its memory; Acquire hands out
//   no buffer). Copies queued before the failure stay tracked, and an entry whose copy out
//   failed stays resident, so Reset() recovers and a caller that carries on sees intact
//   data.
//
// Invariants (checked by tests on SimDevice)
// - No hazards: no read before its producing copy completed, no host block reused or device
//   source released while a copy touching it is in flight.
// - Device bytes held by the engine (sources not yet released + restored buffers not yet
//   acquired) never exceed (N + max_inflight_d2h_groups + P + 1) groups' bytes, counting
//   eager groups as groups.
// - After Reset, or after every entry was discarded, arena live bytes are 0.
//
// States (engine_states.h). Each entry and each group has one state; every change goes
// through one function per kind that checks it against this table (debug builds abort on
// any other change, naming both states) and keeps device_held_bytes in step: an entry in
// Pending, Offloading, DiscardedCopying, DiscardedReclaimed or Restoring counts its bytes.
// Reset drops every entry and group whatever its state.
//
//   entry from          event                                      to
//   New                 OfferEntry (copy to come)                  Pending
//   New                 OfferEntry (0 bytes, group Kept)           Resident
//   Pending             D2H issued                                 Offloading
//   Pending             arena refused / copy failed / forward end  Resident
//   Pending             Discard, or OfferEntry failed              Gone
//   Offloading          D2H complete (source released)             Offloaded
//   Offloading          backward needs it first                    Reclaimed
//   Offloading          Discard                                    DiscardedCopying
//   DiscardedCopying    D2H complete (source released)             Gone
//   Offloaded/HandedOut H2D issued                                 Restoring
//   Restoring           Acquire hands the buffer out               HandedOut
//   Offloaded/HandedOut Discard                                    Gone
//   Restoring           Discard (buffer dropped once copied)       Gone
//   Resident            Discard, or OfferEntry failed              Gone
//   Reclaimed           Discard, its D2H complete                  Gone
//   Reclaimed           Discard, its D2H still running             DiscardedReclaimed
//   DiscardedReclaimed  D2H complete (source released)             Gone
//
//   group from          event                                      to
//   New                 BeginGroup (keep_last > 0)                 InWindow
//   New                 BeginGroup (keep_last 0), BeginEagerGroup  CopyStarted
//   InWindow            leaves the window / OffloadPendingGroups   CopyStarted
//   InWindow            forward ends                               Kept
//   CopyStarted         D2H copies recorded                        Copying
//   Copying             copies complete (or nothing to wait on)    CopyStarted
//   CopyStarted/Kept    last entry gone                            Gone
//
// Thread-safety: every method may be called from any thread. One mutex guards all engine
// state (annotated with absl's thread-safety attributes; clang -Wthread-safety checks
// engine.cc).
// Lock order: caller's locks held across an engine call -> the engine's mutex -> locks
// taken by Client callbacks (invoked with the engine's mutex held) -> Device and HostArena
// locks. So a Client callback must not call back into the engine, and a caller must not
// hold a lock its own callbacks take while calling the engine. arena() and ReserveHost()
// take only the arena's lock.
#ifndef CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_H_
#define CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload_core/device.h"
#include "offload_core/host_arena.h"

namespace ckpt_offload {

using GroupId = int64_t;
using EntryId = int64_t;
// Chosen by the caller for each OfferEntry and handed back with ReleaseSource: the caller
// files its source under it before offering, so a release can never outrun the filing.
using SourceToken = uint64_t;

namespace engine_internal {
struct EngineTestPeer;  // engine_states.h: tests read entry and group states
}  // namespace engine_internal

struct EngineOptions {
  int keep_last = 1;       // groups kept resident at the end of forward
  int prefetch_depth = 1;  // groups fetched ahead during backward
  // Whether Acquire of a group issues the prefetch of the groups below it. false: the
  // caller issues it with PrefetchBelowAcquired, later in that group's backward.
  bool prefetch_on_acquire = true;
  int max_inflight_d2h_groups = 2;
  ArenaOptions arena;
};

// Checks ranges; the error names the field.
absl::Status ValidateEngineOptions(const EngineOptions& options);

// Counts of checkpoint groups' entries; eager groups' entries are counted apart (eager_*).
struct EngineStats {
  int64_t groups = 0;             // BeginGroup calls (eager groups not included)
  int64_t offloaded_tensors = 0;  // entries whose D2H was issued
  size_t offloaded_bytes = 0;
  int64_t restored_tensors = 0;  // H2D copies issued (prefetched or on demand)
  size_t restored_bytes = 0;
  int64_t prefetched_tensors = 0;       // H2D issued ahead of their Acquire
  int64_t kept_resident_tensors = 0;    // entries of the last keep_last groups
  int64_t cap_fallbacks = 0;            // entries kept on device: arena refused (cap/backend)
  int64_t reclaimed_tensors = 0;        // backward used the still-held source (D2H unfinished)
  int64_t eager_offloaded_tensors = 0;  // eager groups' entries whose D2H was issued
  size_t eager_offloaded_bytes = 0;
  int64_t eager_restored_tensors = 0;  // their H2D copies (by PrefetchGroup or on demand)
  size_t eager_restored_bytes = 0;
  int64_t eager_cap_fallbacks = 0;  // eager entries the arena refused (kept on device)
  double exposed_wait_ms = 0;       // compute-stream time spent waiting on H2D
  size_t device_held_bytes = 0;     // now: sources not released + unacquired restores
  size_t peak_device_held_bytes = 0;
  ArenaStats arena;
};

class OffloadEngine {
 public:
  class Client {
   public:
    virtual ~Client() = default;
    // The engine no longer needs the device source offered as `entry` with token `source`
    // (its D2H completed, or it was dropped by Reset). Called at most once per entry. It can
    // come before OfferEntry returned `entry` to its caller (another thread's engine call
    // saw the copy complete): find the source by `source`, not by `entry`.
    virtual void ReleaseSource(EntryId entry, SourceToken source) = 0;
    // Device memory of `bytes` to restore `entry` into. It is written on the H2D stream
    // after the compute stream's work queued so far.
    virtual absl::StatusOr<void*> AllocateRestore(EntryId entry, size_t bytes) = 0;
    // A restore buffer from AllocateRestore that will never be acquired (its entry was
    // discarded or the engine reset). Its copy has completed; the caller frees it.
    virtual void DropRestore(EntryId entry, void* data) = 0;
  };

  // `device` and `client` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<OffloadEngine>> Create(Device* device, Client* client,
                                                               EngineOptions options);
  ~OffloadEngine();  // Reset()s first

  // Starts the next group in forward order. A BeginGroup after backward started begins a
  // new forward (the previous forward's pending groups stay resident).
  absl::StatusOr<GroupId> BeginGroup(StreamHandle compute);

  // Starts an eager group: next in order like any group, but outside the keep_last window
  // (it neither counts towards it nor pushes other groups out of it). Its entries are
  // copied out as they are offered.
  absl::StatusOr<GroupId> BeginEagerGroup();

  // Restores `group`'s offloaded entries now, and the next prefetch_depth offloaded groups
  // below it, ahead of their Acquire. An unknown (discarded) group is not an error.
  absl::Status PrefetchGroup(GroupId group, StreamHandle compute);

  // Restores the next prefetch_depth offloaded groups below the checkpoint group acquired
  // last (eager groups aside), ahead of their Acquire; before the first Acquire of a
  // backward, the newest offloaded groups (backward has begun above every group: layers
  // whose saved tensors stayed on the device, a fused loss that offloaded nothing);
  // nothing in forward. With prefetch_on_acquire false this is the only prefetch of those
  // groups: a caller that knows when the acquired group's own backward is past its memory
  // peak calls it then, so that the restored buffers do not add to that peak. A group not
  // prefetched is restored at its Acquire (the compute stream waits for it).
  absl::Status PrefetchBelowAcquired(StreamHandle compute);
  // Changes prefetch_on_acquire (between steps).
  void SetPrefetchOnAcquire(bool on);

  // Starts the copies of the forward's pending groups (those the keep_last window would
  // keep) now: the caller has an earlier way to restore them (PrefetchGroup of a later
  // eager group reaches the groups below it).
  absl::Status OffloadPendingGroups(StreamHandle compute);

  // The forward saved its last tensor: the pending groups (the last keep_last) stay
  // resident, and the host waits for the forward's D2H copies still in flight, so their
  // sources are handed back (Client::ReleaseSource) before this returns. Only the first
  // call after a forward does anything; the first Acquire of a backward implies it, without
  // the wait unless prefetch_depth is 0.
  absl::Status EndForward();

  struct Offer {
    EntryId entry;
    // false: kept on the device for good. Known at offer time only when the copy starts
    // then (keep_last == 0): the arena refused a block (counted in cap_fallbacks), the
    // group's forward already ended, or `bytes` is 0. An entry offered with true can still
    // fall back when its group's copy starts; Acquire then reports it resident.
    bool will_offload;
  };
  // Registers `bytes` of device memory at `device_src` as an entry of `group`. The memory
  // must stay valid until ReleaseSource(entry, source), or until Discard(entry) when that
  // returns false.
  // REQUIRES: the caller can find the source by `source` before this is called.
  absl::StatusOr<Offer> OfferEntry(GroupId group, const void* device_src, size_t bytes,
                                   SourceToken source, StreamHandle compute);

  struct Acquired {
    bool resident;      // true: use the caller's own source (never offloaded)
    void* device_data;  // restored buffer, owned by the caller now (null when resident)
  };
  absl::StatusOr<Acquired> Acquire(EntryId entry, StreamHandle compute);

  // The caller's handle for `entry` is gone; its host block is returned once safe. Returns
  // true when a copy still reads the source: keep it valid until its ReleaseSource.
  bool Discard(EntryId entry);

  // Up-front hint for the host pool (e.g. from the longest sequence a run will see):
  // HostArena::Reserve(bytes) on the engine's arena; see its contract (one backend
  // allocation at most, within the cap; the status says why not).
  absl::Status ReserveHost(size_t bytes);

  // Drains every copy and frees everything (after an exception, at shutdown).
  absl::Status Reset();
  // Waits for in-flight copies and settles deferred work (exposed-wait figures, frees).
  absl::Status Synchronize();

  EngineStats stats() const;
  void ResetStats();
  HostArena& arena();

 private:
  friend struct engine_internal::EngineTestPeer;
  OffloadEngine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckpt_offload

#endif  // CKPT_OFFLOAD_OFFLOAD_CORE_ENGINE_H_
