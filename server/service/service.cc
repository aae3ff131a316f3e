#include "server/service/service.h"

#include <chrono>
#include <deque>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "common/version/build_info.h"
#include "common/wire/dtype.h"
#include "server/service/client_text.h"
#include "server/service/held_bytes.h"
#include "server/service/metrics.h"
#include "server/service/request_parse.h"
#include "server/service/sequence_sums.h"
#include "server/service/shm_registry.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace logitserve {

namespace {

using Clock = Scheduler::Clock;

int64_t MicrosBetween(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration_cast<std::chrono::microseconds>(end - start).count();
}

double SecondsBetween(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

// A backend result must have exactly the requested outputs' sizes; anything else is a backend bug
// and must not reach the client as a silently short array.
absl::Status CheckResultShape(const ScoreJob& job, const ScoreResult& r) {
  auto check = [](const char* name, size_t got, bool wanted, int64_t expected) {
    const size_t want = wanted ? static_cast<size_t>(expected) : 0;
    if (got == want) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("backend returned ", got, " values of ", name, ", expected ", want));
  };
  const int64_t n = job.rows;
  for (absl::Status s : {
           check("target_logprobs", r.target_logprobs.size(), true, n * job.ids_per_row),
           check("top_k_ids", r.top_k_ids.size(), true, n * job.top_k),
           check("top_k_logprobs", r.top_k_logprobs.size(), true, n * job.top_k),
           check("entropy", r.entropy.size(), job.entropy, n),
           check("reference_entropy", r.reference_entropy.size(), job.reference_entropy, n),
           check("forward_kl", r.forward_kl.size(), job.forward_kl, n),
           check("reverse_kl", r.reverse_kl.size(), job.reverse_kl, n),
           check("jsd", r.jsd.size(), job.jsd_beta.has_value(), n),
       }) {
    LOGITSERVE_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

template <typename T, typename Field>
void Assign(const std::vector<T>& from, Field* to) {
  to->Reserve(static_cast<int>(from.size()));
  to->Add(from.begin(), from.end());
}

// Why a call's work should stop: the client cancelled or its deadline passed.
absl::Status StopStatus(grpc::CallbackServerContext* context) {
  if (context->IsCancelled()) return absl::CancelledError("the call was cancelled");
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline expired before its result was ready");
  }
  return absl::OkStatus();
}

// Counts per-call state objects for the created == released metric (leak detection).
class CallStateCount {
 public:
  explicit CallStateCount(Metrics* metrics) : metrics_(metrics) {
    if (metrics_ != nullptr) metrics_->CallStateCreated();
  }
  ~CallStateCount() {
    if (metrics_ != nullptr) metrics_->CallStateReleased();
  }
  CallStateCount(const CallStateCount&) = delete;
  CallStateCount& operator=(const CallStateCount&) = delete;

 private:
  Metrics* const metrics_;
};

}  // namespace

ScorerService::ScorerService(Backend* backend, HeadStore* heads, const ServiceOptions& options)
    : backend_(backend),
      heads_(heads),
      options_(options),
      scheduler_(backend, options.scheduler,
                 SchedulerHooks{
                     .on_batch =
                         [metrics = options.metrics](int64_t requests, int64_t rows) {
                           if (metrics != nullptr) metrics->ObserveBatch(requests, rows);
                         },
                     .on_queue_depth =
                         [metrics = options.metrics](int64_t depth) {
                           if (metrics != nullptr) metrics->SetQueueDepth(depth);
                         },
                     .on_fatal = options.on_fatal,
                 }) {}

ScorerService::~ScorerService() { StopWorkers(); }

void ScorerService::StartDraining() { draining_.store(true); }

void ScorerService::StopWorkers() { scheduler_.Stop(); }

absl::Status ScorerService::Authorize(const grpc::CallbackServerContext& context, Role role) const {
  return options_.authorizer == nullptr ? absl::OkStatus()
                                        : options_.authorizer->Check(context, role);
}

void ScorerService::RecordRequest(const char* method, const grpc::Status& status) {
  if (options_.metrics != nullptr) options_.metrics->RecordRequest(method, status.error_code());
}

int64_t ScorerService::Submit(const v1::ScoreRequest& request, std::function<absl::Status()> stop,
                              Completion done) {
  if (draining_.load()) {
    done(absl::UnavailableError("server is shutting down"), {}, {}, {}, {}, 0);
    return 0;
  }
  // Leases on the shared-memory regions the request's tensors name: they keep the regions mapped
  // (and their Unregister calls waiting) until the job is done.
  auto leases = std::make_shared<std::vector<std::shared_ptr<const SharedMemoryRegion>>>();
  absl::StatusOr<ValidatedRequest> validated = ValidateScoreRequest(
      request, [this](const std::string& name) { return heads_->Find(name); }, options_.limits,
      [this, &leases](absl::string_view field, const v1::SharedMemoryRef& ref,
                      uint64_t bytes) -> absl::StatusOr<absl::string_view> {
        if (options_.shared_memory == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".shared_memory: this server takes no shared-memory inputs"));
        }
        LOGITSERVE_ASSIGN_OR_RETURN(
            SharedMemoryRegistry::Resolved r,
            options_.shared_memory->Resolve(field, ref.region(), ref.offset(), bytes));
        leases->push_back(std::move(r.lease));
        return r.bytes;
      });
  if (!validated.ok()) {
    spdlog::debug("Score request '{}' rejected: {}", QuoteClientText(request.request_id()),
                  validated.status().ToString());
    done(validated.status(), {}, {}, {}, {}, 0);
    return 0;
  }
  // The NaN / +-inf scan of the hidden states runs here, on the gRPC thread that received the
  // request, not on a scheduler worker: the receiving threads of many connections (and of the
  // chunks of a pipelined call) scan in parallel while the workers keep the backend busy. Its
  // time is reported inside compute_us (it is the server's work on the request's values).
  const Clock::time_point scan_start = Clock::now();
  if (absl::Status finite = CheckHiddenStatesFinite(validated->job); !finite.ok()) {
    spdlog::debug("Score request '{}' rejected: {}", QuoteClientText(request.request_id()),
                  finite.ToString());
    done(finite, {}, {}, {}, {}, 0);
    return 0;
  }
  validated->finite_check_us = MicrosBetween(scan_start, Clock::now());
  const int64_t extra_bytes = ExtraHeldBytes(request, *validated);
  // The job moves into the scheduler's item (which hands it back to `done`); the rest of the
  // validated request (sequence lengths, versions) travels with the completion.
  Scheduler::Item item;
  item.job = std::move(validated->job);
  item.extra_bytes = extra_bytes;
  const int64_t bytes = Scheduler::ItemBytes(item);
  auto state = std::make_shared<ValidatedRequest>(*std::move(validated));
  item.stop = std::move(stop);
  Metrics* metrics = options_.metrics;
  item.done = [state, done, metrics, leases, bytes, id = QuoteClientText(request.request_id())](
                  absl::Status status, ScoreResult result, const ScoreJob& job,
                  const Scheduler::Timing& timing) {
    if (status.ok()) status = CheckResultShape(job, result);
    if (metrics != nullptr) {
      metrics->AddInFlight(-1);
      metrics->ObserveQueueLatency(SecondsBetween(timing.enqueued, timing.started));
      if (status.ok()) {
        metrics->ObserveComputeLatency(SecondsBetween(timing.started, timing.finished));
        metrics->AddTokensScored(job.rows);
      }
    }
    if (!status.ok()) {
      if (absl::IsInvalidArgument(status) || absl::IsCancelled(status) ||
          absl::IsDeadlineExceeded(status)) {
        spdlog::debug("Score request '{}': {}", id, status.ToString());
      } else {
        spdlog::error("Score request '{}' failed: {}", id, status.ToString());
      }
    }
    done(std::move(status), result, job, *state, timing, bytes);
  };
  if (metrics != nullptr) metrics->AddInFlight(1);
  absl::Status admitted = scheduler_.Submit(std::move(item));
  if (!admitted.ok()) {
    if (metrics != nullptr) metrics->AddInFlight(-1);
    done(admitted, {}, {}, {}, {}, 0);
    return 0;
  }
  return bytes;
}

void ScorerService::FillResponse(const v1::ScoreRequest& request, const ScoreJob& job,
                                 const ValidatedRequest& validated, const ScoreResult& result,
                                 const Scheduler::Timing& timing, v1::ScoreResponse* out) {
  out->set_request_id(request.request_id());
  Assign(result.target_logprobs, out->mutable_target_logprobs());
  Assign(result.top_k_ids, out->mutable_top_k_ids());
  Assign(result.top_k_logprobs, out->mutable_top_k_logprobs());
  Assign(result.entropy, out->mutable_entropy());
  Assign(result.reference_entropy, out->mutable_reference_entropy());
  Assign(result.forward_kl, out->mutable_forward_kl());
  Assign(result.reverse_kl, out->mutable_reverse_kl());
  Assign(result.jsd, out->mutable_jsd());
  out->set_target_ids_per_row(static_cast<uint32_t>(job.ids_per_row));
  out->set_top_k(static_cast<uint32_t>(job.top_k));
  if (!validated.sequence_lengths.empty()) {
    ComputeSequenceSums(job, validated.sequence_lengths, result, out->mutable_sequence_sums(),
                        out->mutable_sequence_means());
  }
  out->set_head_version(validated.head_version);
  out->set_reference_head_version(validated.reference_head_version);
  out->set_queue_us(MicrosBetween(timing.enqueued, timing.started));
  out->set_compute_us(MicrosBetween(timing.started, timing.finished) + validated.finite_check_us);
}

// Registered raw: the request is parsed here (request_parse.h: each tensor allocated once, at its
// size; gRPC's own parse reallocated it as it grew), and one that does not parse is answered
// INVALID_ARGUMENT (gRPC's typed handler answers UNIMPLEMENTED before any handler runs).
grpc::ServerUnaryReactor* ScorerService::Score(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request_bytes,
                                               grpc::ByteBuffer* response_bytes) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto calls = std::make_shared<CallStateCount>(options_.metrics);
  auto finish = [this, reactor, calls](const grpc::Status& status) {
    RecordRequest("Score", status);
    reactor->Finish(status);
  };
  if (absl::Status auth = Authorize(*context, Role::kUser); !auth.ok()) {
    finish(ToGrpcStatus(auth));
    return reactor;
  }
  if (!request_bytes->Valid()) {
    // No request message: gRPC runs a raw handler even for a call that ended (the client
    // cancelled, the stream was reset) before its message arrived; the typed handler never ran
    // for one. Counted as cancelled, not as an invalid request (the cancellation itself may not
    // be visible on the context yet).
    finish(grpc::Status(grpc::StatusCode::CANCELLED,
                        "the call ended before its request message arrived"));
    return reactor;
  }
  auto request = std::make_shared<v1::ScoreRequest>();
  if (!ParseScoreRequest(*request_bytes, request.get())) {
    finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     "the request is not a valid logitserve.v1.ScoreRequest (it does not parse)"));
    return reactor;
  }
  Submit(
      *request, [context] { return StopStatus(context); },
      [request, response_bytes, finish](absl::Status status, const ScoreResult& result,
                                        const ScoreJob& job, const ValidatedRequest& validated,
                                        const Scheduler::Timing& timing,
                                        int64_t /*admitted_bytes*/) {
        if (status.ok()) {
          v1::ScoreResponse response;
          FillResponse(*request, job, validated, result, timing, &response);
          bool own_buffer = false;
          const grpc::Status serialized = grpc::SerializationTraits<v1::ScoreResponse>::Serialize(
              response, response_bytes, &own_buffer);
          if (!serialized.ok()) {
            finish(serialized);
            return;
          }
        }
        finish(ToGrpcStatus(status));
      });
  return reactor;
}

// A request of a shared-memory channel (shared_memory_rpc.cc): Score's path without gRPC.
void ScorerService::ServeChannelRequest(const v1::ScoreRequest& request,
                                        std::function<absl::Status()> stop,
                                        ShmChannel::Answer answer) {
  auto calls = std::make_shared<CallStateCount>(options_.metrics);
  Submit(request, std::move(stop),
         [this, &request, answer = std::move(answer), calls](
             absl::Status status, const ScoreResult& result, const ScoreJob& job,
             const ValidatedRequest& validated, const Scheduler::Timing& timing,
             int64_t /*admitted_bytes*/) {
           RecordRequest("OpenSharedMemoryChannel", ToGrpcStatus(status));
           if (!status.ok()) {
             answer(status, nullptr);
             return;
           }
           v1::ScoreResponse response;
           FillResponse(request, job, validated, result, timing, &response);
           answer(status, &response);
         });
}

// One ScoreStream call. Reads requests one at a time, writes responses in completion order, one
// write at a time, and finishes once the client has half-closed and every request is answered.
//
// Back-pressure: the next request is read only while fewer than kMaxInFlightPerStream requests
// are computing or answered-but-unsent, and while the stream's window (the admitted bytes of its
// requests in flight plus the bytes of its unsent responses) is below
// ServiceOptions::stream_window_bytes. A client that stops reading (HTTP/2 window 0) thus stops
// the stream from reading and computing: it holds at most the window plus one request's bytes.
// Unsent responses also count against the server's memory budget (Scheduler::AddHeldBytes) until
// written or dropped.
//
// gRPC methods (StartRead, StartWrite, Finish) are called outside mu_; the reactor deletes itself
// in OnDone, which gRPC calls after Finish, and Finish is only called when no scheduler work of
// the stream remains.
class ScorerService::StreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(ScorerService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), calls_(service->options_.metrics) {
    if (absl::Status auth = service_->Authorize(*context_, Role::kUser); !auth.ok()) {
      const grpc::Status status = ToGrpcStatus(auth);
      service_->RecordRequest("ScoreStream", status);
      finished_ = true;
      Finish(status);
      return;
    }
    StartRead(&reading_);
  }

  ~StreamReactor() override {
    // Responses never written (the call ended first) stop counting against the budget.
    absl::MutexLock lock(&mu_);
    ReleaseUnsentLocked(unsent_bytes_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close, cancellation or a broken stream
      Actions a;
      {
        absl::MutexLock lock(&mu_);
        reads_done_ = true;
        a = NextActionsLocked();
      }
      Run(a);
      return;
    }
    ++messages_read_;
    auto parsed = std::make_shared<v1::ScoreStreamRequest>();
    const bool parse = ParseScoreStreamRequest(reading_, parsed.get());
    reading_.Clear();
    {
      absl::MutexLock lock(&mu_);
      ++in_flight_;
    }
    if (!parse) {
      // Answered like any failed request (no request_id: it could not be read); the stream goes on.
      auto response = std::make_unique<v1::ScoreStreamResponse>();
      const absl::Status status = absl::InvalidArgumentError(
          absl::StrCat("ScoreStream message ", messages_read_,
                       " is not a valid logitserve.v1.ScoreStreamRequest (it does not parse)"));
      response->set_status_code(static_cast<int32_t>(status.code()));
      response->set_status_message(std::string(status.message()));
      service_->RecordRequest("ScoreStream", ToGrpcStatus(status));
      Completed(std::move(response), 0);
      Actions a;
      {
        absl::MutexLock lock(&mu_);
        if (CanReadLocked()) {
          a.read = true;
        } else {
          read_paused_ = true;
        }
      }
      Run(a);
      return;
    }
    // The stream message owns the request, so it lives until `done` has run.
    std::shared_ptr<const v1::ScoreStreamRequest> message = std::move(parsed);
    const int64_t admitted = service_->Submit(
        message->request(), [context = context_] { return StopStatus(context); },
        [this, message](absl::Status status, const ScoreResult& result, const ScoreJob& job,
                        const ValidatedRequest& validated, const Scheduler::Timing& timing,
                        int64_t admitted_bytes) {
          const v1::ScoreRequest& request = message->request();
          auto response = std::make_unique<v1::ScoreStreamResponse>();
          response->set_request_id(request.request_id());
          if (status.ok()) {
            FillResponse(request, job, validated, result, timing, response->mutable_response());
          } else {
            response->set_status_code(static_cast<int32_t>(status.code()));
            response->set_status_message(CapMessage(status.message()));
          }
          service_->RecordRequest("ScoreStream", ToGrpcStatus(status));
          Completed(std::move(response), admitted_bytes);
        });
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      window_bytes_ += admitted;
      if (CanReadLocked()) {
        a.read = true;
      } else {
        read_paused_ = true;  // resumed by a completion or a finished write
      }
    }
    Run(a);
  }

  void OnWriteDone(bool ok) override {
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      ReleaseUnsentLocked(writing_bytes_);
      writing_.reset();
      writing_bytes_ = 0;
      if (!ok) {  // the client is gone: nothing more can be written
        broken_ = true;
        DropPendingLocked();
      }
      a = NextActionsLocked();
      a.read = ResumeReadLocked();
    }
    Run(a);
  }

  void OnDone() override { delete this; }

 private:
  // What to do outside the lock.
  struct Actions {
    bool read = false;
    grpc::ByteBuffer* write = nullptr;
    bool finish = false;
  };
  struct Unsent {
    std::unique_ptr<grpc::ByteBuffer> response;  // serialized
    int64_t bytes = 0;
  };

  // Runs on a scheduler worker from the request's `done` (or inline when it was refused), before
  // the scheduler releases the request's own bytes: the response's bytes are handed over.
  void Completed(std::unique_ptr<v1::ScoreStreamResponse> response, int64_t admitted_bytes) {
    // Serialized here, outside the lock: the message is freed at once, and the bytes held until
    // the write are exactly the buffer's.
    auto buffer = std::make_unique<grpc::ByteBuffer>();
    bool own = false;
    bool serialized =
        grpc::SerializationTraits<v1::ScoreStreamResponse>::Serialize(*response, buffer.get(), &own)
            .ok();
    if (!serialized) {  // over protobuf's 2 GiB message limit (only raised limits get there)
      v1::ScoreStreamResponse failed;
      failed.set_request_id(response->request_id());
      failed.set_status_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
      failed.set_status_message("the response is too large to serialize; split the request");
      buffer = std::make_unique<grpc::ByteBuffer>();
      serialized =
          grpc::SerializationTraits<v1::ScoreStreamResponse>::Serialize(failed, buffer.get(), &own)
              .ok();
    }
    response.reset();
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      // Submit may not have returned yet (a fast completion): its bytes are subtracted here and
      // added there, so the window is right once both ran.
      window_bytes_ -= admitted_bytes;
      if (!broken_ && serialized) {
        const auto bytes = static_cast<int64_t>(buffer->Length());
        unsent_bytes_ += bytes;
        window_bytes_ += bytes;
        service_->scheduler_.AddHeldBytes(bytes);
        pending_.push_back(Unsent{std::move(buffer), bytes});
      }
      Actions next = NextActionsLocked();
      a.write = next.write;
      a.finish = next.finish;
      a.read = ResumeReadLocked();
    }
    Run(a);
  }

  bool CanReadLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t unsent = static_cast<int64_t>(pending_.size()) + (writing_ != nullptr ? 1 : 0);
    return !reads_done_ && !broken_ && in_flight_ + unsent < kMaxInFlightPerStream &&
           window_bytes_ < service_->options_.stream_window_bytes;
  }

  // Whether a paused read may start now (then it is no longer paused).
  bool ResumeReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!read_paused_ || !CanReadLocked()) return false;
    read_paused_ = false;
    return true;
  }

  void ReleaseUnsentLocked(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (bytes == 0) return;
    unsent_bytes_ -= bytes;
    window_bytes_ -= bytes;
    service_->scheduler_.AddHeldBytes(-bytes);
  }

  void DropPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Unsent& u : pending_) ReleaseUnsentLocked(u.bytes);
    pending_.clear();
  }

  Actions NextActionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Actions a;
    if (broken_ && read_paused_) {
      // No read is outstanding and none will start: the stream has read its last message.
      read_paused_ = false;
      reads_done_ = true;
    }
    if (writing_ == nullptr && !pending_.empty()) {
      writing_ = std::move(pending_.front().response);
      writing_bytes_ = pending_.front().bytes;
      pending_.pop_front();
      a.write = writing_.get();
    }
    if (!finished_ && reads_done_ && in_flight_ == 0 && writing_ == nullptr && pending_.empty()) {
      finished_ = true;
      a.finish = true;
    }
    return a;
  }

  void Run(const Actions& a) {
    if (a.read) StartRead(&reading_);
    if (a.write != nullptr) StartWrite(a.write);
    if (a.finish) {
      const grpc::Status status = context_->IsCancelled()
                                      ? grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")
                                      : grpc::Status::OK;
      Finish(status);  // may delete this (OnDone): nothing after it
    }
  }

  ScorerService* const service_;
  grpc::CallbackServerContext* const context_;
  CallStateCount calls_;
  // Only touched by StartRead and OnReadDone, which gRPC never runs concurrently, and by Run
  // when it resumes a paused read (no read is outstanding then).
  grpc::ByteBuffer reading_;
  int64_t messages_read_ = 0;
  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;  // true: no read outstanding
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Admitted bytes of requests in flight plus bytes of unsent responses.
  int64_t window_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of unsent responses (pending_ and writing_), held against the memory budget.
  int64_t unsent_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<grpc::ByteBuffer> writing_ ABSL_GUARDED_BY(mu_);
  int64_t writing_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Unsent> pending_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ScorerService::ScoreStream(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

void ScorerService::FillHeadInfo(const HeadWeights& w, const Backend& backend, v1::HeadInfo* info) {
  info->set_name(w.name);
  info->set_vocab_size(w.vocab_size);
  info->set_hidden_size(w.hidden_size);
  info->set_dtype(wire::DTypeOf(w.dtype));
  info->set_version(w.version);
  for (const ShardRange& shard : backend.ShardLayout(w.vocab_size)) {
    v1::ShardRange* s = info->add_shards();
    s->set_shard(shard.shard);
    s->set_vocab_begin(shard.begin);
    s->set_vocab_end(shard.end);
  }
  info->set_has_bias(!w.bias.empty());
  info->set_logit_scale(w.transform.logit_scale);
  info->set_logits_scaling(w.transform.logits_scaling);
  info->set_final_logit_softcapping(w.transform.softcap);
  info->set_source(w.source);
}

grpc::ServerUnaryReactor* ScorerService::ListHeads(grpc::CallbackServerContext* context,
                                                   const v1::ListHeadsRequest* /*request*/,
                                                   v1::ListHeadsResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  CallStateCount calls(options_.metrics);
  if (absl::Status auth = Authorize(*context, Role::kUser); !auth.ok()) {
    const grpc::Status status = ToGrpcStatus(auth);
    RecordRequest("ListHeads", status);
    reactor->Finish(status);
    return reactor;
  }
  for (const std::shared_ptr<const PreparedHead>& head : heads_->List()) {
    FillHeadInfo(head->weights(), *backend_, response->add_heads());
  }
  response->set_backend(backend_->name());
  response->set_max_top_k(static_cast<uint32_t>(options_.limits.max_top_k));
  response->set_max_tokens_per_request(options_.limits.max_tokens_per_request);
  response->set_max_receive_message_bytes(options_.max_receive_message_bytes);
  const BuildInfo& build = GetBuildInfo();
  v1::ServerInfo* info = response->mutable_server_info();
  info->set_version(std::string(build.version));
  info->set_git_commit(std::string(build.git_commit));
  info->set_build_type(std::string(build.build_type));
  info->set_backends(std::string(build.backends()));
  info->set_cuda_version(std::string(build.cuda_version));
  info->set_nccl_version(std::string(build.nccl_version));
  info->set_cuda_architectures(std::string(build.cuda_architectures));
  RecordRequest("ListHeads", grpc::Status::OK);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace logitserve
