#include "server/service/service.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/wire/dtype.h"
#include "server/service/sequence_sums.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace logitserve {

namespace {

using Clock = std::chrono::steady_clock;

int64_t MicrosSince(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration_cast<std::chrono::microseconds>(end - start).count();
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

}  // namespace

struct ScorerService::Call {
  grpc::CallbackServerContext* context;
  const v1::ScoreRequest* request;
  v1::ScoreResponse* response;
  grpc::ServerUnaryReactor* reactor;
  ValidatedRequest validated;
  Clock::time_point enqueued;
};

ScorerService::ScorerService(Backend* backend, const HeadStore* heads,
                             const ServiceOptions& options)
    : backend_(backend),
      heads_(heads),
      options_(options),
      pool_(options.workers, options.queue_size) {}

ScorerService::~ScorerService() { StopWorkers(); }

void ScorerService::StartDraining() { draining_.store(true); }

void ScorerService::StopWorkers() { pool_.Stop(); }

grpc::ServerUnaryReactor* ScorerService::Score(grpc::CallbackServerContext* context,
                                               const v1::ScoreRequest* request,
                                               v1::ScoreResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (draining_.load()) {
    reactor->Finish(ToGrpcStatus(absl::UnavailableError("server is shutting down")));
    return reactor;
  }
  absl::StatusOr<ValidatedRequest> validated = ValidateScoreRequest(
      *request, [this](const std::string& name) { return heads_->Find(name); }, options_.limits);
  if (!validated.ok()) {
    spdlog::debug("Score request '{}' rejected: {}", request->request_id(),
                  validated.status().ToString());
    reactor->Finish(ToGrpcStatus(validated.status()));
    return reactor;
  }
  // std::function needs a copyable callable; the call state is shared with the queued task.
  auto call = std::make_shared<Call>(
      Call{context, request, response, reactor, *std::move(validated), Clock::now()});
  if (!pool_.TrySubmit([this, call] { Compute(*call); })) {
    reactor->Finish(ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
        "server queue is full (", options_.queue_size, " requests waiting); retry later"))));
  }
  return reactor;
}

void ScorerService::Compute(Call& call) {
  const Clock::time_point start = Clock::now();
  if (call.context->IsCancelled()) {
    call.reactor->Finish(ToGrpcStatus(absl::CancelledError("cancelled before compute")));
    return;
  }
  if (call.context->deadline() < std::chrono::system_clock::now()) {
    call.reactor->Finish(
        ToGrpcStatus(absl::DeadlineExceededError("deadline expired while the request was queued")));
    return;
  }
  const ScoreJob& job = call.validated.job;
  ScoreResult result;
  // The scan of the hidden states reads every input byte, so it runs here, not in the handler.
  absl::Status status = CheckHiddenStatesFinite(job);
  if (status.ok()) status = backend_->Score(job, &result);
  if (status.ok()) status = CheckResultShape(job, result);
  const Clock::time_point end = Clock::now();
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kInvalidArgument) {
      spdlog::debug("Score request '{}' rejected by the backend: {}", call.request->request_id(),
                    status.ToString());
    } else {
      spdlog::error("Score request '{}' failed: {}", call.request->request_id(), status.ToString());
    }
    call.reactor->Finish(ToGrpcStatus(status));
    return;
  }

  v1::ScoreResponse& out = *call.response;
  out.set_request_id(call.request->request_id());
  Assign(result.target_logprobs, out.mutable_target_logprobs());
  Assign(result.top_k_ids, out.mutable_top_k_ids());
  Assign(result.top_k_logprobs, out.mutable_top_k_logprobs());
  Assign(result.entropy, out.mutable_entropy());
  Assign(result.reference_entropy, out.mutable_reference_entropy());
  Assign(result.forward_kl, out.mutable_forward_kl());
  Assign(result.reverse_kl, out.mutable_reverse_kl());
  Assign(result.jsd, out.mutable_jsd());
  out.set_target_ids_per_row(static_cast<uint32_t>(job.ids_per_row));
  out.set_top_k(static_cast<uint32_t>(job.top_k));
  if (!call.validated.sequence_lengths.empty()) {
    ComputeSequenceSums(job, call.validated.sequence_lengths, result, out.mutable_sequence_sums());
  }
  out.set_head_version(call.validated.head_version);
  out.set_reference_head_version(call.validated.reference_head_version);
  out.set_queue_us(MicrosSince(call.enqueued, start));
  out.set_compute_us(MicrosSince(start, end));
  spdlog::trace("Score request '{}': {} rows, queue {} us, compute {} us",
                call.request->request_id(), job.rows, out.queue_us(), out.compute_us());
  call.reactor->Finish(grpc::Status::OK);
}

grpc::ServerUnaryReactor* ScorerService::ListHeads(grpc::CallbackServerContext* context,
                                                   const v1::ListHeadsRequest* /*request*/,
                                                   v1::ListHeadsResponse* response) {
  for (const std::shared_ptr<const PreparedHead>& head : heads_->List()) {
    const HeadWeights& w = head->weights();
    v1::HeadInfo* info = response->add_heads();
    info->set_name(w.name);
    info->set_vocab_size(w.vocab_size);
    info->set_hidden_size(w.hidden_size);
    info->set_dtype(wire::DTypeOf(w.dtype));
    info->set_version(w.version);
    for (const ShardRange& shard : backend_->ShardLayout(w.vocab_size)) {
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
  response->set_backend(backend_->name());
  response->set_max_top_k(static_cast<uint32_t>(options_.limits.max_top_k));
  response->set_max_tokens_per_request(options_.limits.max_tokens_per_request);
  response->set_max_receive_message_bytes(options_.max_receive_message_bytes);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace logitserve
