#include "server/service/service.h"

#include <chrono>
#include <deque>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/version/build_info.h"
#include "common/wire/dtype.h"
#include "server/service/metrics.h"
#include "server/service/sequence_sums.h"
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
    if (!s.ok()) return s;
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

void ScorerService::Submit(grpc::CallbackServerContext* context, const v1::ScoreRequest& request,
                           Completion done) {
  if (draining_.load()) {
    done(absl::UnavailableError("server is shutting down"), {}, {}, {}, {});
    return;
  }
  absl::StatusOr<ValidatedRequest> validated = ValidateScoreRequest(
      request, [this](const std::string& name) { return heads_->Find(name); }, options_.limits);
  if (!validated.ok()) {
    spdlog::debug("Score request '{}' rejected: {}", request.request_id(),
                  validated.status().ToString());
    done(validated.status(), {}, {}, {}, {});
    return;
  }
  // The job moves into the scheduler's item (which hands it back to `done`); the rest of the
  // validated request (sequence lengths, versions) travels with the completion.
  Scheduler::Item item;
  item.job = std::move(validated->job);
  auto state = std::make_shared<ValidatedRequest>(*std::move(validated));
  item.stop = [context] { return StopStatus(context); };
  item.precheck = CheckHiddenStatesFinite;
  Metrics* metrics = options_.metrics;
  item.done = [state, done, metrics, id = request.request_id()](
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
    done(std::move(status), result, job, *state, timing);
  };
  if (metrics != nullptr) metrics->AddInFlight(1);
  absl::Status admitted = scheduler_.Submit(std::move(item));
  if (!admitted.ok()) {
    if (metrics != nullptr) metrics->AddInFlight(-1);
    done(admitted, {}, {}, {}, {});
  }
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
  out->set_compute_us(MicrosBetween(timing.started, timing.finished));
}

grpc::ServerUnaryReactor* ScorerService::Score(grpc::CallbackServerContext* context,
                                               const v1::ScoreRequest* request,
                                               v1::ScoreResponse* response) {
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
  Submit(context, *request,
         [request, response, finish](absl::Status status, const ScoreResult& result,
                                     const ScoreJob& job, const ValidatedRequest& validated,
                                     const Scheduler::Timing& timing) {
           if (status.ok()) FillResponse(*request, job, validated, result, timing, response);
           finish(ToGrpcStatus(status));
         });
  return reactor;
}

// One ScoreStream call. Reads requests one at a time (up to kMaxInFlightPerStream computing),
// writes responses in completion order, one write at a time, and finishes once the client has
// half-closed and every request is answered. gRPC methods (StartRead, StartWrite, Finish) are
// called outside mu_; the reactor deletes itself in OnDone, which gRPC calls after Finish, and
// Finish is only called when no scheduler work of the stream remains.
class ScorerService::StreamReactor final
    : public grpc::ServerBidiReactor<v1::ScoreStreamRequest, v1::ScoreStreamResponse> {
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
    reading_ = std::make_unique<v1::ScoreStreamRequest>();
    StartRead(reading_.get());
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
    std::shared_ptr<const v1::ScoreStreamRequest> request(std::move(reading_));
    {
      absl::MutexLock lock(&mu_);
      ++in_flight_;
    }
    service_->Submit(
        context_, request->request(),
        [this, request](absl::Status status, const ScoreResult& result, const ScoreJob& job,
                        const ValidatedRequest& validated, const Scheduler::Timing& timing) {
          auto response = std::make_unique<v1::ScoreStreamResponse>();
          response->set_request_id(request->request().request_id());
          if (status.ok()) {
            FillResponse(request->request(), job, validated, result, timing,
                         response->mutable_response());
          } else {
            response->set_status_code(static_cast<int32_t>(status.code()));
            response->set_status_message(std::string(status.message()));
          }
          service_->RecordRequest("ScoreStream", ToGrpcStatus(status));
          Completed(std::move(response));
        });
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      if (in_flight_ < kMaxInFlightPerStream) {
        a.read = true;
      } else {
        read_paused_ = true;  // resumed by the next completion
      }
    }
    Run(a);
  }

  void OnWriteDone(bool ok) override {
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      writing_.reset();
      if (!ok) {  // the client is gone: nothing more can be written
        broken_ = true;
        pending_.clear();
      }
      a = NextActionsLocked();
    }
    Run(a);
  }

  void OnDone() override { delete this; }

 private:
  // What to do outside the lock.
  struct Actions {
    bool read = false;
    v1::ScoreStreamResponse* write = nullptr;
    bool finish = false;
  };

  void Completed(std::unique_ptr<v1::ScoreStreamResponse> response) {
    Actions a;
    {
      absl::MutexLock lock(&mu_);
      --in_flight_;
      if (!broken_) pending_.push_back(std::move(response));
      if (read_paused_ && !reads_done_) {
        read_paused_ = false;
        a.read = true;
      }
      Actions next = NextActionsLocked();
      a.write = next.write;
      a.finish = next.finish;
    }
    Run(a);
  }

  Actions NextActionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Actions a;
    if (writing_ == nullptr && !pending_.empty()) {
      writing_ = std::move(pending_.front());
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
    if (a.read) {
      reading_ = std::make_unique<v1::ScoreStreamRequest>();
      StartRead(reading_.get());
    }
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
  // Only touched by StartRead and OnReadDone, which gRPC never runs concurrently.
  std::unique_ptr<v1::ScoreStreamRequest> reading_;
  absl::Mutex mu_;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<v1::ScoreStreamResponse> writing_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<v1::ScoreStreamResponse>> pending_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::ScoreStreamRequest, v1::ScoreStreamResponse>*
ScorerService::ScoreStream(grpc::CallbackServerContext* context) {
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
