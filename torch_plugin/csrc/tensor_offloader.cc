#include "torch_plugin/csrc/tensor_offloader.h"

#include <ATen/SequenceNumber.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace ckpt_offload::torch_plugin {
namespace {

// Byte range [begin, end) of `tensor`'s storage that its elements touch.
std::pair<int64_t, int64_t> StorageSpan(const at::Tensor& tensor) {
  const int64_t itemsize = static_cast<int64_t>(tensor.element_size());
  int64_t last = 0;  // element index of the furthest element, relative to the offset
  for (int64_t d = 0; d < tensor.dim(); ++d) last += (tensor.size(d) - 1) * tensor.stride(d);
  const int64_t begin = tensor.storage_offset() * itemsize;
  return {begin, begin + (last + 1) * itemsize};
}

// What Unpack needs to rebuild `tensor` from the storage `holder` keeps (span from `begin`).
std::shared_ptr<PackedTensor> MakePacked(const at::Tensor& tensor, int64_t begin,
                                         std::shared_ptr<OffloadedStorage> holder) {
  auto packed = std::make_shared<PackedTensor>();
  packed->sizes = tensor.sizes().vec();
  packed->strides = tensor.strides().vec();
  packed->storage_offset_bytes = begin;
  packed->dtype = tensor.scalar_type();
  packed->storage = std::move(holder);
  packed->version = VersionCheck(tensor);
  return packed;
}

[[noreturn]] void ThrowStatus(const char* what, const absl::Status& status) {
  TORCH_CHECK(false, "ckpt_offload: ", what, " failed: ", status.ToString());
}

// torch's name for a tensor type, as autograd's messages print it ("torch.cuda.HalfTensor").
std::string TypeName(at::ScalarType dtype, const at::Device& device) {
  return absl::StrCat("torch.", device.is_cuda() ? "cuda." : "", c10::toString(dtype), "Tensor");
}

// The engine's options for `config`: the one mapping from OffloaderConfig to EngineOptions.
EngineOptions EngineOptionsFor(const OffloaderConfig& config) {
  EngineOptions options;
  options.keep_last = config.keep_last;
  options.prefetch_depth = config.prefetch_depth;
  options.max_inflight_d2h_groups = config.max_inflight_d2h_groups;
  options.prefetch_on_acquire = config.prefetch_on_acquire;
  options.arena.byte_cap = config.host_memory_limit;
  return options;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// VersionCheck

VersionCheck::VersionCheck(const at::Tensor& tensor) {
  const c10::VariableVersion& counter = tensor.unsafeGetTensorImpl()->version_counter();
  if (!counter.enabled()) return;  // an inference tensor: autograd checks nothing either
  counter_ = counter;
  saved_version_ = counter_.current_version();
  grad_fn_ = WeakNodeRef(tensor.grad_fn());
  output_nr_ = tensor.output_nr();
}

void VersionCheck::Verify(c10::IntArrayRef sizes, at::ScalarType dtype,
                          const at::Device& device) const {
  if (!counter_.enabled()) return;
  const uint32_t current = counter_.current_version();
  if (current == saved_version_) return;
  // Autograd's own wording (SavedVariable::unpack), which hooks would otherwise silence.
  std::ostringstream message;
  message << "one of the variables needed for gradient computation has been modified by an "
             "inplace operation: ["
          << TypeName(dtype, device) << " " << sizes << "]";
  if (const NodeRef grad_fn = grad_fn_.lock()) {
    message << ", which is output " << output_nr_ << " of " << grad_fn->name() << ",";
  }
  message << " is at version " << current << "; expected version " << saved_version_ << " instead.";
  if (torch::autograd::AnomalyMode::is_enabled()) {
    message << " Hint: the backtrace further above shows the operation that failed to "
               "compute its gradient. The variable in question was changed in there or "
               "anywhere later. Good luck!";
  } else {
    message << " Hint: enable anomaly detection to find the operation that failed to "
               "compute its gradient, with torch.autograd.set_detect_anomaly(True, "
               "check_nan=False).";
  }
  TORCH_CHECK(false, message.str());
}

// ---------------------------------------------------------------------------------------
// OffloadedStorage

OffloadedStorage::OffloadedStorage(std::shared_ptr<TensorOffloader> owner, EntryId entry,
                                   const c10::Storage& source, int64_t span_begin_bytes,
                                   int64_t span_end_bytes, at::Device device)
    : owner_(std::move(owner)),
      entry_(entry),
      source_(c10::weak_intrusive_ptr<c10::StorageImpl>(source.getWeakStorageImpl())),
      key_(source.unsafeGetStorageImpl()),
      span_begin_bytes_(span_begin_bytes),
      span_end_bytes_(span_end_bytes),
      device_(device) {}

std::shared_ptr<OffloadedStorage> OffloadedStorage::HeadCandidate(
    std::shared_ptr<TensorOffloader> owner, const c10::Storage& source, int64_t span_begin_bytes,
    int64_t span_end_bytes, at::Device device) {
  auto candidate = std::make_shared<OffloadedStorage>(std::move(owner), /*entry=*/0, source,
                                                      span_begin_bytes, span_end_bytes, device);
  MutexLock lock(&candidate->mu_);
  candidate->held_ = source;
  candidate->keep_restore_ = true;
  return candidate;
}

OffloadedStorage::~OffloadedStorage() { owner_->Discard(entry_, key_); }

void OffloadedStorage::KeepRestore() {
  MutexLock lock(&mu_);
  keep_restore_ = true;
  if (auto restored = restored_.lock()) kept_restore_ = c10::Storage(std::move(restored));
}

c10::Storage OffloadedStorage::Restore(int64_t* span_begin_bytes) {
  MutexLock lock(&mu_);
  if (auto restored = restored_.lock()) {
    // Another view of this storage was restored and is still in use: share it.
    *span_begin_bytes = span_begin_bytes_;
    return c10::Storage(std::move(restored));
  }
  if (entry_ == 0) {
    // A head candidate that stayed (nothing large followed it): its own storage.
    *span_begin_bytes = 0;
    return held_;
  }
  bool resident = false;
  c10::Storage storage = owner_->AcquireStorage(entry_, device_, &resident);
  if (resident) {
    *span_begin_bytes = 0;
  } else {
    restored_ = c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl());
    if (keep_restore_) kept_restore_ = storage;
    *span_begin_bytes = span_begin_bytes_;
  }
  return storage;
}

// ---------------------------------------------------------------------------------------
// TensorOffloader

absl::StatusOr<std::shared_ptr<TensorOffloader>> TensorOffloader::Create(OffloaderConfig config) {
  absl::Status valid = ValidateEngineOptions(EngineOptionsFor(config));
  if (!valid.ok()) return valid;
  if (config.min_offload_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_offload_bytes must be >= 0 (got ", config.min_offload_bytes, ")"));
  }
#ifndef CKPT_OFFLOAD_WITH_CUDA
  if (config.backend == Backend::kCuda) {
    return absl::UnavailableError("backend 'cuda': this build of ckpt_offload has no CUDA support");
  }
#endif
  return std::shared_ptr<TensorOffloader>(new TensorOffloader(config));
}

TensorOffloader::TensorOffloader(OffloaderConfig config) : config_(config) {}

TensorOffloader::~TensorOffloader() {
  // Holders keep the offloader alive, so none is left; drain the engine's copies.
  MutexLock lock(&engine_mu_);
  if (engine_) engine_->Reset().IgnoreError();
}

bool TensorOffloader::MatchesBackend(const at::Tensor& tensor) const {
  switch (config_.backend) {
    case Backend::kCuda:
      return tensor.is_cuda();
    case Backend::kHost:
      return tensor.device().is_cpu();
  }
  return false;
}

std::string TensorOffloader::IneligibleReason(const at::Tensor& tensor) const {
  if (!tensor.defined()) return "undefined tensor";
  if (tensor.layout() != at::kStrided) return "not a strided (dense) tensor";
  if (tensor.is_quantized()) return "quantized tensor";
  if (tensor.is_nested()) return "nested tensor";
  if (tensor.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)) {
    return "tensor subclass (e.g. DTensor)";
  }
  if (!tensor.has_storage()) return "tensor without storage";
  if (tensor.is_conj() || tensor.is_neg()) return "lazily conjugated/negated view";
  // A leaf that requires grad is held by its AccumulateGrad node until backward, so a copy
  // would free nothing (e.g. the embedding output under enable_input_require_grads).
  if (tensor.is_leaf() && tensor.requires_grad())
    return "leaf that requires grad (a parameter, "
           "or held by autograd anyway)";
  if (!MatchesBackend(tensor)) {
    return config_.backend == Backend::kCuda ? "not a CUDA tensor" : "not a CPU tensor";
  }
  if (tensor.numel() == 0) return "empty tensor";
  for (int64_t d = 0; d < tensor.dim(); ++d) {
    if (tensor.stride(d) == 0 && tensor.size(d) > 1) return "expanded view (stride 0)";
  }
  if (static_cast<int64_t>(tensor.nbytes()) < config_.min_offload_bytes) {
    return "smaller than min_offload_bytes";
  }
  return "";
}

StreamHandle TensorOffloader::ComputeStream(const at::Device& device) const {
#ifdef CKPT_OFFLOAD_WITH_CUDA
  if (device.is_cuda()) {
    return reinterpret_cast<StreamHandle>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
  }
#endif
  return 0;
}

OffloadEngine* TensorOffloader::EngineFor(const at::Device& device) {
  // engine_mu_ held by the caller.
  if (engine_) return engine_device_ == device ? engine_.get() : nullptr;
  absl::StatusOr<std::unique_ptr<Device>> made;
  if (config_.backend == Backend::kHost) {
    made = MakeHostDevice();
  } else {
#ifdef CKPT_OFFLOAD_WITH_CUDA
    c10::cuda::CUDAGuard guard(device);
    made = MakeCudaDevice();
#else
    made = absl::UnavailableError("no CUDA support compiled in");
#endif
  }
  if (!made.ok()) ThrowStatus("creating the device", made.status());
  auto engine = OffloadEngine::Create(made->get(), this, EngineOptionsFor(config_));
  if (!engine.ok()) ThrowStatus("creating the engine", engine.status());
  device_ = std::move(*made);
  engine_ = std::move(*engine);
  engine_device_ = device;
  engine_published_.store(engine_.get(), std::memory_order_release);
  if (pending_host_reserve_ > 0) {
    const absl::Status reserved = engine_->ReserveHost(pending_host_reserve_);
    if (!reserved.ok()) {
      TORCH_WARN("ckpt_offload: the host pool was not reserved up front (", pending_host_reserve_,
                 " bytes: ", reserved.ToString(), "); it grows as steps need it");
    }
    pending_host_reserve_ = 0;
  }
  return engine_.get();
}

void TensorOffloader::BeginGroup(const std::vector<at::Tensor>& inputs) {
  {
    MutexLock lock(&tensors_mu_);
    marked_.clear();
    for (const at::Tensor& t : inputs) {
      if (t.defined()) marked_.insert(t.unsafeGetTensorImpl());
    }
  }
  MutexLock lock(&engine_mu_);
  if (!forward_open_.exchange(true)) StartForwardLocked();
  head_.OnGroupBegin();
  group_open_ = false;
  const at::Tensor* first = nullptr;
  for (const at::Tensor& t : inputs) {
    if (t.defined() && MatchesBackend(t)) {
      first = &t;
      break;
    }
  }
  if (first == nullptr) return;  // nothing of ours to offload in this group
  OffloadEngine* engine = EngineFor(first->device());
  if (engine == nullptr) return;
  auto group = engine->BeginGroup(ComputeStream(first->device()));
  if (!group.ok()) ThrowStatus("starting a checkpoint group", group.status());
  group_ = *group;
  group_open_ = true;
  WarnOnFirstFallback(engine);
}

void TensorOffloader::EndGroup() {
  {
    MutexLock lock(&tensors_mu_);
    marked_.clear();
  }
  MutexLock lock(&engine_mu_);
  if (group_open_) head_.OnGroupEnd();
  group_open_ = false;
  // keep_last == 0: the group's copies started as its tensors were packed.
  if (engine_) WarnOnFirstFallback(engine_.get());
}

SavedTensor TensorOffloader::Skip(const at::Tensor& tensor) {
  skipped_.fetch_add(1, std::memory_order_relaxed);
  return Keep(tensor);
}

SavedTensor TensorOffloader::Keep(const at::Tensor& tensor) {
  auto kept = std::make_shared<KeptTensor>();
  // A leaf that is no view holds nothing of a graph; anything else could be an output of
  // the very node saving it, and would hold that node through its grad_fn (a cycle that
  // outlives a dropped graph). detach() shares storage and version counter, nothing else.
  kept->data = tensor.is_leaf() && !tensor.is_view() ? tensor : tensor.detach();
  kept->version = VersionCheck(tensor);
  return {nullptr, std::move(kept)};
}

SavedTensor TensorOffloader::Pack(const at::Tensor& tensor) {
  packed_.fetch_add(1, std::memory_order_relaxed);
  // Tensors saved while a backward runs (a reentrant checkpoint's recompute) stay put:
  // nothing would overlap their copies.
  if (torch::autograd::get_current_graph_task_id() != -1) return Skip(tensor);
  if (config_.scope == Scope::kCheckpointInputs) {
    bool marked = false;
    {
      MutexLock lock(&tensors_mu_);
      marked = marked_.count(tensor.unsafeGetTensorImpl()) > 0;
    }
    if (!marked) return PackUngrouped(tensor);
  }
  if (!IneligibleReason(tensor).empty()) return Skip(tensor);

  const c10::Storage& storage = tensor.storage();
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  const auto [begin, end] = StorageSpan(tensor);
  // Another view of a storage already offloaded: share its copy.
  if (auto shared = SharedView(tensor, begin, end)) return {std::move(shared), nullptr};

  EntryId entry = 0;
  {
    MutexLock lock(&engine_mu_);
    OffloadEngine* engine = EngineFor(tensor.device());
    if (engine == nullptr) return Skip(tensor);  // a second device: left alone
    const StreamHandle compute = ComputeStream(tensor.device());
    GroupId group = group_;
    if (!group_open_) {
      if (config_.scope == Scope::kCheckpointInputs) return Skip(tensor);
      // Scope "all" outside checkpoint groups: each saved tensor is its own group.
      auto made = engine->BeginGroup(compute);
      if (!made.ok()) ThrowStatus("starting a group", made.status());
      group = *made;
    }
    const auto* base = static_cast<const char*>(storage.data());
    const SourceToken token = FileSource(storage);
    auto offer =
        engine->OfferEntry(group, base + begin, static_cast<size_t>(end - begin), token, compute);
    if (!offer.ok()) {
      UnfileSource(token);
      ThrowStatus("offloading a saved tensor", offer.status());
    }
    // Outside checkpoint groups (scope "all") no EndGroup follows: look here.
    if (!group_open_ || !offer->will_offload) WarnOnFirstFallback(engine);
    if (!offer->will_offload) {
      engine->Discard(offer->entry);
      UnfileSource(token);
      return Skip(tensor);
    }
    entry = offer->entry;
    {
      MutexLock lock(&tensors_mu_);
      source_tokens_.emplace(entry, token);
    }
    if (group_open_) head_.NoteGroupEntry(end - begin);
  }
  auto holder = std::make_shared<OffloadedStorage>(shared_from_this(), entry, storage, begin, end,
                                                   tensor.device());
  {
    MutexLock lock(&tensors_mu_);
    by_storage_[key] = holder;
  }
  return {MakePacked(tensor, begin, std::move(holder)), nullptr};
}

SavedTensor TensorOffloader::PackIntoGroup(const at::Tensor& tensor, bool keep_restore) {
  if (torch::autograd::get_current_graph_task_id() != -1) {
    packed_.fetch_add(1, std::memory_order_relaxed);
    return Skip(tensor);
  }
  {
    MutexLock lock(&engine_mu_);
    if (!group_open_) {
      packed_.fetch_add(1, std::memory_order_relaxed);
      return Skip(tensor);
    }
  }
  // Marked for this Pack only (the group's inputs stay marked): once the tensor dies, a
  // later tensor at its address must not pass for a marked one.
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  bool marked_here = false;
  {
    MutexLock lock(&tensors_mu_);
    marked_here = marked_.insert(impl).second;
  }
  absl::Cleanup unmark = [this, impl, marked_here] {
    if (!marked_here) return;
    MutexLock lock(&tensors_mu_);
    marked_.erase(impl);
  };
  SavedTensor saved = Pack(tensor);
  if (keep_restore && saved.packed) saved.packed->storage->KeepRestore();
  return saved;
}

c10::Storage TensorOffloader::AcquireStorage(EntryId entry, const at::Device& device,
                                             bool* resident) {
  // Under the storage's mu_: the engine as published, not engine_mu_ (see the lock order).
  OffloadEngine* engine = PublishedEngine();
  TORCH_CHECK(engine != nullptr, "ckpt_offload: restoring ", entry, " without an engine");
  auto acquired = engine->Acquire(entry, ComputeStream(device));
  if (!acquired.ok()) ThrowStatus("restoring a saved tensor", acquired.status());
  MutexLock lock(&tensors_mu_);
  *resident = acquired->resident;
  if (acquired->resident) {
    auto token = source_tokens_.find(entry);
    auto it = token == source_tokens_.end() ? sources_.end() : sources_.find(token->second);
    TORCH_CHECK(it != sources_.end(), "ckpt_offload: resident tensor ", entry, " was lost");
    return it->second;
  }
  auto it = restores_.find(entry);
  TORCH_CHECK(it != restores_.end(), "ckpt_offload: restore buffer ", entry, " was lost");
  c10::Storage storage = it->second.storage();
  restores_.erase(it);
  return storage;
}

std::shared_ptr<PackedTensor> TensorOffloader::SharedView(const at::Tensor& tensor, int64_t begin,
                                                          int64_t end) {
  MutexLock lock(&tensors_mu_);
  auto it = by_storage_.find(tensor.storage().unsafeGetStorageImpl());
  if (it == by_storage_.end()) return nullptr;
  std::shared_ptr<OffloadedStorage> holder = it->second.lock();
  if (!holder || !holder->Covers(begin, end)) return nullptr;
  shared_hits_.fetch_add(1, std::memory_order_relaxed);
  return MakePacked(tensor, begin, std::move(holder));
}

void TensorOffloader::PackForeign(const at::Tensor& saved, const at::Tensor& held) {
  packed_.fetch_add(1, std::memory_order_relaxed);
  skipped_.fetch_add(1, std::memory_order_relaxed);
  if (config_.scope != Scope::kCheckpointInputs ||
      torch::autograd::get_current_graph_task_id() != -1 || !HeadRelevant(saved)) {
    return;
  }
  // Whether it triggers is decided on the saved tensor: `held` may be its detached alias,
  // which looks made outside autograd.
  std::vector<GroupId> triggered;
  OfferHeadAndTrigger(saved, /*may_offload=*/false, &triggered);
  RegisterTrigger(held.unsafeGetTensorImpl(), std::move(triggered));
}

void TensorOffloader::NoteUnpackForeign(const at::Tensor& held) {
  NoteUnpack(held.unsafeGetTensorImpl());
}

bool TensorOffloader::HeadRelevant(const at::Tensor& tensor) const {
  const int64_t min_bytes = std::max<int64_t>(config_.min_offload_bytes, 1);
  return config_.offload_head && tensor.defined() && tensor.layout() == at::kStrided &&
         tensor.has_storage() && MatchesBackend(tensor) &&
         static_cast<int64_t>(tensor.nbytes()) >= min_bytes;
}

SavedTensor TensorOffloader::PackUngrouped(const at::Tensor& tensor) {
  // Neither a candidate nor a trigger: no head offload, or small, or not ours.
  if (!HeadRelevant(tensor)) return Skip(tensor);
  const auto [begin, end] = StorageSpan(tensor);
  // A view of a candidate's storage is part of it, not its trigger.
  if (auto shared = SharedView(tensor, begin, end)) return {std::move(shared), nullptr};
  std::vector<GroupId> triggered;
  std::shared_ptr<OffloadedStorage> candidate =
      OfferHeadAndTrigger(tensor, /*may_offload=*/true, &triggered);
  if (candidate) {
    RegisterTrigger(candidate.get(), std::move(triggered));
    return {MakePacked(tensor, begin, std::move(candidate)), nullptr};
  }
  SavedTensor kept = Skip(tensor);
  // The kept alias lives as long as the saved handle, so its address is a stable key.
  RegisterTrigger(kept.kept->data.unsafeGetTensorImpl(), std::move(triggered));
  return kept;
}

std::shared_ptr<OffloadedStorage> TensorOffloader::OfferHeadAndTrigger(
    const at::Tensor& tensor, bool may_offload, std::vector<GroupId>* triggered) {
  std::shared_ptr<OffloadedStorage> candidate;
  {
    MutexLock lock(&engine_mu_);
    if (!head_.window_open()) return nullptr;
    // Autograd numbers a node when it makes it, before the node saves its tensors.
    const uint64_t saved_by = at::sequence_number::peek();
    // This tensor triggers the candidates earlier nodes saved: copy them out now; backward
    // restores them when it reaches this tensor, right before their own backward.
    for (const auto& waiting : head_.TakeTriggeredBy(tensor, saved_by)) {
      const GroupId gid = OfferHeadLocked(*waiting);
      if (gid == 0) continue;
      head_.NoteCandidateOffloaded();
      triggered->push_back(gid);
    }
    if (!triggered->empty()) {
      // The trigger's backward will restore the head and, by prefetch, the groups below it:
      // the last keep_last groups need not stay on the device through the head's backward.
      absl::Status started = engine_->OffloadPendingGroups(ComputeStream(engine_device_));
      if (!started.ok()) ThrowStatus("starting a checkpoint group's copies", started);
    }
    const auto [begin, end] = StorageSpan(tensor);
    if (may_offload && head_.MayBecomeCandidate(tensor, end - begin) &&
        IneligibleReason(tensor).empty()) {
      candidate = OffloadedStorage::HeadCandidate(shared_from_this(), tensor.storage(), begin, end,
                                                  tensor.device());
      head_.AddCandidate(candidate, saved_by);
    }
  }
  if (candidate) {
    MutexLock lock(&tensors_mu_);
    by_storage_[tensor.storage().unsafeGetStorageImpl()] = candidate;
  }
  return candidate;
}

void TensorOffloader::RegisterTrigger(const void* trigger_key, std::vector<GroupId> groups) {
  if (groups.empty()) return;
  MutexLock lock(&engine_mu_);
  head_.AddTrigger(trigger_key, std::move(groups));
}

GroupId TensorOffloader::OfferHeadLocked(OffloadedStorage& candidate) {
  const at::Device device = candidate.device();
  OffloadEngine* engine = EngineFor(device);
  if (engine == nullptr) return 0;  // a second device: left alone
  GroupId group_id = 0;
  const EntryId entry =
      candidate.OfferHeld([&](const c10::Storage& source, int64_t begin, int64_t end) -> EntryId {
        auto group = engine->BeginEagerGroup();
        if (!group.ok()) ThrowStatus("starting a head group", group.status());
        const auto* base = static_cast<const char*>(source.data());
        const SourceToken token = FileSource(source);
        auto offer = engine->OfferEntry(*group, base + begin, static_cast<size_t>(end - begin),
                                        token, ComputeStream(device));
        if (!offer.ok()) {
          UnfileSource(token);
          ThrowStatus("offloading a head tensor", offer.status());
        }
        if (!offer->will_offload) {
          engine->Discard(offer->entry);
          UnfileSource(token);
          return 0;  // the arena refused: it stays, held by the candidate
        }
        {
          MutexLock tensors_lock(&tensors_mu_);
          source_tokens_.emplace(offer->entry, token);
        }
        group_id = *group;
        return offer->entry;
      });
  WarnOnFirstFallback(engine);
  return entry == 0 ? 0 : group_id;
}

void TensorOffloader::StartForwardLocked() { head_.StartForward(); }

void TensorOffloader::NoteUnpack(const void* trigger_key) {
  if (forward_open_.load(std::memory_order_acquire) && forward_open_.exchange(false)) {
    MutexLock lock(&engine_mu_);
    head_.OnBackwardBegin();
    if (engine_) {
      absl::Status ended = engine_->EndForward();
      if (!ended.ok()) ThrowStatus("ending the forward", ended);
    }
  }
  if (!MayHaveHeadTriggers()) return;
  MutexLock lock(&engine_mu_);
  const std::vector<GroupId> groups = head_.TakeTrigger(trigger_key);
  if (groups.empty() || !engine_) return;
  for (GroupId gid : groups) {
    absl::Status status = engine_->PrefetchGroup(gid, ComputeStream(engine_device_));
    if (!status.ok()) ThrowStatus("restoring head tensors ahead", status);
  }
}

at::Tensor TensorOffloader::UnpackKept(const KeptTensor& kept) {
  kept.version.Verify(kept.data.sizes(), kept.data.scalar_type(), kept.data.device());
  NoteUnpack(kept.data.unsafeGetTensorImpl());
  return kept.data;
}

at::Tensor TensorOffloader::Unpack(const PackedTensor& packed) {
  packed.version.Verify(packed.sizes, packed.dtype, packed.storage->device());
  NoteUnpack(packed.storage.get());
  int64_t span_begin = 0;
  c10::Storage storage = packed.storage->Restore(&span_begin);
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(packed.dtype));
  const int64_t offset = (packed.storage_offset_bytes - span_begin) / itemsize;
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(packed.dtype).device(storage.device()));
  out.set_(storage, offset, packed.sizes, packed.strides);
  return out;
}

SourceToken TensorOffloader::FileSource(const c10::Storage& storage) {
  MutexLock lock(&tensors_mu_);
  const SourceToken token = next_source_token_++;
  sources_.emplace(token, storage);
  return token;
}

void TensorOffloader::UnfileSource(SourceToken token) {
  MutexLock lock(&tensors_mu_);
  sources_.erase(token);
}

void TensorOffloader::ReleaseSource(EntryId, SourceToken source) {
  MutexLock lock(&tensors_mu_);
  sources_.erase(source);
}

absl::StatusOr<void*> TensorOffloader::AllocateRestore(EntryId entry, size_t bytes) {
  at::Tensor buffer;
  try {
    buffer = at::empty({static_cast<int64_t>(bytes)},
                       at::TensorOptions().dtype(at::kByte).device(engine_device_));
  } catch (const c10::Error& error) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " device bytes to restore into: ", error.what()));
  }
  void* data = buffer.data_ptr();
  MutexLock lock(&tensors_mu_);
  restores_[entry] = std::move(buffer);
  return data;
}

void TensorOffloader::DropRestore(EntryId entry, void*) {
  MutexLock lock(&tensors_mu_);
  restores_.erase(entry);
}

void TensorOffloader::Discard(EntryId entry, const c10::StorageImpl* key) {
  bool source_needed = false;
  if (OffloadEngine* engine = PublishedEngine()) source_needed = engine->Discard(entry);
  MutexLock lock(&tensors_mu_);
  auto token = source_tokens_.find(entry);
  if (token != source_tokens_.end()) {
    // Still needed: ReleaseSource drops it by its token.
    if (!source_needed) sources_.erase(token->second);
    source_tokens_.erase(token);
  }
  auto it = by_storage_.find(key);
  if (it != by_storage_.end() && it->second.expired()) by_storage_.erase(it);
}

void TensorOffloader::BeginStep() {
  MutexLock lock(&engine_mu_);
  const bool forward_unfinished = forward_open_.exchange(false);
  StartForwardLocked();
  // The last forward saw no backward (its loss was dropped, or it was only logged): end it
  // as its backward would have, so its copies drain and whatever its dropped graph held is
  // released now, and the next group starts a new forward.
  if (forward_unfinished && engine_) {
    absl::Status ended = engine_->EndForward();
    if (!ended.ok()) ThrowStatus("ending the previous forward", ended);
  }
}

void TensorOffloader::Reset() {
  absl::Status status = absl::OkStatus();
  {
    MutexLock lock(&engine_mu_);
    group_open_ = false;
    forward_open_.store(false);
    StartForwardLocked();
    if (engine_) status = engine_->Reset();
  }
  {
    MutexLock lock(&tensors_mu_);
    marked_.clear();
    restores_.clear();
  }
  if (!status.ok()) ThrowStatus("draining the offload engine", status);
}

void TensorOffloader::Synchronize() {
  MutexLock lock(&engine_mu_);
  if (!engine_) return;
  absl::Status status = engine_->Synchronize();
  if (!status.ok()) ThrowStatus("synchronizing", status);
}

OffloaderStats TensorOffloader::stats() const {
  OffloaderStats stats;
  {
    MutexLock lock(&engine_mu_);
    if (engine_) stats.engine = engine_->stats();
    stats.head_kept_tensors = head_.kept_tensors();
  }
  stats.packed_tensors = packed_.load();
  stats.skipped_tensors = skipped_.load();
  stats.shared_storage_hits = shared_hits_.load();
  return stats;
}

void TensorOffloader::ResetStats() {
  MutexLock lock(&engine_mu_);
  if (engine_) engine_->ResetStats();
  packed_ = 0;
  skipped_ = 0;
  shared_hits_ = 0;
  head_.ResetStats();
}

bool TensorOffloader::has_engine() const {
  MutexLock lock(&engine_mu_);
  return engine_ != nullptr;
}

void TensorOffloader::WarnOnFirstFallback(OffloadEngine* engine) {
  // engine_mu_ held. One stats() copy per group until the first fallback, nothing after.
  if (warned_fallback_) return;
  const EngineStats stats = engine->stats();
  if (stats.cap_fallbacks == 0) return;
  warned_fallback_ = true;
  TORCH_WARN(
      "ckpt_offload: the host memory pool refused a block (refused by "
      "host_memory_limit = ",
      stats.arena.byte_cap, " bytes: ", stats.arena.cap_rejections,
      " time(s); host allocation failed: ", stats.arena.backend_failures,
      " time(s)), so saved tensors stay on the device "
      "instead of being offloaded. Results are unchanged; device memory use is higher. "
      "stats()['cap_fallbacks'] counts them. Raise host_memory_limit if this is "
      "unexpected. (Warned once per offloader.)");
}

absl::Status TensorOffloader::ReserveHost(uint64_t bytes) {
  MutexLock lock(&engine_mu_);
  if (!engine_) {
    pending_host_reserve_ = std::max(pending_host_reserve_, bytes);
    return absl::OkStatus();
  }
  return engine_->ReserveHost(bytes);
}

void TensorOffloader::SetPrefetchOnAcquire(bool on) {
  MutexLock lock(&engine_mu_);
  config_.prefetch_on_acquire = on;
  if (engine_) engine_->SetPrefetchOnAcquire(on);
}

void TensorOffloader::PrefetchAhead() {
  // From backward, like the restores: the published engine, without engine_mu_.
  OffloadEngine* engine = PublishedEngine();
  if (engine == nullptr) return;
  const absl::Status status = engine->PrefetchBelowAcquired(ComputeStream(engine_device_));
  if (!status.ok()) ThrowStatus("prefetching the next layers' inputs", status);
}

void TensorOffloader::SetHostMemoryLimit(uint64_t bytes) {
  MutexLock lock(&engine_mu_);
  config_.host_memory_limit = bytes;
  if (engine_) engine_->arena().SetByteCap(bytes);
}

}  // namespace ckpt_offload::torch_plugin
