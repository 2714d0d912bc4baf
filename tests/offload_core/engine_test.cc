// Tests for OffloadEngine on SimDevice.
//
// A harness plays checkpointed training steps against the engine: forward saves each
// layer's input (BeginGroup + OfferEntry, then the layer's compute), backward walks the
// layers in reverse (Acquire, the layer's backward compute, Discard). The simulated device
// checks the schedule's invariants from engine.h: no hazards, bytes that round-trip intact,
// and timing (exposed wait) that matches what bytes and bandwidth predict.
#include "offload_core/engine.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "offload_core/fault_injection.h"
#include "offload_core/sim_device.h"

namespace ckpt_offload {
namespace {

// Fill values that no pattern buffer matches as a whole: a restore buffer before its copy
// lands, and a source after the engine (or the caller) let go of it.
constexpr uint8_t kRestoreFill = 0xCD;
constexpr uint8_t kReleasedFill = 0xEE;

// A byte pattern unique to `tag` that also varies along the buffer, so a stale, shifted or
// swapped buffer never matches.
uint8_t PatternByte(int64_t tag, size_t i) {
  uint32_t x = static_cast<uint32_t>(tag) * 2654435761u + static_cast<uint32_t>(i) * 40503u;
  x ^= x >> 13;
  return static_cast<uint8_t>(x ^ (x >> 7));
}

void FillPattern(void* data, size_t bytes, int64_t tag) {
  auto* out = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) out[i] = PatternByte(tag, i);
}

// Index of the first byte that differs from the pattern, or -1.
int64_t FirstMismatch(const void* data, size_t bytes, int64_t tag) {
  const auto* in = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (in[i] != PatternByte(tag, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

std::string HazardReport(const SimDevice& sim) {
  std::string out;
  for (const SimDevice::Hazard& hazard : sim.hazards()) {
    absl::StrAppend(&out, "\n  ", SimDevice::HazardName(hazard.kind), " at ", hazard.time_us,
                    " us: ", hazard.detail);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// What the engine sees of the SimDevice: every call passes through, except that a chosen
// later copy can be made to fail. fault_injection.h can only fail the very next copy, which
// always begins a batch; this reaches the middle of one (copies already queued).
class CopyFailingDevice : public Device {
 public:
  explicit CopyFailingDevice(SimDevice* sim) : sim_(sim) {}

  // The copy after `skip` more successful ones fails (d2h and h2d counted together).
  void FailCopyAfter(int skip) {
    std::lock_guard<std::mutex> lock(mu_);
    copies_until_failure_ = skip;
  }
  // The next event record on `stream` fails (fault_injection.h would fail the next record on
  // any stream, and the compute stream is recorded on before every copy batch).
  void FailNextRecordOn(StreamHandle stream) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_record_on_ = stream;
  }

  const char* name() const override { return "sim (copy-failing)"; }
  StreamHandle d2h_stream() const override { return sim_->d2h_stream(); }
  StreamHandle h2d_stream() const override { return sim_->h2d_stream(); }
  absl::StatusOr<EventHandle> CreateEvent() override { return sim_->CreateEvent(); }
  void DestroyEvent(EventHandle event) override { sim_->DestroyEvent(event); }
  absl::Status RecordEvent(EventHandle event, StreamHandle stream) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fail_record_on_ == stream) {
        fail_record_on_ = kNoStream;
        return absl::InternalError("copy-failing device: record failed");
      }
    }
    return sim_->RecordEvent(event, stream);
  }
  absl::Status StreamWaitEvent(StreamHandle stream, EventHandle event) override {
    return sim_->StreamWaitEvent(stream, event);
  }
  absl::StatusOr<bool> EventDone(EventHandle event) override { return sim_->EventDone(event); }
  absl::Status SynchronizeEvent(EventHandle event) override {
    return sim_->SynchronizeEvent(event);
  }
  absl::StatusOr<double> ElapsedMs(EventHandle start, EventHandle end) override {
    return sim_->ElapsedMs(start, end);
  }
  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                          StreamHandle stream) override {
    if (ShouldFail()) return absl::InternalError("copy-failing device: d2h copy failed");
    return sim_->CopyToHost(host_dst, device_src, bytes, stream);
  }
  absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                            StreamHandle stream) override {
    if (ShouldFail()) return absl::InternalError("copy-failing device: h2d copy failed");
    return sim_->CopyToDevice(device_dst, host_src, bytes, stream);
  }
  std::unique_ptr<HostMemoryBackend> MakeHostBackend() override { return sim_->MakeHostBackend(); }
  void OnHostBlockFreed(const void* host, size_t bytes) override {
    sim_->OnHostBlockFreed(host, bytes);
  }
  void OnDeviceSourceReleased(const void* device, size_t bytes) override {
    sim_->OnDeviceSourceReleased(device, bytes);
  }

 private:
  bool ShouldFail() {
    std::lock_guard<std::mutex> lock(mu_);
    if (copies_until_failure_ < 0) return false;
    return copies_until_failure_-- == 0;
  }

  SimDevice* sim_;
  std::mutex mu_;
  int copies_until_failure_ = -1;  // < 0: never
  static constexpr StreamHandle kNoStream = ~StreamHandle{0};
  StreamHandle fail_record_on_ = kNoStream;
};

// ---------------------------------------------------------------------------------------
// The caller side: sources (layer inputs), restore buffers and what the engine did to them.
// Thread-safe; never calls into the engine (the engine calls it with its lock held).
class SimClient : public OffloadEngine::Client {
 public:
  explicit SimClient(SimDevice* sim) : sim_(sim) {}
  ~SimClient() override {
    for (auto& [entry, source] : sources_) sim_->FreeDeviceBuffer(source.data);
    for (auto& [data, restore] : restores_) sim_->FreeDeviceBuffer(data);
  }

  // A new layer input of `bytes` holding the pattern of `tag`.
  void* NewSource(size_t bytes, int64_t tag) {
    void* data = sim_->AllocateDeviceBuffer(bytes);
    FillPattern(data, bytes, tag);
    return data;
  }

  // Files a source before it is offered; the token goes to OfferEntry, which may release
  // it before returning (another thread's call can poll the copy's completion first).
  SourceToken FileSource(void* data, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const SourceToken token = next_token_++;
    Source& source = sources_[token];
    source.data = data;
    source.bytes = bytes;
    return token;
  }
  // OfferEntry failed: the source was never the engine's (the caller frees it).
  void UnfileSource(SourceToken token) {
    std::lock_guard<std::mutex> lock(mu_);
    sources_.erase(token);
  }
  // Called right after OfferEntry: the entry the engine named for the filed source.
  void Bind(EntryId entry, SourceToken token) {
    std::lock_guard<std::mutex> lock(mu_);
    token_of_[entry] = token;
    sources_.at(token).entry = entry;
  }

  // The caller's own handle is gone and Discard returned false: the memory is the
  // caller's to reuse, which the fill imitates.
  void CallerDropped(EntryId entry) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sources_.find(TokenOf(entry));
    if (it == sources_.end()) return;
    it->second.dropped = true;
    std::memset(it->second.data, kReleasedFill, it->second.bytes);
  }

  // The caller took a restored buffer from Acquire; it now owns it.
  bool TakeRestore(EntryId entry, void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = restores_.find(data);
    if (it == restores_.end() || it->second.entry != entry) return false;
    restores_.erase(it);
    return true;
  }

  // Frees every source the engine and the caller are both done with.
  void FreeSettledSources() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sources_.begin(); it != sources_.end();) {
      if (it->second.released || it->second.dropped) {
        sim_->FreeDeviceBuffer(it->second.data);
        it = sources_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Entries whose source was neither released by the engine nor dropped by the caller.
  std::vector<EntryId> UnsettledSources() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<EntryId> out;
    for (const auto& [token, source] : sources_) {
      if (!source.released && !source.dropped) out.push_back(source.entry);
    }
    return out;
  }
  bool Released(EntryId entry) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sources_.find(TokenOf(entry));
    return it != sources_.end() && it->second.released;
  }
  size_t outstanding_restores() const {
    std::lock_guard<std::mutex> lock(mu_);
    return restores_.size();
  }
  int64_t dropped_restores() const {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_restores_;
  }
  // Every AllocateRestore that handed out a buffer (a second device buffer for an entry).
  int64_t allocated_restores() const {
    std::lock_guard<std::mutex> lock(mu_);
    return allocated_restores_;
  }
  // ReleaseSource calls in order, with the host time each came at.
  struct Release {
    EntryId entry;
    double host_time_us;
  };
  std::vector<Release> release_log() const {
    std::lock_guard<std::mutex> lock(mu_);
    return release_log_;
  }
  std::vector<std::string> errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }

  // --- OffloadEngine::Client ---
  void ReleaseSource(EntryId entry, SourceToken token) override {
    const double now_us = sim_->host_time_us();
    std::lock_guard<std::mutex> lock(mu_);
    release_log_.push_back({entry, now_us});
    auto it = sources_.find(token);
    if (it == sources_.end()) {
      errors_.push_back(absl::StrCat("entry ", entry,
                                     ": ReleaseSource of a source never "
                                     "filed (token ",
                                     token, ")"));
      return;
    }
    ReleaseLocked(entry, it->second);
  }
  absl::StatusOr<void*> AllocateRestore(EntryId entry, size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (allocations_until_failure_ >= 0 && allocations_until_failure_-- == 0) {
        return absl::ResourceExhaustedError("test client: device memory exhausted");
      }
    }
    void* data = sim_->AllocateDeviceBuffer(bytes);
    std::memset(data, kRestoreFill, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    restores_[data] = Restore{entry, bytes};
    allocated_restores_++;
    return data;
  }
  // The restore allocation after `skip` more successful ones fails.
  void FailRestoreAllocationAfter(int skip) {
    std::lock_guard<std::mutex> lock(mu_);
    allocations_until_failure_ = skip;
  }
  void DropRestore(EntryId entry, void* data) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = restores_.find(data);
      if (it == restores_.end() || it->second.entry != entry) {
        errors_.push_back(absl::StrCat("entry ", entry,
                                       ": DropRestore of a buffer it does "
                                       "not own"));
        return;
      }
      restores_.erase(it);
      dropped_restores_++;
    }
    sim_->FreeDeviceBuffer(data);
  }

 private:
  struct Source {
    void* data = nullptr;
    size_t bytes = 0;
    EntryId entry = 0;      // 0 until Bind
    bool released = false;  // ReleaseSource came
    bool dropped = false;   // the caller let go (Discard returned false)
  };
  struct Restore {
    EntryId entry;
    size_t bytes;
  };

  void ReleaseLocked(EntryId entry, Source& source) {
    if (source.released) {
      errors_.push_back(absl::StrCat("entry ", entry, ": ReleaseSource called twice"));
    }
    if (source.dropped) {
      errors_.push_back(absl::StrCat("entry ", entry,
                                     ": ReleaseSource after the caller "
                                     "dropped it (Discard returned false)"));
    }
    source.released = true;
    // Nothing may read a released source again: overwrite it like reused memory would be.
    std::memset(source.data, kReleasedFill, source.bytes);
  }

  // mu_ held. 0 (no source has it) for an entry never bound.
  SourceToken TokenOf(EntryId entry) const {
    auto it = token_of_.find(entry);
    return it == token_of_.end() ? 0 : it->second;
  }

  SimDevice* sim_;
  mutable std::mutex mu_;
  std::map<SourceToken, Source> sources_;  // by the token each was offered with
  std::map<EntryId, SourceToken> token_of_;
  SourceToken next_token_ = 1;
  std::map<void*, Restore> restores_;
  int64_t dropped_restores_ = 0;
  int64_t allocated_restores_ = 0;
  std::vector<Release> release_log_;
  int allocations_until_failure_ = -1;  // < 0: never
  std::vector<std::string> errors_;
};

// ---------------------------------------------------------------------------------------
// One step's shape: bytes of each saved tensor, per layer, and per-layer compute times.
struct StepPlan {
  std::vector<std::vector<size_t>> entry_bytes;  // [layer][entry]
  double forward_us = 20;
  double backward_us = 40;

  int layers() const { return static_cast<int>(entry_bytes.size()); }
  size_t group_bytes(int layer) const {
    size_t total = 0;
    for (size_t bytes : entry_bytes[layer]) total += bytes;
    return total;
  }
};

StepPlan UniformPlan(int layers, size_t bytes, int entries_per_layer, double forward_us,
                     double backward_us) {
  StepPlan plan;
  plan.entry_bytes.assign(layers, std::vector<size_t>(entries_per_layer, bytes));
  plan.forward_us = forward_us;
  plan.backward_us = backward_us;
  return plan;
}

struct SavedTensor {
  EntryId entry = 0;  // 0 once discarded
  int64_t tag = 0;
  void* source = nullptr;
  size_t bytes = 0;
};
using SavedLayers = std::vector<std::vector<SavedTensor>>;

// A restored buffer the backward consumed; its bytes are checked once the device drained.
struct Consumed {
  int64_t tag;
  void* data;
  size_t bytes;
};

class EngineHarness {
 public:
  explicit EngineHarness(EngineOptions options, SimDeviceOptions sim_options = {})
      : sim_(sim_options), device_(&sim_), client_(&sim_), compute_(sim_.CreateStream()) {
    absl::StatusOr<std::unique_ptr<OffloadEngine>> engine =
        OffloadEngine::Create(&device_, &client_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (engine.ok()) engine_ = std::move(*engine);
  }
  ~EngineHarness() {
    if (engine_) engine_->Reset().IgnoreError();
    sim_.SynchronizeAll().IgnoreError();
    for (const Consumed& c : consumed_) sim_.FreeDeviceBuffer(c.data);
    engine_.reset();
  }

  SimDevice& sim() { return sim_; }
  CopyFailingDevice& device() { return device_; }
  SimClient& client() { return client_; }
  OffloadEngine& engine() { return *engine_; }
  StreamHandle compute() const { return compute_; }
  // Since the harness was made: Acquires that returned resident (the caller's own source)
  // in Backward, and restored buffers DrainAndCheck verified.
  int64_t resident_uses() const { return resident_uses_; }
  size_t checked_total() const { return checked_total_; }

  // Forward of `plan` as step `step`, appending to `saved`, for at most `max_layers`.
  absl::Status Forward(const StepPlan& plan, int step, SavedLayers* saved,
                       int max_layers = 1 << 30) {
    for (int layer = 0; layer < plan.layers() && layer < max_layers; ++layer) {
      absl::StatusOr<GroupId> group = engine_->BeginGroup(compute_);
      if (!group.ok()) return group.status();
      std::vector<SavedTensor> tensors;
      std::vector<SimBufferRef> reads;
      for (size_t i = 0; i < plan.entry_bytes[layer].size(); ++i) {
        SavedTensor tensor;
        tensor.bytes = plan.entry_bytes[layer][i];
        tensor.tag = (int64_t{step} * 1000 + layer) * 16 + static_cast<int64_t>(i);
        tensor.source = client_.NewSource(tensor.bytes, tensor.tag);
        const SourceToken token = client_.FileSource(tensor.source, tensor.bytes);
        absl::StatusOr<OffloadEngine::Offer> offer =
            engine_->OfferEntry(*group, tensor.source, tensor.bytes, token, compute_);
        if (!offer.ok()) {
          client_.UnfileSource(token);
          sim_.FreeDeviceBuffer(tensor.source);
          saved->push_back(std::move(tensors));
          return offer.status();
        }
        tensor.entry = offer->entry;
        client_.Bind(tensor.entry, token);
        reads.push_back({tensor.source, tensor.bytes});
        tensors.push_back(tensor);
      }
      saved->push_back(std::move(tensors));
      // The layer reads its inputs (and writes the next layer's, which already hold their
      // pattern: the sim's compute moves no bytes).
      sim_.Compute(compute_, plan.forward_us, reads, absl::StrCat("fwd", layer));
    }
    return absl::OkStatus();
  }

  // Backward over `saved` in reverse, for at most `max_layers` not yet consumed layers.
  // `discard`: the saved-tensor handles die after use (false: a retained graph).
  absl::Status Backward(SavedLayers* saved, double backward_us, bool discard = true,
                        int max_layers = 1 << 30) {
    int done = 0;
    for (int layer = static_cast<int>(saved->size()) - 1; layer >= 0 && done < max_layers;
         --layer) {
      std::vector<SavedTensor>& tensors = (*saved)[layer];
      bool any = false;
      std::vector<SimBufferRef> reads;
      for (SavedTensor& tensor : tensors) {
        if (tensor.entry == 0) continue;
        any = true;
        absl::StatusOr<OffloadEngine::Acquired> acquired = engine_->Acquire(tensor.entry, compute_);
        if (!acquired.ok()) return acquired.status();
        if (acquired->resident) {
          // The caller's own source: it must still hold the data right now.
          const int64_t bad = FirstMismatch(tensor.source, tensor.bytes, tensor.tag);
          EXPECT_EQ(bad, -1) << "resident entry " << tensor.entry << " (tag " << tensor.tag
                             << ") differs at byte " << bad;
          EXPECT_FALSE(client_.Released(tensor.entry))
              << "entry " << tensor.entry << " is resident but its source was released";
          reads.push_back({tensor.source, tensor.bytes});
          resident_uses_++;
        } else {
          EXPECT_NE(acquired->device_data, nullptr);
          EXPECT_TRUE(client_.TakeRestore(tensor.entry, acquired->device_data))
              << "entry " << tensor.entry << ": Acquire returned a buffer the client did not "
              << "allocate for it";
          consumed_.push_back({tensor.tag, acquired->device_data, tensor.bytes});
          reads.push_back({acquired->device_data, tensor.bytes});
        }
      }
      if (!any) continue;
      sim_.Compute(compute_, backward_us, reads, absl::StrCat("bwd", layer));
      if (discard) {
        for (SavedTensor& tensor : tensors) {
          if (tensor.entry == 0) continue;
          if (!engine_->Discard(tensor.entry)) client_.CallerDropped(tensor.entry);
          tensor.entry = 0;
        }
      }
      ++done;
    }
    return absl::OkStatus();
  }

  // Drains the device and checks every consumed restore's bytes, then frees them and the
  // settled sources. Returns the number of buffers checked.
  size_t DrainAndCheck() {
    EXPECT_TRUE(sim_.SynchronizeAll().ok());
    EXPECT_TRUE(engine_->Synchronize().ok());
    const size_t checked = consumed_.size();
    checked_total_ += checked;
    for (const Consumed& c : consumed_) {
      const int64_t bad = FirstMismatch(c.data, c.bytes, c.tag);
      EXPECT_EQ(bad, -1) << "restored tag " << c.tag << " differs at byte " << bad;
      sim_.FreeDeviceBuffer(c.data);
    }
    consumed_.clear();
    client_.FreeSettledSources();
    return checked;
  }

  // Forward + backward + drain: the whole step.
  void RunStep(const StepPlan& plan, int step) {
    SavedLayers saved;
    ASSERT_TRUE(Forward(plan, step, &saved).ok());
    ASSERT_TRUE(Backward(&saved, plan.backward_us).ok());
    DrainAndCheck();
  }

  // What must hold whenever nothing is in use: no hazards, no client misuse, every source
  // settled, no restore outstanding, no host block or device byte held.
  void ExpectQuiescent() {
    EXPECT_TRUE(sim_.hazards().empty()) << HazardReport(sim_);
    for (const std::string& error : client_.errors()) ADD_FAILURE() << error;
    EXPECT_TRUE(client_.UnsettledSources().empty())
        << client_.UnsettledSources().size() << " sources neither released nor dropped";
    EXPECT_EQ(client_.outstanding_restores(), 0u);
    const EngineStats stats = engine_->stats();
    EXPECT_EQ(stats.arena.live_bytes, 0u);
    EXPECT_EQ(stats.arena.live_blocks, 0);
    EXPECT_EQ(stats.device_held_bytes, 0u);
  }

 private:
  SimDevice sim_;
  CopyFailingDevice device_;
  SimClient client_;
  StreamHandle compute_;
  std::unique_ptr<OffloadEngine> engine_;
  std::vector<Consumed> consumed_;
  int64_t resident_uses_ = 0;
  size_t checked_total_ = 0;
};

EngineOptions Options(int keep_last, int prefetch_depth, int max_inflight = 2) {
  EngineOptions options;
  options.keep_last = keep_last;
  options.prefetch_depth = prefetch_depth;
  options.max_inflight_d2h_groups = max_inflight;
  return options;
}

// 550,000 bytes at 55 GB/s take exactly 10 us: copy times below are round numbers.
constexpr size_t kTenMicrosecondBytes = 550000;

double CopyUs(size_t bytes, double gbps) { return static_cast<double>(bytes) / (gbps * 1e3); }

// Groups that one harness step reclaims: Forward, then Backward right away (no host
// synchronization between them), starting on an idle device, with every group of the step
// offloaded (no cap fallback).
// - In forward the host blocks only in the in-flight bound: before a group's copies start
//   while max_inflight groups are copying, it waits for the oldest of them. The groups issued
//   after that one copy later on the same FIFO D2H stream, each for > 0 us, so none of them
//   has finished when the host wakes. Forward therefore ends with exactly
//   min(max_inflight, offloaded groups) groups copying (all of them when there are no more
//   than max_inflight: then the host never waited, and every copy takes > 0 us).
// - No engine call of backward blocks the host, so on SimDevice all of backward is issued at
//   the host time forward ended at. Every offloaded group is touched by backward (acquired,
//   or earlier by a prefetch window), so those groups are still copying when backward first
//   asks for them, and are reclaimed, every entry of them.
// - prefetch_depth == 0: the first Acquire waits for those copies instead; none is reclaimed.
int64_t ReclaimedGroupsOfOneStep(int64_t offloaded_groups, int prefetch_depth, int max_inflight) {
  if (prefetch_depth == 0) return 0;
  return std::min<int64_t>(max_inflight, offloaded_groups);
}

class EngineTest : public ::testing::Test {
 protected:
  void TearDown() override { faults::ClearAll(); }
};

// ---------------------------------------------------------------------------------------
// keep_last x prefetch_depth: the invariants of every schedule.

struct MatrixParam {
  int keep_last;
  int prefetch_depth;
};

class EngineScheduleMatrix : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(EngineScheduleMatrix, ThreeStepsAreHazardFreeIntactAndCounted) {
  const MatrixParam param = GetParam();
  const int kLayers = 6;
  EngineHarness harness(Options(param.keep_last, param.prefetch_depth));
  ASSERT_NE(&harness.engine(), nullptr);
  // Compute-bound, copy-bound (copies 10 us, compute 3 / 2 us), compute-bound again.
  const StepPlan plans[] = {
      UniformPlan(kLayers, kTenMicrosecondBytes, 1, 20, 40),
      UniformPlan(kLayers, kTenMicrosecondBytes, 1, 3, 2),
      UniformPlan(kLayers, kTenMicrosecondBytes, 1, 20, 40),
  };
  // One entry per layer: groups and entries count alike.
  const int64_t kept = std::min(param.keep_last, kLayers);
  const int64_t offloaded = kLayers - kept;
  // With prefetch the max_inflight (2) groups still copying when forward ends are reclaimed,
  // in all three regimes (see ReclaimedGroupsOfOneStep).
  const int64_t reclaimed = ReclaimedGroupsOfOneStep(offloaded, param.prefetch_depth, 2);
  const int64_t restored = offloaded - reclaimed;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    harness.engine().ResetStats();
    const int64_t resident_before = harness.resident_uses();
    const size_t checked_before = harness.checked_total();
    harness.RunStep(plans[step], step);
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.groups, kLayers);
    EXPECT_EQ(stats.kept_resident_tensors, kept);
    EXPECT_EQ(stats.offloaded_tensors, offloaded);
    EXPECT_EQ(stats.offloaded_bytes, offloaded * kTenMicrosecondBytes);
    EXPECT_EQ(stats.reclaimed_tensors, reclaimed);
    EXPECT_EQ(stats.restored_tensors, restored);
    EXPECT_EQ(stats.restored_tensors + stats.reclaimed_tensors, stats.offloaded_tensors);
    EXPECT_EQ(stats.restored_bytes, restored * kTenMicrosecondBytes);
    // With prefetch every restore is a prefetch, keep_last == 0 included: the first group
    // backward needs (the last one) is still copying, so it is reclaimed, not fetched.
    EXPECT_EQ(stats.prefetched_tensors, param.prefetch_depth == 0 ? 0 : restored);
    EXPECT_EQ(stats.cap_fallbacks, 0);
    // Backward used the caller's source for kept and reclaimed entries, a restored buffer
    // (checked byte for byte) for every other one.
    EXPECT_EQ(harness.resident_uses() - resident_before, kept + reclaimed);
    EXPECT_EQ(harness.checked_total() - checked_before, static_cast<size_t>(restored));
  }
  // Reclaim skips the H2D copy only: every D2H copy still ran.
  EXPECT_EQ(harness.sim().bytes_copied_to_host(), 3 * offloaded * kTenMicrosecondBytes);
  EXPECT_EQ(harness.sim().bytes_copied_to_device(), 3 * restored * kTenMicrosecondBytes);
  EXPECT_EQ(harness.client().allocated_restores(), 3 * restored);
}

INSTANTIATE_TEST_SUITE_P(KeepLastByPrefetch, EngineScheduleMatrix,
                         ::testing::Values(MatrixParam{0, 0}, MatrixParam{0, 1}, MatrixParam{0, 2},
                                           MatrixParam{1, 0}, MatrixParam{1, 1}, MatrixParam{1, 2},
                                           MatrixParam{2, 0}, MatrixParam{2, 1}, MatrixParam{2, 2}),
                         [](const ::testing::TestParamInfo<MatrixParam>& info) {
                           return absl::StrCat("KeepLast", info.param.keep_last, "Prefetch",
                                               info.param.prefetch_depth);
                         });

// ---------------------------------------------------------------------------------------
// Exposed wait.
//
// Timing model of the runs below (L layers, N = keep_last, P = prefetch_depth, one entry of
// B bytes per layer, C = B / h2d bandwidth = 10 us, forward compute F = 20 us >= C, backward
// Bk, max_inflight 2; T0 = L * F, when forward's compute ends):
// - Forward hides every D2H copy: group i's copy starts after the compute queued when it is
//   issued and takes C <= F. The host blocks only in the in-flight bound, last for the copy
//   of group L - N - 3, until (L - 3) * F + C (its copy starts at (L - 3) * F, N or not), and
//   the two highest offloaded groups, L - N - 2 and L - N - 1, are still copying then (see
//   ReclaimedGroupsOfOneStep).
// - P >= 1: backward is issued at that host time and reclaims those two groups: no restore,
//   no wait. G = L - N - 2 groups are restored.
// - P == 0: the first Acquire waits for the forward's copies instead. The last one ends at
//   (L - 1) * F + C <= T0, before forward's compute does, so this wait costs the compute
//   stream nothing. Each restore then starts only when backward reaches its layer: every
//   offloaded layer waits C. Exposed = (L - N) * C.
// - P >= 1 and Bk >= C: every restore overlaps the backward of a layer above it. Exposed = 0,
//   keep_last == 0 included: the last layer, whose restore used to have nothing to overlap
//   with, is reclaimed. Only when the host synchronized before backward (every copy done,
//   nothing to reclaim) does that layer's on-demand restore stay exposed: C.
// - P >= 1 and copy-bound (Bk < C): let Acquire(a) be the first Acquire that issues an H2D
//   copy. The copy is queued after the compute issued so far, the backward of layers
//   L-1 .. a+1, so it starts at T1 = T0 + (L - 1 - a) * Bk; the G restores then run back to
//   back (each later one is issued after compute that ended before the previous copy ends),
//   and layer 0's backward, waiting for the last of them (C > Bk), ends at
//   T1 + G * C + Bk. Exposed = that - T0 - L * Bk = G * C - a * Bk. (A restored layer high
//   up may not wait at all, e.g. N = 2, P = 2: its copy started early; the sum still holds.)
//   Which Acquire that is: a prefetch window takes the next P groups below the acquired one
//   that still wait for a restore (kept groups and groups already reclaimed are skipped), and
//   a group it reclaims uses up its place. So the windows of the Acquires from the top
//   reclaim the still-copying groups, P per Acquire, until the first group to restore falls
//   into one. They meet W still-copying groups before it: W = 2, or W = 1 with N = 0 (there
//   Acquire(L-1) reclaims group L-1 itself). The first group to restore is the (W + 1)-th
//   one met, in the window of the ceil((W + 1) / P)-th Acquire: a = L - ceil((W + 1) / P).
//   E.g. N = 1, P = 1, L = 8: Acquire(7) reclaims 6, Acquire(6) reclaims 5, Acquire(5)
//   prefetches 4: a = 5, G = 5, exposed = 5 * C - 5 * Bk.
//   The test checks the model's premises on the simulated timeline: G copies, the first
//   starting at T1, each next one starting when the previous ends, and layer 0's backward
//   starting when the last one ends.

struct ExposureRun {
  double blocked_us;      // what the simulated compute stream sat waiting
  double engine_wait_us;  // what the engine measured (stats().exposed_wait_ms)
  double copy_us;
  EngineStats stats;
  std::vector<SimDevice::TimelineEntry> timeline;
};

// One step; `sync_before_backward`: the host waits for the device between forward and
// backward (as after reading the loss), so every forward copy is done when backward starts.
ExposureRun RunExposure(int layers, int keep_last, int prefetch, double forward_us,
                        double backward_us, bool sync_before_backward = false) {
  SimDeviceOptions sim_options;  // 55 / 55 / 97 GB/s, no latency
  EngineHarness harness(Options(keep_last, prefetch), sim_options);
  harness.engine().ResetStats();
  const StepPlan plan = UniformPlan(layers, kTenMicrosecondBytes, 1, forward_us, backward_us);
  SavedLayers saved;
  EXPECT_TRUE(harness.Forward(plan, 0, &saved).ok());
  if (sync_before_backward) {
    EXPECT_TRUE(harness.sim().SynchronizeAll().ok());
  }
  EXPECT_TRUE(harness.Backward(&saved, plan.backward_us).ok());
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
  const EngineStats stats = harness.engine().stats();
  EXPECT_EQ(stats.restored_tensors + stats.reclaimed_tensors, stats.offloaded_tensors);
  return ExposureRun{harness.sim().blocked_us(harness.compute()), stats.exposed_wait_ms * 1e3,
                     CopyUs(kTenMicrosecondBytes, sim_options.h2d_gbps), stats,
                     harness.sim().timeline()};
}

void ExpectNear(double actual, double expected, const std::string& what) {
  // The simulation is exact up to floating-point rounding.
  EXPECT_NEAR(actual, expected, 1e-3 + 1e-6 * expected) << what;
}

TEST_F(EngineTest, ExposedWaitIsZeroWhenComputeHidesCopies) {
  const int kLayers = 8;
  for (int keep_last : {1, 2}) {
    for (int prefetch : {1, 2}) {
      for (bool sync : {false, true}) {
        SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch,
                                  " sync_before_backward=", sync));
        const ExposureRun run = RunExposure(kLayers, keep_last, prefetch, 20, 15, sync);
        ASSERT_LT(run.copy_us, 15);
        ExpectNear(run.blocked_us, 0, "sim blocked_us(compute)");
        ExpectNear(run.engine_wait_us, 0, "stats().exposed_wait_ms");
        // Without the sync the two groups still copying when forward ends are reclaimed.
        EXPECT_EQ(run.stats.reclaimed_tensors, sync ? 0 : 2);
        EXPECT_EQ(run.stats.restored_tensors, kLayers - keep_last - (sync ? 0 : 2));
      }
    }
  }
}

TEST_F(EngineTest, ExposedWaitWithKeepLastZeroIsHiddenByReclaimingTheLastLayers) {
  // Nothing stays resident, but backward starts while layers 7 and 6 are still copying out:
  // both are reclaimed, and layer 5's restore, prefetched at Acquire(6), overlaps layer 7's
  // backward (Bk = 15 >= C).
  const ExposureRun run = RunExposure(8, /*keep_last=*/0, /*prefetch=*/1, 20, 15);
  ASSERT_LT(run.copy_us, 15);
  EXPECT_EQ(run.stats.reclaimed_tensors, 2);
  EXPECT_EQ(run.stats.restored_tensors, 6);
  ExpectNear(run.blocked_us, 0, "sim blocked_us(compute)");
  ExpectNear(run.engine_wait_us, 0, "stats().exposed_wait_ms");
}

TEST_F(EngineTest, ExposedWaitWithKeepLastZeroAfterAHostSyncIsTheFirstBackwardCopy) {
  // Every copy finished before backward: nothing to reclaim, and the last layer's restore,
  // issued by its own Acquire, has no backward to overlap with.
  const ExposureRun run = RunExposure(8, /*keep_last=*/0, /*prefetch=*/1, 20, 15,
                                      /*sync_before_backward=*/true);
  EXPECT_EQ(run.stats.reclaimed_tensors, 0);
  EXPECT_EQ(run.stats.restored_tensors, 8);
  ExpectNear(run.blocked_us, run.copy_us, "sim blocked_us(compute)");
  ExpectNear(run.engine_wait_us, run.copy_us, "stats().exposed_wait_ms");
}

TEST_F(EngineTest, ExposedWaitWithoutPrefetchIsEveryCopy) {
  const int kLayers = 8;
  for (int keep_last : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    const ExposureRun run = RunExposure(kLayers, keep_last, /*prefetch=*/0, 20, 15);
    const double expected = (kLayers - keep_last) * run.copy_us;
    EXPECT_GT(expected, 0);
    ExpectNear(run.blocked_us, expected, "sim blocked_us(compute)");
    ExpectNear(run.engine_wait_us, expected, "stats().exposed_wait_ms");
    // The first Acquire drained the forward copies: every offloaded layer is restored.
    EXPECT_EQ(run.stats.reclaimed_tensors, 0);
    EXPECT_EQ(run.stats.restored_tensors, kLayers - keep_last);
  }
}

TEST_F(EngineTest, ExposedWaitMatchesCopyBoundPrediction) {
  const int kLayers = 8;
  const int kCopying = 2;        // groups still copying when forward ends (max_inflight)
  const double kBackwardUs = 4;  // < C = 10 us: the copies cannot keep up
  for (const MatrixParam param : {MatrixParam{0, 1}, MatrixParam{0, 2}, MatrixParam{1, 1},
                                  MatrixParam{1, 2}, MatrixParam{2, 1}, MatrixParam{2, 2}}) {
    const int n = param.keep_last;
    const int p = param.prefetch_depth;
    SCOPED_TRACE(absl::StrCat("keep_last=", n, " prefetch=", p));
    const double kForwardUs = 20;
    const ExposureRun run = RunExposure(kLayers, n, p, kForwardUs, kBackwardUs);
    ASSERT_GT(run.copy_us, kBackwardUs);
    const int restored_groups = kLayers - n - kCopying;                   // G
    const int met_first = n == 0 ? kCopying - 1 : kCopying;               // W
    const int first_h2d_acquire = kLayers - (met_first + 1 + p - 1) / p;  // a
    const double t0 = kLayers * kForwardUs;
    const double t1 = t0 + (kLayers - 1 - first_h2d_acquire) * kBackwardUs;
    // The model's premises, on the timeline.
    std::vector<SimDevice::TimelineEntry> h2d;
    double last_compute_start = -1;
    for (const SimDevice::TimelineEntry& op : run.timeline) {
      if (op.kind == "h2d") h2d.push_back(op);
      if (op.kind == "compute" && op.label == "bwd0") last_compute_start = op.start_us;
    }
    std::sort(h2d.begin(), h2d.end(),
              [](const auto& x, const auto& y) { return x.start_us < y.start_us; });
    ASSERT_EQ(h2d.size(), static_cast<size_t>(restored_groups));
    ExpectNear(h2d.front().start_us, t1, "first restore starts at T1");
    for (size_t i = 1; i < h2d.size(); ++i) {
      ExpectNear(h2d[i].start_us, h2d[i - 1].end_us, absl::StrCat("restore ", i, " start"));
    }
    ExpectNear(last_compute_start, h2d.back().end_us, "layer 0's backward starts");
    const double expected = restored_groups * run.copy_us - first_h2d_acquire * kBackwardUs;
    EXPECT_GT(expected, 0);
    EXPECT_EQ(run.stats.reclaimed_tensors, kCopying);
    EXPECT_EQ(run.stats.restored_tensors, restored_groups);
    ExpectNear(run.blocked_us, expected, "sim blocked_us(compute)");
    ExpectNear(run.engine_wait_us, expected, "stats().exposed_wait_ms");
  }
}

// ---------------------------------------------------------------------------------------

TEST_F(EngineTest, DeviceHeldBytesStayWithinBound) {
  const int kLayers = 9;
  const int kEntries = 2;
  const size_t kBytes = 300000;
  const size_t kGroupBytes = kEntries * kBytes;
  for (int keep_last : {0, 1, 2}) {
    for (int prefetch : {0, 1, 2}) {
      for (int max_inflight : {1, 2, 3}) {
        // Copy-bound forward and backward (the host runs far ahead and copies pile up) and
        // compute-bound.
        for (const auto& [forward_us, backward_us] :
             std::vector<std::pair<double, double>>{{1, 1}, {30, 60}}) {
          SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch,
                                    " max_inflight=", max_inflight, " forward_us=", forward_us));
          EngineHarness harness(Options(keep_last, prefetch, max_inflight));
          harness.RunStep(UniformPlan(kLayers, kBytes, kEntries, forward_us, backward_us), 0);
          harness.ExpectQuiescent();
          const EngineStats stats = harness.engine().stats();
          const size_t peak = stats.peak_device_held_bytes;
          const size_t bound = (keep_last + max_inflight + prefetch + 1) * kGroupBytes;
          EXPECT_LE(peak, bound);
          EXPECT_GE(peak, kGroupBytes);  // something was held: the bound was exercised
          // With prefetch the bound is exercised with reclaim too: the max_inflight groups
          // still copying when forward ends (see ReclaimedGroupsOfOneStep).
          const int64_t reclaimed =
              kEntries * ReclaimedGroupsOfOneStep(kLayers - keep_last, prefetch, max_inflight);
          EXPECT_EQ(stats.reclaimed_tensors, reclaimed);
          EXPECT_EQ(stats.restored_tensors + stats.reclaimed_tensors, stats.offloaded_tensors);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Reclaim: backward needs an entry whose D2H copy is still running.

bool Logged(const std::vector<SimClient::Release>& log, EntryId entry, double* at_us) {
  for (const SimClient::Release& release : log) {
    if (release.entry == entry) {
      if (at_us != nullptr) *at_us = release.host_time_us;
      return true;
    }
  }
  return false;
}

// Ends of the "d2h" copies in the sim's timeline, in issue order (one engine, FIFO).
std::vector<double> D2HEnds(const SimDevice& sim) {
  std::vector<double> ends;
  for (const SimDevice::TimelineEntry& op : sim.timeline()) {
    if (op.kind == "d2h") ends.push_back(op.end_us);
  }
  std::sort(ends.begin(), ends.end());
  return ends;
}

TEST_F(EngineTest, EntryStillCopyingWhenBackwardNeedsItIsReclaimed) {
  // L = 5 layers of one entry of B bytes (C = 10 us), F = 20 us, Bk = 5 us, prefetch 1,
  // max_inflight 2. Group k copies out over [(k + N) * F, (k + N) * F + C] (after the compute
  // queued when its copy is issued; C <= F, so copies never queue). The host last waits for
  // group L - N - 3's copy, until (L - 3) * F + C = 50 us, and forward ends with groups
  // L - N - 2 and L - N - 1 ("low" and "high") copying until 70 and 90 us. Backward starts
  // at host time 50: with N = 0 Acquire(4) reclaims group 4 itself (the on-demand path) and
  // its prefetch window reclaims group 3; with N = 1 the windows of Acquire(4) and Acquire(3)
  // reclaim groups 3 and 2.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 5;
  for (int keep_last : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineHarness harness(Options(keep_last, 1));
    const StepPlan plan = UniformPlan(kLayers, kB, 1, 20, 5);
    SavedLayers saved;
    ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
    ExpectNear(harness.sim().host_time_us(), 50, "host time when forward ends");
    const int low = kLayers - keep_last - 2;
    const int high = kLayers - keep_last - 1;
    const SavedTensor low_tensor = saved[low][0];
    const SavedTensor high_tensor = saved[high][0];
    EXPECT_FALSE(harness.client().Released(low_tensor.entry));
    EXPECT_FALSE(harness.client().Released(high_tensor.entry));

    // Backward through the kept layers and both reclaimed ones. The harness checks that each
    // resident Acquire sees the caller's source intact and not released. Both Discards came
    // while the copies still read the sources: they returned true (the harness did not drop
    // them), and the engine keeps them.
    ASSERT_TRUE(
        harness.Backward(&saved, plan.backward_us, true, /*max_layers=*/keep_last + 2).ok());
    EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.reclaimed_tensors, 2);
    EXPECT_EQ(harness.resident_uses(), keep_last + 2);
    const std::vector<EntryId> unsettled = harness.client().UnsettledSources();
    EXPECT_NE(std::find(unsettled.begin(), unsettled.end(), low_tensor.entry), unsettled.end());
    EXPECT_NE(std::find(unsettled.begin(), unsettled.end(), high_tensor.entry), unsettled.end());
    EXPECT_FALSE(harness.client().Released(low_tensor.entry));
    EXPECT_FALSE(harness.client().Released(high_tensor.entry));
    // Held for the engine alone now: the two sources, plus group low - 1's restore, which
    // the last of those Acquires prefetched.
    EXPECT_EQ(stats.device_held_bytes, 3 * kB);
    // Every host block is still live: the reclaimed ones are being written by their copies.
    EXPECT_EQ(stats.arena.live_blocks, kLayers - keep_last);

    // 75 us: the low copy ended (70), the high one did not (90). The next layer's backward
    // (its Acquire and Discard poll) hands the low source back, and only that one.
    harness.sim().AdvanceHost(25);
    ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, true, 1).ok());
    EXPECT_TRUE(harness.client().Released(low_tensor.entry));
    EXPECT_FALSE(harness.client().Released(high_tensor.entry));
    EXPECT_EQ(harness.engine().stats().device_held_bytes, 2 * kB);  // high + next prefetch
    // 95 us: the high copy ended too; the next layer's backward hands it back.
    harness.sim().AdvanceHost(20);
    ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, true, 1).ok());
    EXPECT_TRUE(harness.client().Released(high_tensor.entry));
    ASSERT_TRUE(harness.Backward(&saved, plan.backward_us).ok());
    harness.DrainAndCheck();
    harness.ExpectQuiescent();  // no hazard: no source released, no block freed, mid-copy

    // Each release came after the copy reading that source ended.
    const std::vector<double> ends = D2HEnds(harness.sim());
    ASSERT_EQ(ends.size(), static_cast<size_t>(kLayers - keep_last));
    ExpectNear(ends[low], 70, "low copy end");
    ExpectNear(ends[high], 90, "high copy end");
    const std::vector<SimClient::Release> log = harness.client().release_log();
    double low_at = -1;
    double high_at = -1;
    ASSERT_TRUE(Logged(log, low_tensor.entry, &low_at));
    ASSERT_TRUE(Logged(log, high_tensor.entry, &high_at));
    ExpectNear(low_at, 75, "low source released at");
    ExpectNear(high_at, 95, "high source released at");

    // No H2D copy and no second device buffer for the reclaimed entries; their D2H copies
    // still ran.
    stats = harness.engine().stats();
    const int64_t restored = kLayers - keep_last - 2;
    EXPECT_EQ(stats.offloaded_tensors, kLayers - keep_last);
    EXPECT_EQ(stats.restored_tensors, restored);
    EXPECT_EQ(stats.prefetched_tensors, restored);
    EXPECT_EQ(stats.restored_tensors + stats.reclaimed_tensors, stats.offloaded_tensors);
    EXPECT_EQ(harness.client().allocated_restores(), restored);
    EXPECT_EQ(harness.checked_total(), static_cast<size_t>(restored));
    EXPECT_EQ(harness.sim().bytes_copied_to_device(), restored * kB);
    EXPECT_EQ(harness.sim().bytes_copied_to_host(), (kLayers - keep_last) * kB);
  }
}

TEST_F(EngineTest, ReclaimedEntryDiscardedAfterItsCopyGoesStraightBackToTheCaller) {
  // As above with keep_last 1: groups 1 and 2 copy until 50 and 70 us; backward starts at
  // 30 us and reclaims both. Their handles die only at 75 us, after both copies ended:
  // Discard returns false (the caller may reuse the memory) and no ReleaseSource follows.
  const size_t kB = kTenMicrosecondBytes;
  EngineHarness harness(Options(1, 1));
  const StepPlan plan = UniformPlan(4, kB, 1, 20, 5);
  SavedLayers saved;
  ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
  std::vector<EntryId> ids;
  for (const auto& tensors : saved) ids.push_back(tensors[0].entry);
  OffloadEngine& engine = harness.engine();
  std::vector<SimBufferRef> reads;
  for (int layer : {3, 2, 1}) {
    const SavedTensor& tensor = saved[layer][0];
    absl::StatusOr<OffloadEngine::Acquired> acquired =
        engine.Acquire(tensor.entry, harness.compute());
    ASSERT_TRUE(acquired.ok()) << acquired.status();
    EXPECT_TRUE(acquired->resident) << "layer " << layer;
    EXPECT_EQ(FirstMismatch(tensor.source, tensor.bytes, tensor.tag), -1) << "layer " << layer;
    reads.push_back({tensor.source, tensor.bytes});
  }
  harness.sim().Compute(harness.compute(), 3 * plan.backward_us, reads);
  EXPECT_EQ(engine.stats().reclaimed_tensors, 2);
  harness.sim().AdvanceHost(45);
  for (int layer : {3, 2, 1}) {
    SavedTensor& tensor = saved[layer][0];
    EXPECT_FALSE(engine.Discard(tensor.entry)) << "layer " << layer;
    harness.client().CallerDropped(tensor.entry);
    tensor.entry = 0;
  }
  EXPECT_EQ(engine.stats().device_held_bytes, kB);  // group 0's prefetched restore
  ASSERT_TRUE(harness.Backward(&saved, plan.backward_us).ok());
  EXPECT_EQ(harness.DrainAndCheck(), 1u);
  harness.ExpectQuiescent();  // includes: no ReleaseSource after the caller dropped a source
  // Only group 0's source came back through ReleaseSource (its copy finished in forward).
  const std::vector<SimClient::Release> log = harness.client().release_log();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_EQ(log[0].entry, ids[0]);
  const EngineStats stats = harness.engine().stats();
  EXPECT_EQ(stats.reclaimed_tensors, 2);
  EXPECT_EQ(stats.restored_tensors, 1);
  EXPECT_EQ(harness.sim().bytes_copied_to_device(), kB);
}

// The backward of a forward whose copies all completed before it: every offloaded layer
// (all but the kept last of `layers`) is restored by a copy, none reclaimed.
void ExpectBackwardRestoresEveryOffloadedLayer(EngineHarness& harness, SavedLayers* saved,
                                               const StepPlan& plan, int layers) {
  ASSERT_TRUE(harness.Backward(saved, plan.backward_us).ok());
  EXPECT_EQ(harness.DrainAndCheck(), static_cast<size_t>(layers - 1));
  harness.ExpectQuiescent();
  const EngineStats stats = harness.engine().stats();
  EXPECT_EQ(stats.reclaimed_tensors, 0);
  EXPECT_EQ(stats.restored_tensors, layers - 1);
}

TEST_F(EngineTest, PrefetchZeroFirstAcquireDrainsTheForwardCopies) {
  // keep_last 1, prefetch 0, L = 5 layers of one entry (C = 10 us), F = 20 us, Bk = 5 us.
  // Relative to the step's start, group k copies out over [(k + 1) * F, (k + 1) * F + C];
  // the host last waits for group 1 (until 50 us) and forward ends with groups 2 and 3
  // copying until 70 and 90 us. The first Acquire waits for both before it returns, so at
  // 90 us (4 * F + C) every offloaded source has been handed back and nothing is left to
  // reclaim. Two steps: every backward's first Acquire drains.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 5;
  EngineHarness harness(Options(1, 0));
  const StepPlan plan = UniformPlan(kLayers, kB, 1, 20, 5);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    harness.engine().ResetStats();
    const double t0 = harness.sim().host_time_us();
    const size_t logged_before = harness.client().release_log().size();
    SavedLayers saved;
    ASSERT_TRUE(harness.Forward(plan, step, &saved).ok());
    ExpectNear(harness.sim().host_time_us() - t0, 50, "host time when forward ends");
    std::vector<SimClient::Release> log = harness.client().release_log();
    EXPECT_EQ(log.size() - logged_before, 2u);  // groups 0 and 1
    for (int layer : {2, 3}) EXPECT_FALSE(harness.client().Released(saved[layer][0].entry));

    const SavedTensor& last = saved[kLayers - 1][0];
    absl::StatusOr<OffloadEngine::Acquired> first =
        harness.engine().Acquire(last.entry, harness.compute());
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE(first->resident);  // the kept layer
    const double returned_at = harness.sim().host_time_us();
    ExpectNear(returned_at - t0, 90, "first Acquire returned at");
    log = harness.client().release_log();
    EXPECT_EQ(log.size() - logged_before, static_cast<size_t>(kLayers - 1));
    for (int layer = 0; layer + 1 < kLayers; ++layer) {
      SCOPED_TRACE(absl::StrCat("layer ", layer));
      double at = -1;
      ASSERT_TRUE(Logged(log, saved[layer][0].entry, &at));
      EXPECT_LE(at, returned_at);
      // The copy of layer `layer` ended at (layer + 1) * F + C; it was released no earlier,
      // and at the latest when the host next polled: at 30, 50 (forward), or 90 (the drain).
      const double copy_end = (layer + 1) * 20 + 10;
      EXPECT_GE(at - t0, copy_end - 1e-6);
    }
    EXPECT_EQ(harness.engine().stats().reclaimed_tensors, 0);
    EXPECT_EQ(harness.engine().stats().device_held_bytes, 0u);

    // The layer's backward, then the rest: every offloaded layer is restored.
    harness.sim().Compute(harness.compute(), plan.backward_us, {{last.source, last.bytes}});
    EXPECT_FALSE(harness.engine().Discard(last.entry));
    harness.client().CallerDropped(last.entry);
    saved[kLayers - 1][0].entry = 0;
    ExpectBackwardRestoresEveryOffloadedLayer(harness, &saved, plan, kLayers);
    EXPECT_EQ(harness.engine().stats().offloaded_tensors, kLayers - 1);
  }
  EXPECT_EQ(harness.sim().bytes_copied_to_device(), 2 * (kLayers - 1) * kB);
}

// ---------------------------------------------------------------------------------------
// EndForward, eager groups and PrefetchGroup: the end of forward and a model's head.

TEST_F(EngineTest, EndForwardDrainsTheForwardCopiesForEveryPrefetchDepth) {
  // keep_last 1, L = 5 layers of one entry (C = 10 us), F = 20 us: forward ends at 50 us with
  // groups 2 and 3 copying until 70 and 90 us (see PrefetchZeroFirstAcquireDrains...).
  // EndForward waits for both, whatever prefetch_depth, and keeps layer 4 resident; the
  // backward after it reclaims nothing, so every offloaded layer is restored.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 5;
  for (int prefetch : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("prefetch=", prefetch));
    EngineHarness harness(Options(1, prefetch));
    const StepPlan plan = UniformPlan(kLayers, kB, 1, 20, 5);
    for (int step = 0; step < 2; ++step) {
      harness.engine().ResetStats();
      const double t0 = harness.sim().host_time_us();
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, step, &saved).ok());
      for (int layer : {2, 3}) EXPECT_FALSE(harness.client().Released(saved[layer][0].entry));
      ASSERT_TRUE(harness.engine().EndForward().ok());
      ExpectNear(harness.sim().host_time_us() - t0, 90, "EndForward returned at");
      for (int layer = 0; layer + 1 < kLayers; ++layer) {
        EXPECT_TRUE(harness.client().Released(saved[layer][0].entry)) << "layer " << layer;
      }
      EXPECT_EQ(harness.engine().stats().kept_resident_tensors, 1);
      EXPECT_EQ(harness.engine().stats().device_held_bytes, 0u);
      ASSERT_TRUE(harness.engine().EndForward().ok());  // only the first call waits
      ExpectNear(harness.sim().host_time_us() - t0, 90, "a second EndForward returned at");
      ExpectBackwardRestoresEveryOffloadedLayer(harness, &saved, plan, kLayers);
    }
  }
}

// A model's head after the checkpointed layers: one eager entry ("the final norm's input"),
// its restore triggered by the caller while a long head backward runs.
struct HeadStep {
  SavedLayers layers;
  SavedTensor head;
  GroupId head_group = 0;
};

void HeadForward(EngineHarness& harness, const StepPlan& plan, size_t head_bytes, int step,
                 HeadStep* out) {
  ASSERT_TRUE(harness.Forward(plan, step, &out->layers).ok());
  absl::StatusOr<GroupId> group = harness.engine().BeginEagerGroup();
  ASSERT_TRUE(group.ok()) << group.status();
  out->head_group = *group;
  SavedTensor& head = out->head;
  head.bytes = head_bytes;
  head.tag = int64_t{step} * 1000 + 999;
  head.source = harness.client().NewSource(head.bytes, head.tag);
  const SourceToken token = harness.client().FileSource(head.source, head.bytes);
  absl::StatusOr<OffloadEngine::Offer> offer =
      harness.engine().OfferEntry(*group, head.source, head.bytes, token, harness.compute());
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_TRUE(offer->will_offload);  // copied as offered: known at once
  head.entry = offer->entry;
  harness.client().Bind(head.entry, token);
  // The head's forward (it reads the saved tensor).
  harness.sim().Compute(harness.compute(), plan.forward_us, {{head.source, head.bytes}});
}

// Acquire + the head's backward + Discard; true when the head's data was a restore.
void HeadBackward(EngineHarness& harness, HeadStep* step, double backward_us) {
  SavedTensor& head = step->head;
  absl::StatusOr<OffloadEngine::Acquired> acquired =
      harness.engine().Acquire(head.entry, harness.compute());
  ASSERT_TRUE(acquired.ok()) << acquired.status();
  ASSERT_FALSE(acquired->resident);
  ASSERT_TRUE(harness.client().TakeRestore(head.entry, acquired->device_data));
  harness.sim().Compute(harness.compute(), backward_us, {{acquired->device_data, head.bytes}});
  EXPECT_FALSE(harness.engine().Discard(head.entry));
  harness.client().CallerDropped(head.entry);
  ASSERT_TRUE(harness.sim().SynchronizeAll().ok());
  EXPECT_EQ(FirstMismatch(acquired->device_data, head.bytes, head.tag), -1);
  harness.sim().FreeDeviceBuffer(acquired->device_data);
  head.entry = 0;
}

TEST_F(EngineTest, EagerGroupIsCopiedAsOfferedAndStaysOutOfTheKeepLastWindow) {
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 4;
  for (int keep_last : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineHarness harness(Options(keep_last, 1));
    const StepPlan plan = UniformPlan(kLayers, kB, 1, 20, 5);
    for (int step = 0; step < 2; ++step) {
      harness.engine().ResetStats();
      HeadStep head_step;
      HeadForward(harness, plan, 2 * kB, step, &head_step);
      ASSERT_TRUE(harness.engine().EndForward().ok());
      EngineStats stats = harness.engine().stats();
      // The last keep_last layers stay, as without the head; the head is offloaded and
      // counted apart.
      EXPECT_EQ(stats.kept_resident_tensors, keep_last);
      EXPECT_EQ(stats.offloaded_tensors, kLayers - keep_last);
      EXPECT_EQ(stats.eager_offloaded_tensors, 1);
      EXPECT_EQ(stats.eager_offloaded_bytes, 2 * kB);
      EXPECT_EQ(stats.groups, kLayers);  // eager groups are not checkpoint groups
      EXPECT_TRUE(harness.client().Released(head_step.head.entry));
      HeadBackward(harness, &head_step, 5);
      ASSERT_TRUE(harness.Backward(&head_step.layers, plan.backward_us).ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      stats = harness.engine().stats();
      EXPECT_EQ(stats.restored_tensors, kLayers - keep_last);
      EXPECT_EQ(stats.eager_restored_tensors, 1);
      EXPECT_EQ(stats.reclaimed_tensors, 0);
    }
  }
}

TEST_F(EngineTest, PrefetchGroupHidesTheHeadRestoreAndTheLayersBelowIt) {
  // keep_last 0, prefetch 1: the head (2C = 20 us) and the last layer (C) are restored at
  // the caller's PrefetchGroup, queued after the work before it, while a 40 us stretch of
  // compute (the LM head's backward) runs: neither the head's backward nor the last layer's
  // waits. Without PrefetchGroup the head's restore is exposed in full.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 4;
  for (bool prefetch_head : {true, false}) {
    SCOPED_TRACE(absl::StrCat("prefetch_head=", prefetch_head));
    EngineHarness harness(Options(0, 1));
    const StepPlan plan = UniformPlan(kLayers, kB, 1, 20, 30);
    harness.engine().ResetStats();
    HeadStep head_step;
    HeadForward(harness, plan, 2 * kB, 0, &head_step);
    ASSERT_TRUE(harness.engine().EndForward().ok());
    const double blocked_before = harness.sim().blocked_us(harness.compute());
    if (prefetch_head) {
      ASSERT_TRUE(harness.engine().PrefetchGroup(head_step.head_group, harness.compute()).ok());
      EXPECT_EQ(harness.engine().stats().eager_restored_tensors, 1);
      EXPECT_EQ(harness.engine().stats().prefetched_tensors, 1);  // layer 3, below it
    }
    harness.sim().Compute(harness.compute(), 40);  // the LM head's backward
    HeadBackward(harness, &head_step, 5);
    ASSERT_TRUE(harness.Backward(&head_step.layers, plan.backward_us).ok());
    harness.DrainAndCheck();
    harness.ExpectQuiescent();
    const double blocked = harness.sim().blocked_us(harness.compute()) - blocked_before;
    ExpectNear(blocked, prefetch_head ? 0 : CopyUs(2 * kB, 55), "compute blocked");
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.restored_tensors, kLayers);
    EXPECT_EQ(stats.eager_restored_tensors, 1);
    EXPECT_EQ(stats.reclaimed_tensors, 0);
  }
}

// A harness whose engine leaves the prefetch to PrefetchBelowAcquired (prefetch_on_acquire
// off, depth 1), its stats reset, after the forward of `layers` layers of one entry of
// `bytes` each (20 us each), their saved tensors in `saved`.
std::unique_ptr<EngineHarness> DeferredPrefetchForward(int keep_last, int layers, size_t bytes,
                                                       SavedLayers* saved) {
  EngineOptions options = Options(keep_last, 1);
  options.prefetch_on_acquire = false;
  auto harness = std::make_unique<EngineHarness>(options);
  harness->engine().ResetStats();
  EXPECT_TRUE(harness->Forward(UniformPlan(layers, bytes, 1, 20, 10), 0, saved).ok());
  return harness;
}

TEST_F(EngineTest, PrefetchBelowAcquiredIssuesTheDeferredPrefetch) {
  // prefetch_on_acquire off: Acquire of a layer restores only that layer; the caller asks
  // for the layer below once the layer's backward is past its peak (here after the first
  // 10 us of its 25 us, the MLP's backward of a transformer layer). The copy (10 us) then
  // overlaps the remaining 15 us and nothing waits. Without the calls, every offloaded
  // layer is restored on demand and waited for in full.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 6;
  const int kKeepLast = 1;
  for (bool call : {true, false}) {
    SCOPED_TRACE(absl::StrCat("PrefetchBelowAcquired called: ", call));
    SavedLayers saved;
    std::unique_ptr<EngineHarness> made = DeferredPrefetchForward(kKeepLast, kLayers, kB, &saved);
    EngineHarness& harness = *made;
    ASSERT_TRUE(harness.sim().SynchronizeAll().ok());  // no layer is reclaimed
    EXPECT_TRUE(harness.engine().PrefetchBelowAcquired(harness.compute()).ok());  // no-op
    EXPECT_EQ(harness.engine().stats().restored_tensors, 0);
    for (int layer = kLayers - 1; layer >= 0; --layer) {
      ASSERT_TRUE(harness.Backward(&saved, 10, true, 1).ok());  // the MLP part
      EXPECT_EQ(harness.engine().stats().prefetched_tensors,
                call ? std::min(kLayers - kKeepLast, kLayers - 1 - layer) : 0);
      if (call) {
        ASSERT_TRUE(harness.engine().PrefetchBelowAcquired(harness.compute()).ok());
      }
      harness.sim().Compute(harness.compute(), 15);  // the rest of the layer's backward
    }
    harness.DrainAndCheck();
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.restored_tensors, kLayers - kKeepLast);
    EXPECT_EQ(stats.prefetched_tensors, call ? kLayers - kKeepLast : 0);
    ExpectNear(harness.sim().blocked_us(harness.compute()),
               call ? 0 : (kLayers - kKeepLast) * CopyUs(kB, 55), "compute blocked");
  }
}

TEST_F(EngineTest, PrefetchBelowAcquiredBeforeAnyAcquireRestoresTheNewestGroups) {
  // Backward begins above every group (layers whose saved tensors stayed on the device, a
  // fused loss that offloaded nothing) and acquires nothing for a while. Asked for the
  // groups below when that stretch's last 25 us begin, the engine restores the newest
  // offloaded group during them (the 10 us copy hides); not asked, that group's Acquire
  // waits for its whole copy. Each later group is prefetched from its upper neighbour's
  // backward as before. keep_last 0: every group is offloaded, the newest one included.
  const size_t kB = kTenMicrosecondBytes;
  const int kLayers = 4;
  for (bool call : {true, false}) {
    SCOPED_TRACE(absl::StrCat("PrefetchBelowAcquired called first: ", call));
    SavedLayers saved;
    std::unique_ptr<EngineHarness> made = DeferredPrefetchForward(0, kLayers, kB, &saved);
    EngineHarness& harness = *made;
    ASSERT_TRUE(harness.engine().EndForward().ok());
    if (call) {
      ASSERT_TRUE(harness.engine().PrefetchBelowAcquired(harness.compute()).ok());
      // The newest group only: prefetch_depth 1.
      EXPECT_EQ(harness.engine().stats().prefetched_tensors, 1);
    }
    harness.sim().Compute(harness.compute(), 25);  // the stretch above every group
    for (int layer = kLayers - 1; layer >= 0; --layer) {
      ASSERT_TRUE(harness.Backward(&saved, 10, true, 1).ok());
      ASSERT_TRUE(harness.engine().PrefetchBelowAcquired(harness.compute()).ok());
      harness.sim().Compute(harness.compute(), 15);
    }
    harness.DrainAndCheck();
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.restored_tensors, kLayers);
    EXPECT_EQ(stats.prefetched_tensors, call ? kLayers : kLayers - 1);
    ExpectNear(harness.sim().blocked_us(harness.compute()), call ? 0 : CopyUs(kB, 55),
               "compute blocked");
  }
}

TEST_F(EngineTest, SetPrefetchOnAcquireTurnsTheAcquirePrefetchBackOn) {
  const size_t kB = kTenMicrosecondBytes;
  EngineOptions options = Options(1, 1);
  options.prefetch_on_acquire = false;
  EngineHarness harness(options);
  harness.engine().SetPrefetchOnAcquire(true);
  harness.engine().ResetStats();
  const StepPlan plan = UniformPlan(4, kB, 1, 20, 30);
  SavedLayers saved;
  ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
  ASSERT_TRUE(harness.sim().SynchronizeAll().ok());
  ASSERT_TRUE(harness.Backward(&saved, plan.backward_us).ok());
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
  EXPECT_EQ(harness.engine().stats().prefetched_tensors, 3);
  ExpectNear(harness.sim().blocked_us(harness.compute()), 0, "compute blocked");
}

TEST_F(EngineTest, PrefetchGroupOfAnUnknownOrRestoredGroupDoesNothing) {
  const size_t kB = kTenMicrosecondBytes;
  EngineHarness harness(Options(1, 1));
  const StepPlan plan = UniformPlan(3, kB, 1, 20, 30);
  HeadStep head_step;
  HeadForward(harness, plan, kB, 0, &head_step);
  ASSERT_TRUE(harness.engine().EndForward().ok());
  EXPECT_TRUE(harness.engine().PrefetchGroup(12345, harness.compute()).ok());
  EXPECT_EQ(harness.engine().stats().restored_tensors, 0);
  EXPECT_EQ(harness.engine().stats().eager_restored_tensors, 0);
  ASSERT_TRUE(harness.engine().PrefetchGroup(head_step.head_group, harness.compute()).ok());
  ASSERT_TRUE(harness.engine().PrefetchGroup(head_step.head_group, harness.compute()).ok());
  // The head and layer 1 (layer 2 is kept), each once.
  EXPECT_EQ(harness.engine().stats().eager_restored_tensors, 1);
  EXPECT_EQ(harness.engine().stats().restored_tensors, 1);
  HeadBackward(harness, &head_step, 5);
  ASSERT_TRUE(harness.Backward(&head_step.layers, plan.backward_us).ok());
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
  EXPECT_EQ(harness.engine().stats().restored_tensors, 2);
  EXPECT_EQ(harness.engine().stats().eager_restored_tensors, 1);
}

// ---------------------------------------------------------------------------------------
// Reset.

void ExpectPreResetEntriesAreGone(EngineHarness& harness, const SavedLayers& saved) {
  int checked = 0;
  for (const auto& tensors : saved) {
    for (const SavedTensor& tensor : tensors) {
      if (tensor.entry == 0) continue;
      absl::StatusOr<OffloadEngine::Acquired> acquired =
          harness.engine().Acquire(tensor.entry, harness.compute());
      EXPECT_EQ(acquired.status().code(), absl::StatusCode::kFailedPrecondition)
          << "entry " << tensor.entry << ": " << acquired.status();
      // The caller's handle dies later; that is harmless now.
      EXPECT_FALSE(harness.engine().Discard(tensor.entry));
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

TEST_F(EngineTest, ResetMidForwardReleasesEverythingAndNextStepWorks) {
  for (int keep_last : {0, 1, 2}) {
    for (double forward_us : {1.0, 30.0}) {  // copies in flight at Reset, or mostly done
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " forward_us=", forward_us));
      EngineHarness harness(Options(keep_last, 1));
      const StepPlan plan = UniformPlan(8, kTenMicrosecondBytes, 2, forward_us, 20);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved, /*max_layers=*/5).ok());
      ASSERT_TRUE(harness.engine().Reset().ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      ExpectPreResetEntriesAreGone(harness, saved);
      harness.engine().ResetStats();
      harness.RunStep(plan, 1);
      harness.ExpectQuiescent();
      EXPECT_EQ(harness.engine().stats().offloaded_tensors, 2 * (8 - keep_last));
    }
  }
}

TEST_F(EngineTest, ResetMidBackwardReleasesEverythingAndNextStepWorks) {
  for (int keep_last : {0, 1, 2}) {
    for (int prefetch : {0, 2}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch));
      EngineHarness harness(Options(keep_last, prefetch));
      const StepPlan plan = UniformPlan(8, kTenMicrosecondBytes, 2, 20, 4);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
      ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, true, /*max_layers=*/3).ok());
      ASSERT_TRUE(harness.engine().Reset().ok());
      // The three layers backward got through (7, 6, 5) used restored buffers except for the
      // keep_last kept ones and, with prefetch, the two groups below them that were still
      // copying when backward started (reclaimed; see ReclaimedGroupsOfOneStep).
      const int reclaimed_groups =
          static_cast<int>(ReclaimedGroupsOfOneStep(8 - keep_last, prefetch, 2));
      const size_t consumed = harness.DrainAndCheck();
      EXPECT_EQ(consumed, 2u * static_cast<size_t>(std::max(0, 3 - keep_last - reclaimed_groups)));
      harness.ExpectQuiescent();
      if (prefetch > 0) {
        EXPECT_GT(harness.client().dropped_restores(), 0);
      }
      ExpectPreResetEntriesAreGone(harness, saved);
      harness.engine().ResetStats();
      harness.RunStep(plan, 1);
      harness.ExpectQuiescent();
      const EngineStats stats = harness.engine().stats();
      EXPECT_EQ(stats.reclaimed_tensors, 2 * reclaimed_groups);
      EXPECT_EQ(stats.restored_tensors, 2 * (8 - keep_last - reclaimed_groups));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Step sequences.

TEST_F(EngineTest, StepsWithDifferentGroupCountsAndSizes) {
  EngineHarness harness(Options(1, 1));
  StepPlan mixed;
  mixed.entry_bytes = {{100000, 17, 4096}, {3}, {262144, 262145}, {1}, {70000, 70000, 70000}};
  mixed.forward_us = 5;
  mixed.backward_us = 7;
  const StepPlan plans[] = {
      UniformPlan(6, 65536 + 1000, 2, 10, 20), UniformPlan(3, 300000, 3, 2, 3),    mixed,
      UniformPlan(12, 4096, 1, 1, 1),          UniformPlan(1, 1 << 20, 1, 10, 10),
  };
  int step = 0;
  for (const StepPlan& plan : plans) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    harness.engine().ResetStats();
    harness.RunStep(plan, step++);
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    // All but the last layer (kept) are offloaded; the highest min(2, offloaded) of them are
    // still copying when forward ends and are reclaimed (ReclaimedGroupsOfOneStep), so the
    // layers below them are all that is restored.
    const int offloaded_groups = plan.layers() - 1;
    const int restored_groups = offloaded_groups - static_cast<int>(ReclaimedGroupsOfOneStep(
                                                       offloaded_groups, /*prefetch_depth=*/1, 2));
    int64_t entries = 0;
    size_t bytes = 0;
    int64_t restored_entries = 0;
    size_t restored_bytes = 0;
    for (int layer = 0; layer < offloaded_groups; ++layer) {
      entries += static_cast<int64_t>(plan.entry_bytes[layer].size());
      bytes += plan.group_bytes(layer);
      if (layer < restored_groups) {
        restored_entries += static_cast<int64_t>(plan.entry_bytes[layer].size());
        restored_bytes += plan.group_bytes(layer);
      }
    }
    EXPECT_EQ(stats.groups, plan.layers());
    EXPECT_EQ(stats.offloaded_tensors, entries);
    EXPECT_EQ(stats.offloaded_bytes, bytes);
    EXPECT_EQ(stats.restored_tensors, restored_entries);
    EXPECT_EQ(stats.restored_bytes, restored_bytes);
    EXPECT_EQ(stats.reclaimed_tensors, entries - restored_entries);
    EXPECT_EQ(stats.kept_resident_tensors, static_cast<int64_t>(plan.entry_bytes.back().size()));
  }
}

TEST_F(EngineTest, GradientAccumulationForwardBackwardTwice) {
  for (int keep_last : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineHarness harness(Options(keep_last, 1));
    const StepPlan plan = UniformPlan(6, kTenMicrosecondBytes, 1, 20, 30);
    for (int step = 0; step < 2; ++step) {
      for (int micro = 0; micro < 2; ++micro) {
        SCOPED_TRACE(absl::StrCat("step ", step, " micro-batch ", micro));
        harness.engine().ResetStats();
        harness.RunStep(plan, step * 2 + micro);
        harness.ExpectQuiescent();
        const EngineStats stats = harness.engine().stats();
        EXPECT_EQ(stats.kept_resident_tensors, keep_last);
        EXPECT_EQ(stats.offloaded_tensors, 6 - keep_last);
        // Every micro-batch is a step of its own: its two groups still copying when its
        // forward ends are reclaimed (ReclaimedGroupsOfOneStep).
        EXPECT_EQ(stats.reclaimed_tensors, 2);
        EXPECT_EQ(stats.restored_tensors, 6 - keep_last - 2);
      }
    }
  }
}

TEST_F(EngineTest, TwoForwardsThenTwoBackwards) {
  // Micro-batches whose forwards both run before either backward: the keep_last window
  // slides across the first forward's end, and backward walks the second then the first.
  for (int keep_last : {0, 1, 2}) {
    for (int prefetch : {0, 1, 2}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch));
      EngineHarness harness(Options(keep_last, prefetch));
      const StepPlan plan = UniformPlan(5, kTenMicrosecondBytes / 2, 2, 8, 12);
      SavedLayers first;
      SavedLayers second;
      ASSERT_TRUE(harness.Forward(plan, 0, &first).ok());
      ASSERT_TRUE(harness.Forward(plan, 1, &second).ok());
      ASSERT_TRUE(harness.Backward(&second, plan.backward_us).ok());
      ASSERT_TRUE(harness.Backward(&first, plan.backward_us).ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      const EngineStats stats = harness.engine().stats();
      EXPECT_EQ(stats.kept_resident_tensors, 2 * keep_last);
      EXPECT_EQ(stats.offloaded_tensors, 2 * (10 - keep_last));
      // The two forwards are one run of groups for the in-flight bound: when the second
      // ends, its two highest offloaded groups are still copying (ReclaimedGroupsOfOneStep);
      // the first forward's copies finished before. Two entries per group.
      const int64_t reclaimed = 2 * ReclaimedGroupsOfOneStep(10 - keep_last, prefetch, 2);
      EXPECT_EQ(stats.reclaimed_tensors, reclaimed);
      EXPECT_EQ(stats.restored_tensors, 2 * (10 - keep_last) - reclaimed);
    }
  }
}

TEST_F(EngineTest, RetainedGraphAcquireTwiceReturnsEqualData) {
  for (int keep_last : {0, 1}) {
    for (int prefetch : {0, 1, 2}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch));
      EngineHarness harness(Options(keep_last, prefetch));
      const StepPlan plan = UniformPlan(5, kTenMicrosecondBytes, 2, 20, 5);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());

      // The highest two offloaded groups (3 and 4 with keep_last 0, 2 and 3 with keep_last 1)
      // are still copying when forward ends; with prefetch the backward reclaims them (see
      // ReclaimedGroupsOfOneStep), and they stay resident for the graph's later backwards.
      // Group 1 finished copying with either keep_last: it is restored every time.
      const int reclaimed_groups =
          static_cast<int>(ReclaimedGroupsOfOneStep(5 - keep_last, prefetch, 2));
      const int restored_groups = 5 - keep_last - reclaimed_groups;
      // The same entry twice in a row: two buffers, equal bytes.
      const SavedTensor& probe = saved[1][1];
      std::vector<void*> copies;
      for (int i = 0; i < 2; ++i) {
        absl::StatusOr<OffloadEngine::Acquired> acquired =
            harness.engine().Acquire(probe.entry, harness.compute());
        ASSERT_TRUE(acquired.ok()) << acquired.status();
        ASSERT_FALSE(acquired->resident);
        ASSERT_TRUE(harness.client().TakeRestore(probe.entry, acquired->device_data));
        copies.push_back(acquired->device_data);
      }
      EXPECT_NE(copies[0], copies[1]);
      harness.sim().Compute(harness.compute(), 1,
                            {{copies[0], probe.bytes}, {copies[1], probe.bytes}});

      // A whole backward that keeps the graph, then one that frees it.
      ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, /*discard=*/false).ok());
      ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, /*discard=*/true).ok());
      ASSERT_TRUE(harness.sim().SynchronizeAll().ok());
      EXPECT_EQ(FirstMismatch(copies[0], probe.bytes, probe.tag), -1);
      EXPECT_EQ(std::memcmp(copies[0], copies[1], probe.bytes), 0);
      for (void* copy : copies) harness.sim().FreeDeviceBuffer(copy);
      // Every offloaded entry that was not reclaimed was restored by both backwards and
      // checked each time; the reclaimed and kept ones were used in place by both.
      EXPECT_EQ(harness.DrainAndCheck(), 2u * 2 * restored_groups);
      EXPECT_EQ(harness.resident_uses(), 2 * 2 * (keep_last + reclaimed_groups));
      const EngineStats stats = harness.engine().stats();
      EXPECT_EQ(stats.reclaimed_tensors, 2 * reclaimed_groups);
      // Each reclaimed entry counts once; the probe's two extra restores come on top.
      EXPECT_EQ(stats.restored_tensors, 2 * 2 * restored_groups + 2);
      harness.ExpectQuiescent();
    }
  }
}

// ---------------------------------------------------------------------------------------
// Host memory refused.

TEST_F(EngineTest, CapFallbackKeepsEntriesResidentAndIntact) {
  for (int keep_last : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineOptions options = Options(keep_last, 1);
    options.arena.byte_cap = 1;  // no block fits
    EngineHarness harness(options);
    for (int step = 0; step < 2; ++step) {
      harness.engine().ResetStats();
      harness.RunStep(UniformPlan(6, kTenMicrosecondBytes, 2, 20, 20), step);
      harness.ExpectQuiescent();
      const EngineStats stats = harness.engine().stats();
      EXPECT_EQ(stats.cap_fallbacks, 2 * (6 - keep_last));
      EXPECT_EQ(stats.offloaded_tensors, 0);
      EXPECT_EQ(stats.restored_tensors, 0);
      EXPECT_EQ(stats.kept_resident_tensors, 2 * keep_last);
      EXPECT_GT(stats.arena.cap_rejections, 0);
    }
    EXPECT_EQ(harness.sim().bytes_copied_to_host(), 0u);
  }
}

TEST_F(EngineTest, PartialCapOffloadsWhatFitsAndKeepsTheRest) {
  const size_t kBytes = 64 * 1024;  // a multiple of the arena's block alignment
  EngineOptions options = Options(1, 1);
  options.arena.byte_cap = 3 * kBytes;
  EngineHarness harness(options);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    harness.engine().ResetStats();
    harness.RunStep(UniformPlan(8, kBytes, 1, 20, 20), step);
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.offloaded_tensors, 3);
    EXPECT_EQ(stats.cap_fallbacks, 8 - 1 - 3);
    // Groups 0..2 copy out (20 + 20 * i to ~1.2 us later). The host waits for group 0 when
    // group 2 starts and for group 1 when group 3 would start (it falls back: no copy, so it
    // joins no in-flight count and later groups wait for nothing). Forward ends with group
    // 2 alone still copying: backward reclaims it and restores groups 0 and 1.
    EXPECT_EQ(stats.reclaimed_tensors, 1);
    EXPECT_EQ(stats.restored_tensors, 2);
    EXPECT_LE(stats.arena.reserved_bytes, 3 * kBytes);
  }
}

TEST_F(EngineTest, KeepLastZeroOfferReportsFallbackUpFront) {
  EngineOptions options = Options(0, 1);
  options.arena.byte_cap = 1;
  EngineHarness harness(options);
  absl::StatusOr<GroupId> group = harness.engine().BeginGroup(harness.compute());
  ASSERT_TRUE(group.ok());
  void* source = harness.client().NewSource(1024, 1);
  const SourceToken token = harness.client().FileSource(source, 1024);
  absl::StatusOr<OffloadEngine::Offer> offer =
      harness.engine().OfferEntry(*group, source, 1024, token, harness.compute());
  ASSERT_TRUE(offer.ok()) << offer.status();
  EXPECT_FALSE(offer->will_offload);
  EXPECT_EQ(harness.engine().stats().cap_fallbacks, 1);
  harness.client().Bind(offer->entry, token);
  EXPECT_FALSE(harness.engine().Discard(offer->entry));
  harness.client().CallerDropped(offer->entry);
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
}

// ---------------------------------------------------------------------------------------
// Injected failures.

TEST_F(EngineTest, InjectedCopyFailureInForwardThenResetAndNextStepWork) {
  for (int keep_last : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineHarness harness(Options(keep_last, 1));
    const StepPlan plan = UniformPlan(6, kTenMicrosecondBytes, 3, 5, 10);
    // Let a few copies be queued first, so the failure lands in the middle of a group.
    SavedLayers saved;
    ASSERT_TRUE(harness.Forward(plan, 0, &saved, /*max_layers=*/keep_last + 2).ok());
    faults::FailNext(faults::Fault::kCopy, 1);
    SavedLayers more;
    absl::Status failed = harness.Forward(plan, 1, &more);
    EXPECT_FALSE(failed.ok());
    EXPECT_NE(failed.message().find("injected"), std::string::npos) << failed;
    faults::ClearAll();
    ASSERT_TRUE(harness.engine().Reset().ok());
    harness.DrainAndCheck();
    harness.ExpectQuiescent();
    harness.engine().ResetStats();
    harness.RunStep(plan, 2);
    harness.ExpectQuiescent();
    // The step's two highest offloaded groups were still copying (ReclaimedGroupsOfOneStep).
    EXPECT_EQ(harness.engine().stats().reclaimed_tensors, 3 * 2);
    EXPECT_EQ(harness.engine().stats().restored_tensors, 3 * (6 - keep_last - 2));
  }
}

TEST_F(EngineTest, InjectedCopyFailureInBackwardThenResetAndNextStepWork) {
  for (int keep_last : {0, 1}) {
    for (int prefetch : {0, 1, 2}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch));
      EngineHarness harness(Options(keep_last, prefetch));
      const StepPlan plan = UniformPlan(6, kTenMicrosecondBytes, 3, 20, 10);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
      ASSERT_TRUE(harness.Backward(&saved, plan.backward_us, true, /*max_layers=*/2).ok());
      // The next copy fails, whichever layer's backward issues it (a resident layer without
      // prefetch issues none).
      bool failed = false;
      for (int attempt = 0; attempt < 6 && !failed; ++attempt) {
        faults::FailNext(faults::Fault::kCopy, 1);
        absl::Status status = harness.Backward(&saved, plan.backward_us, true, 1);
        failed = !status.ok();
        if (failed) {
          EXPECT_NE(status.message().find("injected"), std::string::npos) << status;
        }
      }
      EXPECT_TRUE(failed) << "no backward call issued a copy";
      faults::ClearAll();
      ASSERT_TRUE(harness.engine().Reset().ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      harness.engine().ResetStats();
      harness.RunStep(plan, 1);
      harness.ExpectQuiescent();
      const int64_t reclaimed_groups = ReclaimedGroupsOfOneStep(6 - keep_last, prefetch, 2);
      EXPECT_EQ(harness.engine().stats().reclaimed_tensors, 3 * reclaimed_groups);
      EXPECT_EQ(harness.engine().stats().restored_tensors, 3 * (6 - keep_last - reclaimed_groups));
    }
  }
}

TEST_F(EngineTest, CopyFailureInTheMiddleOfAGroupThenReset) {
  // Copies of the group's first entries are queued when a later one fails: Reset must
  // still wait for them before it frees their host blocks and releases their sources.
  for (int keep_last : {0, 1, 2}) {
    for (int skip : {1, 2}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " skip=", skip));
      EngineHarness harness(Options(keep_last, 1));
      const StepPlan plan = UniformPlan(6, kTenMicrosecondBytes, 3, 1, 10);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved, /*max_layers=*/keep_last + 1).ok());
      harness.device().FailCopyAfter(skip);
      SavedLayers more;
      absl::Status failed = harness.Forward(plan, 1, &more);
      EXPECT_EQ(failed.message(), "copy-failing device: d2h copy failed");
      ASSERT_TRUE(harness.engine().Reset().ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      harness.engine().ResetStats();
      harness.RunStep(plan, 2);
      harness.ExpectQuiescent();
    }
  }
}

TEST_F(EngineTest, RestoreFailureInTheMiddleOfABatchThenReset) {
  // The same for H2D: the first restores of a group are queued when the next one cannot
  // get a buffer (client) or its copy fails (device).
  for (bool client_fails : {true, false}) {
    for (int prefetch : {0, 1, 2}) {
      SCOPED_TRACE(absl::StrCat(client_fails ? "client" : "device", " prefetch=", prefetch));
      EngineHarness harness(Options(1, prefetch));
      const StepPlan plan = UniformPlan(6, kTenMicrosecondBytes, 3, 20, 1);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
      if (client_fails) {
        harness.client().FailRestoreAllocationAfter(1);
      } else {
        harness.device().FailCopyAfter(1);
      }
      absl::Status failed = harness.Backward(&saved, plan.backward_us);
      EXPECT_FALSE(failed.ok());
      ASSERT_TRUE(harness.engine().Reset().ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();
      harness.engine().ResetStats();
      harness.RunStep(plan, 1);
      harness.ExpectQuiescent();
    }
  }
}

TEST_F(EngineTest, FailedCopyWithoutResetKeepsDataIntact) {
  // A caller that carries on after the error (no Reset) still gets correct bytes: the
  // entry whose copy failed stays on the device.
  EngineHarness harness(Options(1, 1));
  const StepPlan plan = UniformPlan(5, kTenMicrosecondBytes, 2, 20, 30);
  SavedLayers saved;
  ASSERT_TRUE(harness.Forward(plan, 0, &saved, /*max_layers=*/2).ok());
  faults::FailNext(faults::Fault::kCopy, 1);  // the first copy of layer 1's two entries
  absl::StatusOr<GroupId> group = harness.engine().BeginGroup(harness.compute());
  EXPECT_FALSE(group.ok());
  faults::ClearAll();
  // The failed BeginGroup created no group; the step carries on with two more layers.
  SavedLayers rest;
  StepPlan tail = UniformPlan(2, kTenMicrosecondBytes, 2, 20, 30);
  absl::Status status = harness.Forward(tail, 1, &rest);
  ASSERT_TRUE(status.ok()) << status;
  status = harness.Backward(&rest, plan.backward_us);
  ASSERT_TRUE(status.ok()) << status;
  status = harness.Backward(&saved, plan.backward_us);
  ASSERT_TRUE(status.ok()) << status;
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
}

TEST_F(EngineTest, D2HRecordFailureThenCarryOnReclaimsSafely) {
  // BeginGroup queues the copies of the group leaving the keep_last window, then recording
  // their completion event fails: BeginGroup returns the error and begins no group, and
  // those copies run with no event of theirs. A caller that carries on (no Reset) must still
  // see intact data and no hazard: before backward reclaims or restores that group, its
  // copies get a completion record, so a reclaimed entry's host block is freed, and its
  // source handed back, only after its copy.
  // Three layers (C = 10 us <= F = 20 us), the failing BeginGroup, three more layers. The
  // untracked copy, of the first three layers' layer 3 - N (the one leaving the window),
  // starts after the third layer's compute, at 60 us, and ends at 70 us; forward ends at
  // host time 50 us with two tracked groups still copying (ReclaimedGroupsOfOneStep), so
  // with prefetch backward reclaims those two and the untracked one. Without prefetch the
  // first Acquire drains the tracked copies (the host wakes at 110 us); the untracked group
  // still looks copying to the engine (no event said otherwise) and its Acquire reclaims it.
  for (int keep_last : {1, 2}) {
    for (int prefetch : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("keep_last=", keep_last, " prefetch=", prefetch));
      EngineHarness harness(Options(keep_last, prefetch));
      const StepPlan plan = UniformPlan(3, kTenMicrosecondBytes, 1, 20, 5);
      SavedLayers saved;
      ASSERT_TRUE(harness.Forward(plan, 0, &saved).ok());
      harness.device().FailNextRecordOn(harness.sim().d2h_stream());
      SavedLayers failed;
      absl::Status status = harness.Forward(plan, 1, &failed, /*max_layers=*/1);
      EXPECT_EQ(status.message(), "copy-failing device: record failed");
      EXPECT_TRUE(failed.empty());
      SavedLayers rest;
      ASSERT_TRUE(harness.Forward(plan, 2, &rest).ok());
      ExpectNear(harness.sim().host_time_us(), 50, "host time when forward ends");
      ASSERT_TRUE(harness.Backward(&rest, plan.backward_us).ok());
      ASSERT_TRUE(harness.Backward(&saved, plan.backward_us).ok());
      harness.DrainAndCheck();
      harness.ExpectQuiescent();  // every source handed back or dropped: none left behind
      const EngineStats stats = harness.engine().stats();
      const int64_t reclaimed = prefetch == 0 ? 1 : 3;
      EXPECT_EQ(stats.offloaded_tensors, 6 - keep_last);
      EXPECT_EQ(stats.reclaimed_tensors, reclaimed);
      EXPECT_EQ(stats.restored_tensors, 6 - keep_last - reclaimed);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Arguments.

TEST_F(EngineTest, ValidateEngineOptionsNamesTheField) {
  EXPECT_TRUE(ValidateEngineOptions(EngineOptions{}).ok());
  struct Case {
    EngineOptions options;
    const char* field;
  };
  std::vector<Case> cases(3);
  cases[0].options.keep_last = -1;
  cases[0].field = "keep_last";
  cases[1].options.prefetch_depth = -2;
  cases[1].field = "prefetch_depth";
  cases[2].options.max_inflight_d2h_groups = 0;
  cases[2].field = "max_inflight_d2h_groups";
  for (const Case& c : cases) {
    absl::Status status = ValidateEngineOptions(c.options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(status.message().find(c.field), std::string::npos) << status;
    SimDevice sim;
    SimClient client(&sim);
    absl::StatusOr<std::unique_ptr<OffloadEngine>> engine =
        OffloadEngine::Create(&sim, &client, c.options);
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find(c.field), std::string::npos) << engine.status();
  }
}

TEST_F(EngineTest, CreateRejectsNullDeviceOrClient) {
  SimDevice sim;
  SimClient client(&sim);
  absl::StatusOr<std::unique_ptr<OffloadEngine>> no_device =
      OffloadEngine::Create(nullptr, &client, EngineOptions{});
  EXPECT_NE(no_device.status().message().find("device"), std::string::npos);
  absl::StatusOr<std::unique_ptr<OffloadEngine>> no_client =
      OffloadEngine::Create(&sim, nullptr, EngineOptions{});
  EXPECT_NE(no_client.status().message().find("client"), std::string::npos);
}

TEST_F(EngineTest, BadCallsAreReportedNotFatal) {
  EngineHarness harness(Options(1, 1));
  OffloadEngine& engine = harness.engine();
  absl::StatusOr<OffloadEngine::Offer> unknown_group = engine.OfferEntry(
      12345, harness.client().NewSource(16, 0), 16, /*source=*/0, harness.compute());
  EXPECT_EQ(unknown_group.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<GroupId> group = engine.BeginGroup(harness.compute());
  ASSERT_TRUE(group.ok());
  absl::StatusOr<OffloadEngine::Offer> null_source =
      engine.OfferEntry(*group, nullptr, 16, /*source=*/0, harness.compute());
  EXPECT_EQ(null_source.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(null_source.status().message().find("device_src"), std::string::npos);
  EXPECT_EQ(engine.Acquire(999, harness.compute()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(engine.Discard(999));
  // A zero-byte entry has nothing to move: it stays resident.
  void* empty = harness.client().NewSource(0, 0);
  const SourceToken token = harness.client().FileSource(empty, 0);
  absl::StatusOr<OffloadEngine::Offer> zero =
      engine.OfferEntry(*group, empty, 0, token, harness.compute());
  ASSERT_TRUE(zero.ok());
  EXPECT_FALSE(zero->will_offload);
  harness.client().Bind(zero->entry, token);
  absl::StatusOr<OffloadEngine::Acquired> acquired = engine.Acquire(zero->entry, harness.compute());
  ASSERT_TRUE(acquired.ok());
  EXPECT_TRUE(acquired->resident);
  EXPECT_FALSE(engine.Discard(zero->entry));
  harness.client().CallerDropped(zero->entry);
  harness.DrainAndCheck();
  harness.ExpectQuiescent();
}

// ---------------------------------------------------------------------------------------
// Threads: forward on one thread, backward on another (as autograd does), pipelined so
// that step s's backward runs while step s + 1's forward is being issued.

TEST_F(EngineTest, ForwardAndBackwardOnTwoThreads) {
  const int kSteps = 40;
  const StepPlan plan = UniformPlan(6, 4096, 2, 2, 3);
  for (int keep_last : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("keep_last=", keep_last));
    EngineHarness harness(Options(keep_last, 1));
    std::mutex mu;
    std::condition_variable cv;
    std::deque<SavedLayers> ready;  // forwards waiting for their backward
    bool forward_failed = false;

    std::thread forward([&] {
      for (int step = 0; step < kSteps; ++step) {
        SavedLayers saved;
        absl::Status status = harness.Forward(plan, step, &saved);
        std::lock_guard<std::mutex> lock(mu);
        if (!status.ok()) {
          ADD_FAILURE() << "forward " << step << ": " << status;
          forward_failed = true;
          cv.notify_all();
          return;
        }
        ready.push_back(std::move(saved));
        cv.notify_all();
      }
    });
    std::thread backward([&] {
      for (int step = 0; step < kSteps; ++step) {
        SavedLayers saved;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return !ready.empty() || forward_failed; });
          if (ready.empty()) return;
          saved = std::move(ready.front());
          ready.pop_front();
        }
        absl::Status status = harness.Backward(&saved, plan.backward_us);
        if (!status.ok()) {
          ADD_FAILURE() << "backward " << step << ": " << status;
          return;
        }
      }
    });
    forward.join();
    backward.join();
    EXPECT_EQ(harness.DrainAndCheck(),
              static_cast<size_t>(harness.engine().stats().restored_tensors));
    harness.ExpectQuiescent();
    const EngineStats stats = harness.engine().stats();
    EXPECT_EQ(stats.groups, kSteps * plan.layers());
    EXPECT_GT(stats.offloaded_tensors, 0);
    // How many entries were still copying when their backward came depends on the threads'
    // interleaving; each offloaded entry was either restored or reclaimed, exactly once.
    EXPECT_EQ(stats.restored_tensors + stats.reclaimed_tensors, stats.offloaded_tensors);
  }
}

}  // namespace
}  // namespace ckpt_offload
