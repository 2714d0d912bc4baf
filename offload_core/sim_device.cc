// SimDevice: a discrete-event simulation of streams, events and two copy engines.
//
// Design note
// - The simulation keeps its own clock (now_us_) that never runs past host time; after
//   every public call both are equal. A call first runs the simulation up to host time,
//   then acts, then settles again so that work it enqueued on an idle stream starts at
//   once (an op issued at time t on an idle stream starts at t, as on a GPU).
// - Running the simulation alternates two steps:
//     Settle():        process everything due at now_us_ (finish ops, retire records,
//                      release satisfied waits, start computes, hand free copy engines
//                      the earliest-issued ready copy) until nothing changes;
//     AdvanceClock(t): move time to the next state change (or the target), draining the
//                      bytes of copies in flight at their current rates.
//   Rates only change when a copy starts or ends its transfer, which are both step
//   boundaries, so between steps every rate is constant and remaining bytes are exact
//   up to floating-point rounding.
// - A copy engine serves the earliest-issued copy among those at the head of their stream
//   (i.e. whose stream-order dependencies are met). Serving strictly in issue order would
//   let a copy stuck behind an event wait block an unrelated, later-issued copy of another
//   stream, a false deadlock the hardware does not have; with one copy stream per direction
//   (the engine's use) both rules give the same order.
// - Records complete when they reach the head of their stream. Each record is a separate
//   shared state: the event points at its latest record, and a wait holds the record that
//   was current when StreamWaitEvent was called, so re-recording does not move old waits.
// - Hazard rules only consider copies issued before the reading op: a copy issued later
//   that overwrites memory an earlier op reads is a write-after-read, not a read that ran
//   ahead of its producer.
#include "offload_core/sim_device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "offload_core/fault_hooks.h"

namespace ckpt_offload {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// 1 GB/s = 1e9 bytes/s = 1e3 bytes/us.
constexpr double kBytesPerUsPerGbps = 1e3;

enum Direction : int { kD2H = 0, kH2D = 1, kDirections = 2 };

const char* DirectionName(int direction) { return direction == kD2H ? "d2h" : "h2d"; }

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0 || a == nullptr || b == nullptr) return false;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(a);
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

std::string Range(const void* p, size_t bytes) { return absl::StrFormat("[%p, +%u)", p, bytes); }

// Contract violations in calls that have no way to report an error.
[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "SimDevice: %s\n", message.c_str());
  std::abort();
}

// One RecordEvent: completes when it reaches the head of its stream.
struct RecordState {
  bool done = false;
  double done_us = 0;
};

struct Op {
  enum class Kind { kCompute, kCopy, kRecord, kWait };
  Kind kind;
  uint64_t seq = 0;  // global issue order
  StreamHandle stream = 0;

  // kCompute
  double duration_us = 0;
  std::vector<SimBufferRef> reads;
  std::string label;

  // kCopy
  int direction = kD2H;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  double transfer_start_us = 0;  // start_us + copy latency: bytes flow from here
  double remaining_bytes = 0;

  // kRecord, kWait
  std::shared_ptr<RecordState> record;
  EventHandle event = 0;

  // Progress. A compute or copy has started once it occupies its stream / engine; a wait
  // is "blocked" from when it reaches the head of its stream unsatisfied.
  bool started = false;
  double start_us = 0;
  double end_us = 0;  // kCompute: known at start
  bool blocked = false;
  double blocked_since_us = 0;

  const void* host_side() const { return direction == kD2H ? dst : src; }
  const void* device_side() const { return direction == kD2H ? src : dst; }
};

struct Stream {
  std::deque<std::unique_ptr<Op>> ops;
  double blocked_us = 0;  // finished waits only
  double compute_us = 0;  // finished computes only
};

struct EventState {
  std::shared_ptr<RecordState> current;  // null: never recorded
};

}  // namespace

struct SimDevice::Impl {
  explicit Impl(SimDeviceOptions opts) : options(opts) {
    // Stream 0 plus the two copy streams.
    streams.resize(3);
  }

  ~Impl() {
    for (auto& [data, bytes] : device_buffers) std::free(data);
    for (void* data : deferred_device_frees) std::free(data);
  }

  static constexpr StreamHandle kD2HStream = 1;
  static constexpr StreamHandle kH2DStream = 2;

  // ---- Simulation core (all with mu held) ----

  bool ValidStream(StreamHandle stream) const { return stream < streams.size(); }

  // Bytes/us of a copy in `direction`, given which directions are transferring now.
  double Rate(int direction) const {
    const double own = (direction == kD2H ? options.d2h_gbps : options.h2d_gbps);
    const double other = (direction == kD2H ? options.h2d_gbps : options.d2h_gbps);
    const Op* other_copy = engine[1 - direction];
    const bool other_transferring = other_copy != nullptr && IsTransferring(*other_copy);
    double gbps = own;
    if (other_transferring) {
      // Each direction is guaranteed half the bidirectional cap (or all it can use, if
      // less), and may take whatever the other direction leaves over.
      const double bidir = options.bidir_gbps;
      gbps = std::min(own, bidir - std::min(other, bidir / 2));
    }
    return std::max(gbps, 0.0) * kBytesPerUsPerGbps;
  }

  bool IsTransferring(const Op& copy) const {
    return copy.started && now_us >= copy.transfer_start_us && copy.remaining_bytes > 0;
  }

  // Time at which the running copy `copy` next changes state (ends its latency or ends).
  double CopyNextChange(const Op& copy) const {
    if (now_us < copy.transfer_start_us) return copy.transfer_start_us;
    if (copy.remaining_bytes <= 0) return now_us;
    const double rate = Rate(copy.direction);
    if (rate <= 0) return kInfinity;
    return now_us + copy.remaining_bytes / rate;
  }

  double NextChangeTime() const {
    double next = kInfinity;
    for (const Stream& stream : streams) {
      if (stream.ops.empty()) continue;
      const Op& head = *stream.ops.front();
      if (head.kind == Op::Kind::kCompute && head.started) next = std::min(next, head.end_us);
    }
    for (const Op* copy : engine) {
      if (copy != nullptr) next = std::min(next, CopyNextChange(*copy));
    }
    return next;
  }

  // Moves the clock to `t` (no state change is due before `t`), draining copy bytes. A
  // step of zero length still finishes a copy whose remaining bytes are too few to move
  // the clock (now + remaining / rate == now), so the simulation cannot spin in place.
  void AdvanceClock(double t) {
    t = std::max(t, now_us);
    // Rates are evaluated before any copy's bytes change, since they depend on which
    // directions transfer during the interval.
    double rates[kDirections] = {0, 0};
    bool transferring[kDirections] = {false, false};
    for (int d = 0; d < kDirections; ++d) {
      if (engine[d] != nullptr && IsTransferring(*engine[d])) {
        transferring[d] = true;
        rates[d] = Rate(d);
      }
    }
    for (int d = 0; d < kDirections; ++d) {
      if (!transferring[d]) continue;
      Op& copy = *engine[d];
      if (rates[d] <= 0) continue;
      // Same expression as CopyNextChange, so a step to the projected end finishes exactly.
      const double end = now_us + copy.remaining_bytes / rates[d];
      if (t >= end) {
        copy.remaining_bytes = 0;
      } else {
        copy.remaining_bytes = std::max(0.0, copy.remaining_bytes - rates[d] * (t - now_us));
      }
    }
    now_us = t;
  }

  void AddHazard(HazardKind kind, std::string detail) {
    hazards.push_back(Hazard{kind, now_us, std::move(detail)});
  }

  // Copies that were issued before `seq`, are incomplete, and write memory overlapping
  // [data, data + bytes) (restricted to `direction` when given).
  template <typename Fn>
  void ForEachEarlierWriter(uint64_t seq, const void* data, size_t bytes, int direction,
                            Fn&& fn) const {
    for (const auto& [copy_seq, copy] : incomplete_copies) {
      if (copy_seq >= seq) break;
      if (direction >= 0 && copy->direction != direction) continue;
      if (Overlaps(copy->dst, copy->bytes, data, bytes)) fn(*copy);
    }
  }

  void StartCompute(Op& op) {
    op.started = true;
    op.start_us = now_us;
    op.end_us = now_us + op.duration_us;
    for (const SimBufferRef& read : op.reads) {
      ForEachEarlierWriter(op.seq, read.data, read.bytes, /*direction=*/-1, [&](const Op& copy) {
        AddHazard(
            HazardKind::kReadBeforeReady,
            absl::StrCat("compute '", op.label, "' on stream ", op.stream, " reads ",
                         Range(read.data, read.bytes), " while ", DirectionName(copy.direction),
                         " copy #", copy.seq, " on stream ", copy.stream, " writing ",
                         Range(copy.dst, copy.bytes), " is incomplete"));
      });
    }
  }

  void StartCopy(Op& op) {
    op.started = true;
    op.start_us = now_us;
    op.transfer_start_us = now_us + std::max(options.copy_latency_us, 0.0);
    op.remaining_bytes = static_cast<double>(op.bytes);
    engine[op.direction] = &op;
    if (op.direction == kH2D) {
      ForEachEarlierWriter(op.seq, op.src, op.bytes, kD2H, [&](const Op& copy) {
        AddHazard(
            HazardKind::kReadBeforeReady,
            absl::StrCat("h2d copy #", op.seq, " on stream ", op.stream, " reads host ",
                         Range(op.src, op.bytes), " while d2h copy #", copy.seq, " on stream ",
                         copy.stream, " writing ", Range(copy.dst, copy.bytes), " is incomplete"));
      });
    }
  }

  void FinishHead(Stream& stream) {
    std::unique_ptr<Op> op = std::move(stream.ops.front());
    stream.ops.pop_front();
    switch (op->kind) {
      case Op::Kind::kCompute:
        stream.compute_us += op->duration_us;
        timeline.push_back(
            TimelineEntry{op->stream, "compute", op->start_us, now_us, 0, std::move(op->label)});
        break;
      case Op::Kind::kCopy:
        // The bytes land now: a reader that ran ahead saw the old contents.
        if (op->bytes > 0) std::memmove(op->dst, op->src, op->bytes);
        (op->direction == kD2H ? bytes_to_host : bytes_to_device) += op->bytes;
        engine[op->direction] = nullptr;
        incomplete_copies.erase(op->seq);
        timeline.push_back(TimelineEntry{op->stream, DirectionName(op->direction), op->start_us,
                                         now_us, op->bytes, ""});
        break;
      case Op::Kind::kRecord:
        op->record->done = true;
        op->record->done_us = now_us;
        break;
      case Op::Kind::kWait:
        if (op->blocked && now_us > op->blocked_since_us) {
          stream.blocked_us += now_us - op->blocked_since_us;
          timeline.push_back(TimelineEntry{op->stream, "wait", op->blocked_since_us, now_us, 0,
                                           absl::StrCat("event ", op->event)});
        }
        break;
    }
  }

  // Processes everything due at now_us until no state changes.
  void Settle() {
    bool changed = true;
    while (changed) {
      changed = false;
      for (Stream& stream : streams) {
        while (!stream.ops.empty()) {
          Op& head = *stream.ops.front();
          bool finished = false;
          switch (head.kind) {
            case Op::Kind::kCompute:
              if (!head.started) {
                StartCompute(head);
                changed = true;
              }
              finished = now_us >= head.end_us;
              break;
            case Op::Kind::kCopy:
              // Started by the copy-engine pass below; finished when its bytes are moved.
              finished =
                  head.started && now_us >= head.transfer_start_us && head.remaining_bytes <= 0;
              break;
            case Op::Kind::kRecord:
              finished = true;
              break;
            case Op::Kind::kWait:
              finished = head.record->done;
              if (!finished && !head.blocked) {
                head.blocked = true;
                head.blocked_since_us = now_us;
              }
              break;
          }
          if (!finished) break;
          FinishHead(stream);
          changed = true;
        }
      }
      for (int d = 0; d < kDirections; ++d) {
        if (engine[d] != nullptr) continue;
        Op* first = nullptr;
        for (Stream& stream : streams) {
          if (stream.ops.empty()) continue;
          Op& head = *stream.ops.front();
          if (head.kind == Op::Kind::kCopy && !head.started && head.direction == d &&
              (first == nullptr || head.seq < first->seq)) {
            first = &head;
          }
        }
        if (first != nullptr) {
          StartCopy(*first);
          changed = true;
        }
      }
    }
  }

  // Runs the simulation up to `t` (>= now_us).
  void RunUntil(double t) {
    Settle();
    while (true) {
      const double next = NextChangeTime();
      if (next > t) {
        AdvanceClock(t);
        Settle();
        return;
      }
      AdvanceClock(next);
      Settle();
    }
  }

  // Runs the simulation until `done()` or until nothing can change any more (false).
  template <typename Pred>
  bool RunUntilDone(Pred&& done) {
    Settle();
    while (!done()) {
      const double next = NextChangeTime();
      if (next == kInfinity) return false;
      AdvanceClock(next);
      Settle();
    }
    return true;
  }

  // Brings the simulation to host time; every public call starts with this.
  void CatchUp() { RunUntil(host_us); }

  bool AllIdle() const {
    for (const Stream& stream : streams) {
      if (!stream.ops.empty()) return false;
    }
    return true;
  }

  std::string StuckDescription() const {
    std::string out;
    for (StreamHandle s = 0; s < streams.size(); ++s) {
      if (streams[s].ops.empty()) continue;
      const Op& head = *streams[s].ops.front();
      absl::StrAppend(&out, out.empty() ? "" : "; ", "stream ", s, " (", streams[s].ops.size(),
                      " ops) is stuck at ");
      switch (head.kind) {
        case Op::Kind::kWait:
          absl::StrAppend(&out, "a wait on event ", head.event);
          break;
        case Op::Kind::kCopy:
          absl::StrAppend(&out, "a ", DirectionName(head.direction),
                          " copy that cannot progress (zero bandwidth?)");
          break;
        default:
          absl::StrAppend(&out, "an op that cannot progress");
      }
    }
    return out;
  }

  uint64_t Enqueue(StreamHandle stream, std::unique_ptr<Op> op) {
    op->seq = next_seq++;
    op->stream = stream;
    const uint64_t seq = op->seq;
    if (op->kind == Op::Kind::kCopy) incomplete_copies.emplace(seq, op.get());
    streams[stream].ops.push_back(std::move(op));
    Settle();
    return seq;
  }

  absl::Status EnqueueCopy(int direction, void* dst, const void* src, size_t bytes,
                           StreamHandle stream) {
    if (faults::ShouldFail(faults::Fault::kCopy)) {
      return absl::InternalError(
          absl::StrCat("sim device: injected ", DirectionName(direction), " copy failure"));
    }
    std::lock_guard<std::mutex> lock(mu);
    CatchUp();
    if (!ValidStream(stream)) {
      return absl::InvalidArgumentError(absl::StrCat("sim device: unknown stream ", stream));
    }
    if (bytes > 0 && (dst == nullptr || src == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat("sim device: ", DirectionName(direction),
                                                     " copy of ", bytes,
                                                     " bytes with a null pointer"));
    }
    auto op = std::make_unique<Op>();
    op->kind = Op::Kind::kCopy;
    op->direction = direction;
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    Enqueue(stream, std::move(op));
    return absl::OkStatus();
  }

  absl::StatusOr<EventState*> FindEvent(EventHandle event, const char* what) {
    auto it = events.find(event);
    if (it == events.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("sim device: ", what, " of unknown event ", event));
    }
    return &it->second;
  }

  static absl::Status InjectedEventFailure(const char* what) {
    return absl::InternalError(absl::StrCat("sim device: injected event ", what, " failure"));
  }

  // Checks hazards for releasing memory while copies touch it. `host` selects which side
  // of each copy is compared.
  bool CheckRelease(const void* data, size_t bytes, bool host, const char* what) {
    bool in_flight = false;
    for (const auto& [seq, copy] : incomplete_copies) {
      const void* side = host ? copy->host_side() : copy->device_side();
      if (!Overlaps(side, copy->bytes, data, bytes)) continue;
      in_flight = true;
      AddHazard(host ? HazardKind::kHostReuseInFlight : HazardKind::kDeviceReleaseInFlight,
                absl::StrCat(what, " ", Range(data, bytes), " while ",
                             DirectionName(copy->direction), " copy #", seq, " on stream ",
                             copy->stream, copy->started ? " (running)" : " (queued)", " touches ",
                             Range(side, copy->bytes)));
    }
    return in_flight;
  }

  const SimDeviceOptions options;

  mutable std::mutex mu;
  double host_us = 0;
  double now_us = 0;
  uint64_t next_seq = 1;
  // A deque: growing it never moves a Stream (whose op queue is not nothrow-movable).
  std::deque<Stream> streams;
  Op* engine[kDirections] = {nullptr, nullptr};
  // Issued and not finished copies, in issue order (queued or running).
  std::map<uint64_t, Op*> incomplete_copies;
  std::map<EventHandle, EventState> events;
  EventHandle next_event = 1;
  std::map<void*, size_t> device_buffers;
  // Buffers freed while a copy still touched them: kept alive so the late copy cannot
  // corrupt the heap; released with the device.
  std::vector<void*> deferred_device_frees;
  std::vector<TimelineEntry> timeline;
  std::vector<Hazard> hazards;
  size_t bytes_to_host = 0;
  size_t bytes_to_device = 0;
};

SimDevice::SimDevice(SimDeviceOptions options) : impl_(std::make_unique<Impl>(options)) {}
SimDevice::~SimDevice() = default;

StreamHandle SimDevice::d2h_stream() const { return Impl::kD2HStream; }
StreamHandle SimDevice::h2d_stream() const { return Impl::kH2DStream; }

absl::StatusOr<EventHandle> SimDevice::CreateEvent() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  const EventHandle event = impl_->next_event++;
  impl_->events.emplace(event, EventState{});
  return event;
}

void SimDevice::DestroyEvent(EventHandle event) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  // Queued records and waits keep their own RecordState, so they still work (as in CUDA,
  // where destroying an event with pending work is allowed).
  impl_->events.erase(event);
}

absl::Status SimDevice::RecordEvent(EventHandle event, StreamHandle stream) {
  if (faults::ShouldFail(faults::Fault::kEvent)) return Impl::InjectedEventFailure("record");
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  absl::StatusOr<EventState*> state = impl_->FindEvent(event, "record");
  if (!state.ok()) return state.status();
  if (!impl_->ValidStream(stream)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sim device: record on unknown stream ", stream));
  }
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kRecord;
  op->event = event;
  op->record = std::make_shared<RecordState>();
  (*state)->current = op->record;
  impl_->Enqueue(stream, std::move(op));
  return absl::OkStatus();
}

absl::Status SimDevice::StreamWaitEvent(StreamHandle stream, EventHandle event) {
  if (faults::ShouldFail(faults::Fault::kEvent)) return Impl::InjectedEventFailure("wait");
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  absl::StatusOr<EventState*> state = impl_->FindEvent(event, "wait");
  if (!state.ok()) return state.status();
  if (!impl_->ValidStream(stream)) {
    return absl::InvalidArgumentError(absl::StrCat("sim device: wait on unknown stream ", stream));
  }
  // CUDA: waiting on an event that was never recorded does nothing.
  if ((*state)->current == nullptr) return absl::OkStatus();
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kWait;
  op->event = event;
  op->record = (*state)->current;
  impl_->Enqueue(stream, std::move(op));
  return absl::OkStatus();
}

absl::StatusOr<bool> SimDevice::EventDone(EventHandle event) {
  if (faults::ShouldFail(faults::Fault::kEvent)) return Impl::InjectedEventFailure("query");
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  absl::StatusOr<EventState*> state = impl_->FindEvent(event, "query");
  if (!state.ok()) return state.status();
  const std::shared_ptr<RecordState>& record = (*state)->current;
  return record == nullptr || record->done;
}

absl::Status SimDevice::SynchronizeEvent(EventHandle event) {
  if (faults::ShouldFail(faults::Fault::kEvent)) {
    return Impl::InjectedEventFailure("synchronize");
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  absl::StatusOr<EventState*> state = impl_->FindEvent(event, "synchronize");
  if (!state.ok()) return state.status();
  std::shared_ptr<RecordState> record = (*state)->current;
  if (record == nullptr || record->done) return absl::OkStatus();
  const bool completed = impl_->RunUntilDone([&] { return record->done; });
  // The host waited until the event completed, or until the device went quiet.
  impl_->host_us = std::max(impl_->host_us, impl_->now_us);
  if (!completed) {
    // Nothing can change without the host, which is blocked here: a deadlock.
    return absl::FailedPreconditionError(absl::StrCat(
        "sim device: event ", event, " can never complete: ", impl_->StuckDescription()));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> SimDevice::ElapsedMs(EventHandle start, EventHandle end) {
  if (faults::ShouldFail(faults::Fault::kEvent)) return Impl::InjectedEventFailure("elapsed");
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  absl::StatusOr<EventState*> start_state = impl_->FindEvent(start, "elapsed time");
  if (!start_state.ok()) return start_state.status();
  absl::StatusOr<EventState*> end_state = impl_->FindEvent(end, "elapsed time");
  if (!end_state.ok()) return end_state.status();
  const RecordState* records[2] = {(*start_state)->current.get(), (*end_state)->current.get()};
  const EventHandle handles[2] = {start, end};
  for (int i = 0; i < 2; ++i) {
    if (records[i] == nullptr) {
      // As cudaEventElapsedTime: a never-recorded event has no timestamp.
      return absl::InvalidArgumentError(
          absl::StrCat("sim device: elapsed time of event ", handles[i], " never recorded"));
    }
    if (!records[i]->done) {
      return absl::FailedPreconditionError(
          absl::StrCat("sim device: elapsed time of event ", handles[i], " not done yet"));
    }
  }
  return (records[1]->done_us - records[0]->done_us) / 1e3;
}

absl::Status SimDevice::CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                                   StreamHandle stream) {
  return impl_->EnqueueCopy(kD2H, host_dst, device_src, bytes, stream);
}

absl::Status SimDevice::CopyToDevice(void* device_dst, const void* host_src, size_t bytes,
                                     StreamHandle stream) {
  return impl_->EnqueueCopy(kH2D, device_dst, host_src, bytes, stream);
}

std::unique_ptr<HostMemoryBackend> SimDevice::MakeHostBackend() { return MakeAlignedHostBackend(); }

void SimDevice::OnHostBlockFreed(const void* host, size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  impl_->CheckRelease(host, bytes, /*host=*/true, "host block freed");
}

void SimDevice::OnDeviceSourceReleased(const void* device, size_t bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  impl_->CheckRelease(device, bytes, /*host=*/false, "device source released");
}

StreamHandle SimDevice::CreateStream() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  impl_->streams.emplace_back();
  return impl_->streams.size() - 1;
}

void SimDevice::Compute(StreamHandle stream, double duration_us, std::vector<SimBufferRef> reads,
                        std::string label) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  if (!impl_->ValidStream(stream)) Die(absl::StrCat("Compute on unknown stream ", stream));
  if (!(duration_us >= 0)) Die(absl::StrCat("Compute with negative duration ", duration_us));
  auto op = std::make_unique<Op>();
  op->kind = Op::Kind::kCompute;
  op->duration_us = duration_us;
  op->reads = std::move(reads);
  op->label = std::move(label);
  impl_->Enqueue(stream, std::move(op));
}

void* SimDevice::AllocateDeviceBuffer(size_t bytes) {
  // Rounded up so aligned_alloc's size rule holds; at least one byte so the pointer is
  // unique and never null.
  const size_t rounded =
      std::max<size_t>(kHostBlockAlignment, (bytes + kHostBlockAlignment - 1) /
                                                kHostBlockAlignment * kHostBlockAlignment);
  void* data = std::aligned_alloc(kHostBlockAlignment, rounded);
  if (data == nullptr) Die(absl::StrCat("AllocateDeviceBuffer(", bytes, ") out of memory"));
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  impl_->device_buffers.emplace(data, bytes);
  return data;
}

void SimDevice::FreeDeviceBuffer(void* data) {
  if (data == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  auto it = impl_->device_buffers.find(data);
  if (it == impl_->device_buffers.end()) {
    Die(absl::StrFormat("FreeDeviceBuffer(%p) of a pointer not from AllocateDeviceBuffer", data));
  }
  const size_t bytes = it->second;
  impl_->device_buffers.erase(it);
  if (impl_->CheckRelease(data, bytes, /*host=*/false, "device buffer freed")) {
    impl_->deferred_device_frees.push_back(data);
  } else {
    std::free(data);
  }
}

void SimDevice::AdvanceHost(double us) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (us > 0) impl_->host_us += us;
  impl_->CatchUp();
}

absl::Status SimDevice::SynchronizeAll() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->CatchUp();
  const bool drained = impl_->RunUntilDone([&] { return impl_->AllIdle(); });
  impl_->host_us = std::max(impl_->host_us, impl_->now_us);
  if (!drained) {
    return absl::FailedPreconditionError(
        absl::StrCat("sim device: streams can never drain: ", impl_->StuckDescription()));
  }
  return absl::OkStatus();
}

double SimDevice::host_time_us() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->host_us;
}

std::vector<SimDevice::TimelineEntry> SimDevice::timeline() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->timeline;
}

std::vector<SimDevice::Hazard> SimDevice::hazards() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->hazards;
}

const char* SimDevice::HazardName(HazardKind kind) {
  switch (kind) {
    case HazardKind::kReadBeforeReady:
      return "read_before_ready";
    case HazardKind::kHostReuseInFlight:
      return "host_reuse_in_flight";
    case HazardKind::kDeviceReleaseInFlight:
      return "device_release_in_flight";
  }
  return "unknown";
}

double SimDevice::blocked_us(StreamHandle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->ValidStream(stream)) return 0;
  const Stream& s = impl_->streams[stream];
  double total = s.blocked_us;
  // A wait still blocking counts up to now.
  if (!s.ops.empty() && s.ops.front()->kind == Op::Kind::kWait && s.ops.front()->blocked) {
    total += impl_->now_us - s.ops.front()->blocked_since_us;
  }
  return total;
}

double SimDevice::compute_us(StreamHandle stream) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->ValidStream(stream)) return 0;
  const Stream& s = impl_->streams[stream];
  double total = s.compute_us;
  // A compute still running counts up to now.
  if (!s.ops.empty() && s.ops.front()->kind == Op::Kind::kCompute && s.ops.front()->started) {
    total += impl_->now_us - s.ops.front()->start_us;
  }
  return total;
}

size_t SimDevice::bytes_copied_to_host() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bytes_to_host;
}

size_t SimDevice::bytes_copied_to_device() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bytes_to_device;
}

}  // namespace ckpt_offload
