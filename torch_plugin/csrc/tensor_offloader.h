// TensorOffloader: adapts at::Tensor saved by autograd to the OffloadEngine.
//
// Contract
// - Pack(t) returns either `t` itself (not offloadable, see Offloadable()) or a PackedTensor
//   whose bytes the engine moves to host memory; Unpack(packed) returns a tensor with the
//   same sizes, strides, dtype and values on the original device.
// - Tensors sharing one storage are copied once (one engine entry per storage span) and
//   restored as views of one storage.
// - In scope kCheckpointInputs only tensors marked by BeginGroup() move, and, with
//   offload_head, the model's *head*: see below. In scope kAll every eligible saved tensor
//   does.
// - The first unpack after a forward (backward has begun, at the loss) ends the forward:
//   OffloadEngine::EndForward keeps the last keep_last groups and waits for the forward's
//   copies, so their device memory is free before the loss's backward allocates.
// - Head (offload_head): which tensors saved outside checkpoint groups move, and when they
//   come back, is HeadPolicy's (head_policy.h); this class hands its candidates to the
//   engine as eager groups and restores them at their trigger's unpack. Once a trigger is
//   set, the last keep_last groups are copied out too: the trigger's restore prefetches
//   the groups below the head, so the LM head's backward hides their copies as well.
// - A PackedTensor keeps its host copy alive (a retained graph can unpack it again) and
//   returns it to the pool when destroyed.
// - What Pack returns never holds the autograd tensor it was given (its grad_fn, hence
//   the graph): a saved output of a node would otherwise form a cycle through the node's
//   saved variable, and a graph dropped without backward (a skipped step, a forward for
//   logging) would never be freed. Offloaded and head tensors are held by their storage
//   only; a kept tensor that is not a leaf comes back as a detached alias of it.
// - Saved-tensor hooks turn autograd's in-place check off, so every saved tensor records
//   its version counter at Pack, and Unpack raises autograd's own "modified by an inplace
//   operation" error when it moved.
// - The compute stream is read at every call (the current CUDA stream), never cached.
// - After Reset() (an exception in the step), unpacking an earlier PackedTensor throws.
//
// Thread-safety and lock order. Pack and Unpack may run on different threads (autograd's
// backward threads), and the engine calls back from whichever thread made an engine call.
// Locks are taken in this order, never the reverse:
//   1. TensorOffloader::engine_mu_   the engine's creation, the open group, the head policy
//   2. OffloadedStorage::mu_         one storage's restore and head-candidate state
//   3. OffloadEngine's own lock      inside every engine call
//   4. TensorOffloader::tensors_mu_  what the offloader holds for the engine (the engine's
//                                    callbacks take it under 3)
// Paths that run under 2 or 3 (restores, discards, the engine's callbacks) never take
// engine_mu_: they reach the engine through engine_published_, set once it exists.
// Locks are taken with MutexLock (mutex_lock.h): absl::MutexLock that TSan can see.
#ifndef CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_TENSOR_OFFLOADER_H_
#define CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_TENSOR_OFFLOADER_H_

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "offload_core/device.h"
#include "offload_core/engine.h"
#include "torch_plugin/csrc/head_policy.h"
#include "torch_plugin/csrc/mutex_lock.h"

namespace ckpt_offload::torch_plugin {

// What Tensor::grad_fn() returns: std::shared_ptr<Node> up to torch 2.12,
// c10::intrusive_ptr<Node> from 2.13. Deduced, so one source builds against both.
using NodeRef = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// The weak reference that matches NodeRef's ownership.
template <typename Strong>
struct WeakRefOf;
template <typename T>
struct WeakRefOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T>
struct WeakRefOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
};
using WeakNodeRef = typename WeakRefOf<NodeRef>::type;

enum class Backend { kCuda, kHost };
enum class Scope { kCheckpointInputs, kAll };

struct OffloaderConfig {
  int keep_last = 1;
  int prefetch_depth = 1;
  int64_t min_offload_bytes = int64_t{1} << 20;
  uint64_t host_memory_limit = UINT64_MAX;
  Backend backend = Backend::kCuda;
  Scope scope = Scope::kCheckpointInputs;
  int max_inflight_d2h_groups = 2;
  bool offload_head = true;
  // EngineOptions::prefetch_on_acquire; false: PrefetchAhead() issues the prefetch.
  bool prefetch_on_acquire = true;
};

class TensorOffloader;

// Autograd's saved-variable version check, which saved-tensor hooks switch off: the
// version of the tensor's counter at Pack, compared at Unpack.
class VersionCheck {
 public:
  VersionCheck() = default;
  explicit VersionCheck(const at::Tensor& tensor);
  // Throws c10::Error with autograd's message when the tensor was modified in place since
  // it was saved. `sizes`, `dtype` and `device` describe it in the message.
  void Verify(c10::IntArrayRef sizes, at::ScalarType dtype, const at::Device& device) const;

 private:
  c10::VariableVersion counter_;
  uint32_t saved_version_ = 0;
  // For the message only ("which is output 0 of MulBackward0"); weak, so nothing of the
  // graph is kept alive by a saved tensor.
  WeakNodeRef grad_fn_{NodeRef()};
  int64_t output_nr_ = 0;
};

// One offloaded storage span, shared by every saved view of that storage.
class OffloadedStorage {
 public:
  OffloadedStorage(std::shared_ptr<TensorOffloader> owner, EntryId entry,
                   const c10::Storage& source, int64_t span_begin_bytes, int64_t span_end_bytes,
                   at::Device device);
  ~OffloadedStorage();
  OffloadedStorage(const OffloadedStorage&) = delete;
  OffloadedStorage& operator=(const OffloadedStorage&) = delete;

  // A head candidate (HeadPolicy): holds `source` itself until OfferHeld hands it to the
  // engine, and keeps its restore until the last saved handle dies.
  static std::shared_ptr<OffloadedStorage> HeadCandidate(std::shared_ptr<TensorOffloader> owner,
                                                         const c10::Storage& source,
                                                         int64_t span_begin_bytes,
                                                         int64_t span_end_bytes, at::Device device);

  // A head candidate's one transition, held -> offered: `offer` hands the held storage's
  // span to the engine and returns its entry, or 0 when the engine keeps nothing (the
  // storage stays held). Returns that entry; 0 too when this is no longer held.
  template <typename OfferFn>  // EntryId(const c10::Storage& source, int64_t begin, int64_t end)
  EntryId OfferHeld(OfferFn offer) ABSL_LOCKS_EXCLUDED(mu_);

  // The storage holding the span: the live source (kept resident) or a restored copy.
  // `span_begin_bytes` tells where the span starts inside it.
  c10::Storage Restore(int64_t* span_begin_bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // From now on a restore stays until this storage's last handle dies (see keep_restore_).
  void KeepRestore() ABSL_LOCKS_EXCLUDED(mu_);

  // Whether [begin, end) of the source storage lies within this span.
  bool Covers(int64_t begin, int64_t end) const {
    return begin >= span_begin_bytes_ && end <= span_end_bytes_;
  }
  const at::Device& device() const { return device_; }

 private:
  std::shared_ptr<TensorOffloader> owner_;
  absl::Mutex mu_;
  EntryId entry_ ABSL_GUARDED_BY(mu_);  // 0 while a head candidate is held
  // A weak reference keeps the StorageImpl's address from being reused while this lives,
  // so the address is a safe key for spotting other views of the same storage.
  c10::weak_intrusive_ptr<c10::StorageImpl> source_;
  const c10::StorageImpl* key_;
  int64_t span_begin_bytes_;
  int64_t span_end_bytes_;
  at::Device device_;
  c10::weak_intrusive_ptr<c10::StorageImpl> restored_ ABSL_GUARDED_BY(mu_){
      c10::intrusive_ptr<c10::StorageImpl>()};
  // A head candidate not (yet) handed to the engine (entry_ == 0) holds its storage here.
  c10::Storage held_ ABSL_GUARDED_BY(mu_);
  // Head tensors are often saved twice (an RMSNorm's float32 input, by pow and by mul),
  // and the first use's restore is gone before the second use: a head storage keeps its
  // restore until its last saved-tensor handle dies, as the tensor itself would live. So
  // does a storage packed into a group with keep_restore.
  bool keep_restore_ ABSL_GUARDED_BY(mu_) = false;
  c10::Storage kept_restore_ ABSL_GUARDED_BY(mu_);
};

template <typename OfferFn>
EntryId OffloadedStorage::OfferHeld(OfferFn offer) {
  MutexLock lock(&mu_);
  if (entry_ != 0 || !held_) return 0;
  const EntryId entry = offer(held_, span_begin_bytes_, span_end_bytes_);
  if (entry == 0) return 0;
  entry_ = entry;
  held_ = c10::Storage();
  return entry;
}

// What Pack returns for an offloaded tensor.
struct PackedTensor {
  std::shared_ptr<OffloadedStorage> storage;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset_bytes = 0;  // within the original storage
  at::ScalarType dtype = at::kFloat;
  VersionCheck version;
};

// What Pack returns for a tensor that stays where it is: the tensor itself when it is a
// leaf (nothing of the graph hangs on it), otherwise a detached alias (same storage and
// version counter, no grad_fn).
struct KeptTensor {
  at::Tensor data;
  VersionCheck version;
};

// The result of Pack: exactly one of the two is set.
struct SavedTensor {
  std::shared_ptr<PackedTensor> packed;
  std::shared_ptr<KeptTensor> kept;
};

struct OffloaderStats {
  EngineStats engine;
  int64_t packed_tensors = 0;   // tensors Pack was asked about
  int64_t skipped_tensors = 0;  // returned as-is (not marked, too small, not eligible)
  int64_t shared_storage_hits = 0;
  int64_t head_kept_tensors = 0;  // head candidates that no trigger followed (head
                                  // offloads and restores: engine.eager_*)
};

class TensorOffloader : public std::enable_shared_from_this<TensorOffloader>,
                        private OffloadEngine::Client {
 public:
  // Errors name the offending config field.
  static absl::StatusOr<std::shared_ptr<TensorOffloader>> Create(OffloaderConfig config);
  ~TensorOffloader() override;

  // Starts a checkpoint group whose saved inputs are `inputs` (marks them for scope
  // kCheckpointInputs). EndGroup() clears the marks once the checkpoint call returned.
  void BeginGroup(const std::vector<at::Tensor>& inputs)
      ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  void EndGroup() ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);

  // Autograd's saved-tensor hooks. Pack returns `kept` for a tensor that stays where it
  // is; it comes back through UnpackKept. Both Unpacks throw autograd's in-place error
  // when the tensor was modified since Pack.
  SavedTensor Pack(const at::Tensor& tensor) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  // Pack for a tensor the caller saves itself into the open checkpoint group (an op output
  // that a layer's recompute will skip, a saved tensor of a layer run without
  // checkpointing): offloaded with the group's inputs, brought back with them, and restored
  // by Unpack. Outside a group, or while a backward runs, it is kept where it is, as Pack
  // keeps what it does not move. `keep_restore`: its storage's restore stays until the
  // last handle to it dies (autograd unpacks a storage saved by several nodes once per
  // node, and each would otherwise restore it again).
  SavedTensor PackIntoGroup(const at::Tensor& tensor, bool keep_restore = false)
      ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  at::Tensor Unpack(const PackedTensor& packed) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  at::Tensor UnpackKept(const KeptTensor& kept) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);

  // A tensor the caller keeps without asking Pack (`saved`, a Python tensor subclass such
  // as nn.Parameter, held by the caller as `held`: itself or its detached alias); it may
  // still trigger head tensors saved before it. NoteUnpackForeign(held) is its unpack.
  void PackForeign(const at::Tensor& saved, const at::Tensor& held)
      ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  void NoteUnpackForeign(const at::Tensor& held) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);

  // Why `tensor` would not be offloaded, or empty when it would (ignores marking).
  std::string IneligibleReason(const at::Tensor& tensor) const;

  // A new training step begins (the context's entry). A forward that saw no backward (a
  // dropped loss, an evaluation with grad enabled) ends here: its copies are drained, so
  // the device memory of whatever its graph released is free, and its head state is gone.
  void BeginStep() ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  // Throws c10::Error with the device's text when draining failed.
  void Reset() ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  // Settles in-flight copies and figures.
  void Synchronize() ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  OffloaderStats stats() const ABSL_LOCKS_EXCLUDED(engine_mu_);
  void ResetStats() ABSL_LOCKS_EXCLUDED(engine_mu_);
  const OffloaderConfig& config() const { return config_; }
  bool has_engine() const ABSL_LOCKS_EXCLUDED(engine_mu_);
  // Host-arena cap, changeable between steps.
  void SetHostMemoryLimit(uint64_t bytes) ABSL_LOCKS_EXCLUDED(engine_mu_);
  // Whether restoring a layer's input (its backward begins) also prefetches the layers
  // below it (the default), or PrefetchAhead() does, later in that layer's backward: after
  // its memory peak, so that the prefetched input does not add to it. Between steps.
  void SetPrefetchOnAcquire(bool on) ABSL_LOCKS_EXCLUDED(engine_mu_);
  // OffloadEngine::PrefetchBelowAcquired on the current stream; nothing before the engine
  // exists. Called from backward (a gradient hook). Throws c10::Error when a copy failed.
  void PrefetchAhead() ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  // Grows the host pool up front for `bytes` of offloaded data (what the longest step a
  // run expects will offload; OffloadEngine::ReserveHost), so that steps up to that size
  // allocate no pinned memory. Before the first step there is no engine yet: the request
  // is kept (the largest one) and made when the engine is created, where a refusal is a
  // warning and the pool grows on demand. Errors: the arena's (over the cap, the backend).
  absl::Status ReserveHost(uint64_t bytes) ABSL_LOCKS_EXCLUDED(engine_mu_);

 private:
  friend class OffloadedStorage;
  explicit TensorOffloader(OffloaderConfig config);

  // OffloadEngine::Client (called with the engine's lock held).
  void ReleaseSource(EntryId entry, SourceToken source) override;
  absl::StatusOr<void*> AllocateRestore(EntryId entry, size_t bytes) override
      ABSL_LOCKS_EXCLUDED(tensors_mu_);
  void DropRestore(EntryId entry, void* data) override ABSL_LOCKS_EXCLUDED(tensors_mu_);
  // A source under a fresh token, before OfferEntry; UnfileSource when the engine did not
  // take it (the offer failed, or the entry stays resident).
  SourceToken FileSource(const c10::Storage& storage);
  void UnfileSource(SourceToken token);

  // The engine for `device`, created on first use.
  OffloadEngine* EngineFor(const at::Device& device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(engine_mu_);
  // The engine once it exists (null before), for paths that may not take engine_mu_.
  OffloadEngine* PublishedEngine() const {
    return engine_published_.load(std::memory_order_acquire);
  }
  StreamHandle ComputeStream(const at::Device& device) const;
  bool MatchesBackend(const at::Tensor& tensor) const;
  // For OffloadedStorage, under its mu_ (AcquireStorage) or anywhere its last handle dies.
  void Discard(EntryId entry, const c10::StorageImpl* key) ABSL_LOCKS_EXCLUDED(tensors_mu_);
  c10::Storage AcquireStorage(EntryId entry, const at::Device& device, bool* resident)
      ABSL_LOCKS_EXCLUDED(tensors_mu_);

  // Head (HeadPolicy decides). PackUngrouped handles a tensor saved outside any group in
  // scope kCheckpointInputs; OfferHeadLocked hands a candidate to the engine as an eager
  // group (0: it stays where it is). engine_mu_ held by the Locked ones. A kept trigger
  // is keyed by its KeptTensor's (or a foreign tensor's) TensorImpl, a packed one by its
  // OffloadedStorage: both live as long as the saved handle.
  bool HeadRelevant(const at::Tensor& tensor) const;  // may be a candidate or trigger
  SavedTensor PackUngrouped(const at::Tensor& tensor) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  SavedTensor Keep(const at::Tensor& tensor);
  // Registers the head groups `tensor` triggers (if any) under `trigger_key`; returns
  // the candidate `tensor` became, or null.
  std::shared_ptr<OffloadedStorage> OfferHeadAndTrigger(const at::Tensor& tensor, bool may_offload,
                                                        std::vector<GroupId>* triggered)
      ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  void RegisterTrigger(const void* trigger_key, std::vector<GroupId> groups)
      ABSL_LOCKS_EXCLUDED(engine_mu_);
  GroupId OfferHeadLocked(OffloadedStorage& candidate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(engine_mu_);
  void StartForwardLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(engine_mu_);
  // Backward began (first unpack after a forward): EndForward. Then a trigger's groups.
  void NoteUnpack(const void* trigger_key) ABSL_LOCKS_EXCLUDED(engine_mu_, tensors_mu_);
  // HeadPolicy::MayHaveTriggers, which reads an atomic: safe without engine_mu_.
  bool MayHaveHeadTriggers() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return head_.MayHaveTriggers();
  }
  std::shared_ptr<PackedTensor> SharedView(const at::Tensor& tensor, int64_t begin, int64_t end)
      ABSL_LOCKS_EXCLUDED(tensors_mu_);
  SavedTensor Skip(const at::Tensor& tensor);

  OffloaderConfig config_;  // host_memory_limit may change between steps

  // Engine state; created lazily on the first offloadable tensor's device.
  mutable absl::Mutex engine_mu_;
  std::unique_ptr<Device> device_ ABSL_GUARDED_BY(engine_mu_);
  std::unique_ptr<OffloadEngine> engine_ ABSL_GUARDED_BY(engine_mu_);
  uint64_t pending_host_reserve_ ABSL_GUARDED_BY(engine_mu_) = 0;  // ReserveHost before it
  // engine_ for readers that may not take engine_mu_ (see the lock order), and the device
  // it restores to. Both are written once, before the engine's first call, and stay until
  // the destructor: the release store of engine_published_ publishes engine_device_.
  std::atomic<OffloadEngine*> engine_published_{nullptr};
  at::Device engine_device_{at::kCPU};
  bool group_open_ ABSL_GUARDED_BY(engine_mu_) = false;
  GroupId group_ ABSL_GUARDED_BY(engine_mu_) = 0;
  // The first tensor kept on the device because the host arena refused memory (cap reached
  // or host allocation failed) is reported with one warning per offloader; the checks stop
  // once it was given. Guarded by engine_mu_.
  bool warned_fallback_ ABSL_GUARDED_BY(engine_mu_) = false;
  void WarnOnFirstFallback(OffloadEngine* engine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(engine_mu_);

  // The forward/backward turn and the head. forward_open_: a group began since the last
  // forward's end (the first unpack after it). head_ is guarded by engine_mu_.
  std::atomic<bool> forward_open_{false};
  HeadPolicy head_ ABSL_GUARDED_BY(engine_mu_);

  // Tensors owned on the engine's behalf (guarded by tensors_mu_; taken inside engine calls).
  absl::Mutex tensors_mu_ ABSL_ACQUIRED_AFTER(engine_mu_);
  // Sources by storage: an at::Tensor would hold its grad_fn, and with it the graph.
  // Filed under their token before OfferEntry (a ReleaseSource can come before it
  // returns), until ReleaseSource or Discard; source_tokens_ from the offer's return.
  std::unordered_map<SourceToken, c10::Storage> sources_ ABSL_GUARDED_BY(tensors_mu_);
  std::unordered_map<EntryId, SourceToken> source_tokens_ ABSL_GUARDED_BY(tensors_mu_);
  SourceToken next_source_token_ ABSL_GUARDED_BY(tensors_mu_) = 1;
  // Until acquired or dropped.
  std::unordered_map<EntryId, at::Tensor> restores_ ABSL_GUARDED_BY(tensors_mu_);
  std::unordered_map<const c10::StorageImpl*, std::weak_ptr<OffloadedStorage>> by_storage_
      ABSL_GUARDED_BY(tensors_mu_);
  std::unordered_set<const c10::TensorImpl*> marked_ ABSL_GUARDED_BY(tensors_mu_);

  std::atomic<int64_t> packed_{0};
  std::atomic<int64_t> skipped_{0};
  std::atomic<int64_t> shared_hits_{0};
};

}  // namespace ckpt_offload::torch_plugin

#endif  // CKPT_OFFLOAD_TORCH_PLUGIN_CSRC_TENSOR_OFFLOADER_H_
