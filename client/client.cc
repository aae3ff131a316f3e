#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "client/pipeline.h"
#include "client/request_split.h"
#include "client/session_stream.h"
#include "common/base/status_macros.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace logitserve::client {
namespace {

constexpr const char* kScoreMethod = "/logitserve.v1.Scorer/Score";

// Whether any row tensor of `request` carries its values in the message (not in shared memory).
bool CarriesTensorBytes(const v1::ScoreRequest& request) {
  for (const v1::Tensor* t : {&request.hidden(), &request.logits(), &request.reference_hidden(),
                              &request.reference_logits(), &request.target_ids()}) {
    if (!t->data().empty()) return true;
  }
  return false;
}

// The pools of calls kept open between Score calls (session streams, shared-memory channels), used
// under Client::mu_. TakeIdle: the newest idle one, or null.
template <typename T>
std::unique_ptr<T> TakeIdle(std::vector<std::unique_ptr<T>>& idle) {
  if (idle.empty()) return nullptr;
  std::unique_ptr<T> item = std::move(idle.back());
  idle.pop_back();
  return item;
}
// Keeps `item` idle while fewer than `size` are; else leaves it with the caller, who closes it
// (destroys it) outside the lock.
template <typename T>
void KeepIdle(std::vector<std::unique_ptr<T>>& idle, std::unique_ptr<T>& item, int size) {
  if (static_cast<int>(idle.size()) < size) idle.push_back(std::move(item));
}

int ToMillis(absl::Duration d) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, 1 << 30));
}

}  // namespace

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
    default:
      return "UNKNOWN";
  }
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share the canonical numbering (OK = 0 ...
  // UNAUTHENTICATED = 16); anything outside it is UNKNOWN in both.
  const int code = static_cast<int>(status.error_code());
  const absl::StatusCode absl_code =
      code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(absl_code, status.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(std::string target, ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("client target is empty");
  if (options.shm_channels < 0) {
    return absl::InvalidArgumentError("ClientOptions.shm_channels must be >= 0");
  }
  if (options.session_streams < 0) {
    return absl::InvalidArgumentError("ClientOptions.session_streams must be >= 0");
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("ClientOptions.max_attempts must be >= 1");
  }
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ClientOptions.rpc_timeout must be > 0");
  }
  if (options.backoff_multiplier < 1.0 || options.backoff_jitter < 0.0 ||
      options.backoff_jitter > 1.0 || options.initial_backoff < absl::ZeroDuration() ||
      options.max_backoff < options.initial_backoff) {
    return absl::InvalidArgumentError(
        "ClientOptions backoff: need multiplier >= 1, 0 <= jitter <= 1, "
        "0 <= initial_backoff <= max_backoff");
  }
  if (options.max_rows_per_request < 0) {
    return absl::InvalidArgumentError("ClientOptions.max_rows_per_request must be >= 0");
  }
  if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
    return absl::InvalidArgumentError("TLS client certificate and key must be given together");
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect on the same schedule as the retries; gRPC's default first reconnect backoff (1 s)
  // would make early retries fail fast without ever trying to connect. (Not
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: despite its name it is the minimum *connect timeout*, and
  // lowering it aborts handshakes with a busy server.)
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ToMillis(options.initial_backoff));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ToMillis(options.max_backoff));
  if (!options.load_balancing_policy.empty()) {
    args.SetLoadBalancingPolicyName(options.load_balancing_policy);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.use_tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs;
    ssl.pem_private_key = options.tls_client_key;
    ssl.pem_cert_chain = options.tls_client_cert;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  auto channel = grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) {
    return absl::InternalError(absl::StrCat("could not create a channel to ", target));
  }
  // Pipeline streams 1.. get connections of their own: a local subchannel pool (and a distinct
  // argument) keeps gRPC from sharing the first channel's connection.
  std::vector<std::shared_ptr<grpc::Channel>> pipeline_channels;
  for (int i = 1; i < options.pipeline_streams; ++i) {
    grpc::ChannelArguments own = args;
    own.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    own.SetInt("logitserve.pipeline_stream", i);
    pipeline_channels.push_back(grpc::CreateCustomChannel(target, credentials, own));
  }
  return std::unique_ptr<Client>(
      new Client(std::move(target), std::move(options), channel, std::move(pipeline_channels)));
}

Client::Client(std::string target, ClientOptions options, std::shared_ptr<grpc::Channel> channel,
               std::vector<std::shared_ptr<grpc::Channel>> pipeline_channels)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      scorer_(v1::Scorer::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {
  pipeline_stubs_.push_back(std::make_unique<grpc::GenericStub>(channel_));
  for (const std::shared_ptr<grpc::Channel>& c : pipeline_channels) {
    pipeline_stubs_.push_back(std::make_unique<grpc::GenericStub>(c));
  }
}

void Client::PrepareContext(grpc::ClientContext& context) const {
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.rpc_timeout));
  if (!options_.bearer_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.bearer_token));
  }
}

template <typename Rpc>
grpc::Status Client::CallWithRetry(Rpc&& rpc) {
  std::optional<absl::BitGen> rng;  // seeded on the first retry only
  absl::Duration backoff = options_.initial_backoff;
  grpc::Status status;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext context;
    PrepareContext(context);
    status = rpc(context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || attempt >= options_.max_attempts) {
      break;
    }
    if (!rng.has_value()) rng.emplace();
    const double jitter = options_.backoff_jitter * absl::Uniform(*rng, 0.0, 1.0);
    const absl::Time retry_at = absl::Now() + backoff * (1.0 - jitter);
    // Wait on the channel rather than only sleeping: this thread then drives the reconnection
    // attempt. (A blocking client's channel makes progress only while some thread polls it;
    // otherwise only gRPC's 5 s backup poller does, and a server that came up would be seen
    // seconds late.) The rest of the backoff is slept even when the channel connects early, so a
    // connected-but-draining server is not retried in a tight loop.
    channel_->WaitForConnected(absl::ToChronoTime(retry_at));
    absl::SleepFor(retry_at - absl::Now());
    backoff = std::min(backoff * options_.backoff_multiplier, options_.max_backoff);
  }
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE && options_.max_attempts > 1) {
    return grpc::Status(status.error_code(),
                        absl::StrCat(status.error_message(), " (target ", target_, ", ",
                                     options_.max_attempts, " attempts)"));
  }
  return status;
}

absl::StatusOr<ServingStatus> Client::Health(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = CallWithRetry(
      [&](grpc::ClientContext& context) { return health_->Check(&context, request, &response); });
  if (!status.ok()) return FromGrpcStatus(status);
  switch (response.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return ServingStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return ServingStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

absl::StatusOr<ListHeadsOutput> Client::ListHeads() {
  v1::ListHeadsResponse response;
  const grpc::Status status = CallWithRetry([&](grpc::ClientContext& context) {
    return scorer_->ListHeads(&context, v1::ListHeadsRequest(), &response);
  });
  if (!status.ok()) return FromGrpcStatus(status);
  ListHeadsOutput out;
  out.backend = response.backend();
  out.server_version = response.server_info().version();
  out.server_git_commit = response.server_info().git_commit();
  out.max_top_k = response.max_top_k();
  out.max_tokens_per_request = response.max_tokens_per_request();
  out.max_receive_message_bytes = response.max_receive_message_bytes();
  for (const v1::HeadInfo& h : response.heads()) {
    HeadInfo info;
    info.name = h.name();
    info.vocab_size = h.vocab_size();
    info.hidden_size = h.hidden_size();
    info.dtype = h.dtype();
    info.version = h.version();
    for (const v1::ShardRange& s : h.shards()) {
      info.shards.push_back({s.shard(), s.vocab_begin(), s.vocab_end()});
    }
    info.has_bias = h.has_bias();
    // proto3 cannot tell "unset" from 0; an unset multiplier or divisor means 1.
    info.logit_scale = h.logit_scale() == 0.0f ? 1.0f : h.logit_scale();
    info.logits_scaling = h.logits_scaling() == 0.0f ? 1.0f : h.logits_scaling();
    info.final_logit_softcapping = h.final_logit_softcapping();
    info.source = h.source();
    out.heads.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<Client::Limits> Client::GetLimits() {
  {
    absl::MutexLock lock(&mu_);
    if (limits_.has_value()) return *limits_;
  }
  Limits limits;
  absl::StatusOr<ListHeadsOutput> heads = ListHeads();
  if (heads.ok()) {
    limits.max_rows = heads->max_tokens_per_request;
    limits.max_bytes = heads->max_receive_message_bytes;
  } else if (heads.status().code() != absl::StatusCode::kUnimplemented) {
    // A server without ListHeads simply reports no limits; any other failure is the caller's.
    return heads.status();
  }
  absl::MutexLock lock(&mu_);
  limits_ = limits;
  return limits;
}

absl::Status Client::RegisterSharedMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  return FromGrpcStatus(CallWithRetry([&](grpc::ClientContext& context) {
    return scorer_->RegisterSharedMemory(&context, request, &response);
  }));
}

absl::Status Client::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSharedMemoryResponse response;
  return FromGrpcStatus(CallWithRetry([&](grpc::ClientContext& context) {
    return scorer_->UnregisterSharedMemory(&context, request, &response);
  }));
}

Client::~Client() {
  absl::MutexLock lock(&mu_);
  idle_streams_.clear();  // cancels and drains them while the channel is still up
  idle_channels_.clear();
}

std::optional<absl::StatusOr<v1::ScoreResponse>> Client::ScoreOnShmChannel(
    const v1::ScoreRequest& request) {
  if (!ShmChannel::Fits(options_.shm_channel, request)) return std::nullopt;
  std::unique_ptr<ShmChannel> channel;
  {
    absl::MutexLock lock(&mu_);
    if (channels_off_) return std::nullopt;
    channel = TakeIdle(idle_channels_);
  }
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  if (channel == nullptr) {
    absl::StatusOr<std::unique_ptr<ShmChannel>> opened =
        ShmChannel::Open(*scorer_, options_.bearer_token, options_.shm_channel, deadline);
    if (!opened.ok()) {
      switch (opened.status().code()) {
        case absl::StatusCode::kUnavailable:        // retried over gRPC
        case absl::StatusCode::kResourceExhausted:  // the server's channel limit, for now
        case absl::StatusCode::kDeadlineExceeded:
        case absl::StatusCode::kUnauthenticated:  // the gRPC call will say so
          return std::nullopt;
        default: {
          absl::MutexLock lock(&mu_);
          channels_off_ = true;
          return std::nullopt;
        }
      }
    }
    channel = *std::move(opened);
  }
  bool broken = false;
  absl::StatusOr<v1::ScoreResponse> answer = channel->Call(request, deadline, &broken);
  if (broken) {
    channel.reset();  // cancels its call
    if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) return answer;
    return std::nullopt;
  }
  // A server that is draining answers UNAVAILABLE: the gRPC path retries with backoff.
  if (answer.status().code() == absl::StatusCode::kUnavailable) return std::nullopt;
  absl::MutexLock lock(&mu_);
  KeepIdle(idle_channels_, channel, options_.shm_channels);
  return answer;
}

std::optional<absl::StatusOr<v1::ScoreResponse>> Client::ScoreOnSessionStream(
    const v1::ScoreRequest& request) {
  std::unique_ptr<SessionStream> stream;
  {
    absl::MutexLock lock(&mu_);
    stream = TakeIdle(idle_streams_);
  }
  if (stream == nullptr) {
    stream = std::make_unique<SessionStream>(*pipeline_stubs_.front(), options_.bearer_token);
  }
  bool broken = false;
  absl::StatusOr<v1::ScoreResponse> answer =
      stream->Call(request, absl::Now() + options_.rpc_timeout, &broken);
  if (broken) {
    stream.reset();  // cancelled and drained
    if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) return answer;
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  KeepIdle(idle_streams_, stream, options_.session_streams);
  return answer;
}

absl::StatusOr<v1::ScoreResponse> Client::ScoreOnce(const v1::ScoreRequest& request) {
  // The request's tensor bytes go out as slices of `request` itself (client/pipeline.h): the
  // generated stub would first serialize a copy of every hidden byte into fresh buffers, on the
  // call's critical path (measured: as much client CPU as the socket write itself).
  // A request without tensor bytes (shared-memory inputs) is a few hundred bytes: it is
  // serialized as is, skipping RequestWithoutRows' reflection walk and the slice assembly.
  SliceLease lease;  // before body: gRPC may hold its slices past the call (pipeline.h)
  grpc::ByteBuffer body;
  if (CarriesTensorBytes(request)) {
    body = RequestBytes(request, RequestWithoutRows(request), lease);
  } else {
    if (options_.shm_channels > 0) {
      std::optional<absl::StatusOr<v1::ScoreResponse>> answer = ScoreOnShmChannel(request);
      if (answer.has_value()) return *std::move(answer);
    }
    if (options_.session_streams > 0) {
      std::optional<absl::StatusOr<v1::ScoreResponse>> answer = ScoreOnSessionStream(request);
      if (answer.has_value()) return *std::move(answer);
    }
    bool own = false;
    const grpc::Status serialized =
        grpc::SerializationTraits<v1::ScoreRequest>::Serialize(request, &body, &own);
    if (!serialized.ok()) return FromGrpcStatus(serialized);
  }
  v1::ScoreResponse response;
  const grpc::Status status = CallWithRetry([&](grpc::ClientContext& context) {
    // A completion queue of this call, polled by this thread (as the blocking stub does), so
    // the answer needs no hand-off from a gRPC thread.
    grpc::CompletionQueue cq;
    grpc::ByteBuffer reply;
    grpc::Status call_status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>> call =
        pipeline_stubs_.front()->PrepareUnaryCall(&context, kScoreMethod, body, &cq);
    call->StartCall();
    call->Finish(&reply, &call_status, &cq);
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);  // the only tag: Finish
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    if (!call_status.ok()) return call_status;
    response.Clear();
    return grpc::SerializationTraits<v1::ScoreResponse>::Deserialize(&reply, &response);
  });
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<ScoreOutput> Client::Score(const v1::ScoreRequest& request) {
  Limits limits;
  if (options_.split_requests) {
    if (options_.max_rows_per_request > 0) {
      limits.max_rows = options_.max_rows_per_request;
    } else {
      LOGITSERVE_ASSIGN_OR_RETURN(limits, GetLimits());
    }
  }
  LOGITSERVE_ASSIGN_OR_RETURN(std::vector<RowChunk> plan,
                              PlanChunks(request, limits.max_rows, limits.max_bytes));
  const int64_t row_bytes = RowBytes(request);
  if (options_.split_requests && options_.pipeline_chunk_bytes > 0 && row_bytes > 0) {
    const int64_t chunk_rows = std::max<int64_t>(1, options_.pipeline_chunk_bytes / row_bytes);
    if (RequestRows(request) > chunk_rows) {
      const int64_t max_rows =
          limits.max_rows > 0 ? std::min(limits.max_rows, chunk_rows) : chunk_rows;
      // Only a plan the server limits would not need can fail here (a sequence longer than a
      // pipeline chunk): then the request goes as the limits split it.
      absl::StatusOr<std::vector<RowChunk>> pipelined =
          PlanChunks(request, max_rows, limits.max_bytes);
      if (pipelined.ok() && pipelined->size() > 1) return ScorePipelined(request, *pipelined);
    }
  }

  ScoreOutput out;
  if (plan.size() == 1) {
    LOGITSERVE_ASSIGN_OR_RETURN(v1::ScoreResponse response, ScoreOnce(request));
    LOGITSERVE_RETURN_IF_ERROR(AppendChunkResponse(response, plan.front(), out));
    return out;
  }

  // Every per-request field, present or added later to the proto, reaches each chunk unchanged.
  v1::ScoreRequest without_rows = RequestWithoutRows(request);
  const int64_t total_rows = RequestRows(request);
  for (const RowChunk& chunk : plan) {
    const v1::ScoreRequest chunk_request = MakeChunkRequest(request, without_rows, chunk);
    absl::StatusOr<v1::ScoreResponse> response = ScoreOnce(chunk_request);
    if (!response.ok()) {
      const absl::Status& s = response.status();
      return absl::Status(s.code(), absl::StrCat("rows [", chunk.row_begin, ", ", chunk.row_end,
                                                 ") of ", total_rows, " (request split into ",
                                                 plan.size(), " chunks by the server's limits): ",
                                                 RebaseRowNumbers(s.message(), chunk.row_begin)));
    }
    LOGITSERVE_RETURN_IF_ERROR(AppendChunkResponse(*response, chunk, out));
    // Pin the versions the first chunk used: a head swapped mid-request then fails the later
    // chunks with FAILED_PRECONDITION rather than mixing two heads' outputs.
    if (!without_rows.has_head_version() && response->head_version() != 0) {
      without_rows.set_head_version(response->head_version());
    }
    if (!without_rows.has_reference_head_version() && response->reference_head_version() != 0) {
      without_rows.set_reference_head_version(response->reference_head_version());
    }
  }
  return out;
}

absl::StatusOr<ScoreOutput> Client::ScorePipelined(const v1::ScoreRequest& request,
                                                   const std::vector<RowChunk>& plan) {
  const v1::ScoreRequest without_rows = RequestWithoutRows(request);
  SliceLease lease;  // the chunks' slices over `request` (pipeline.h); waited for on return
  // Chunk i goes on stream i % streams; each stream runs on its own thread and connection.
  const size_t streams = std::min(plan.size(), pipeline_stubs_.size());
  std::vector<PipelineOutcome> outcomes(streams);
  // Retried as a whole on UNAVAILABLE (Score is idempotent); a failed chunk is not retried.
  std::chrono::system_clock::time_point deadline;
  grpc::Status status = CallWithRetry([&](grpc::ClientContext& first_context) {
    deadline = first_context.deadline();
    std::vector<std::unique_ptr<grpc::ClientContext>> own(streams);
    std::vector<grpc::ClientContext*> contexts(streams, &first_context);
    for (size_t s = 1; s < streams; ++s) {
      own[s] = std::make_unique<grpc::ClientContext>();
      PrepareContext(*own[s]);
      contexts[s] = own[s].get();
    }
    auto run = [&](size_t s) {
      const size_t count = (plan.size() - s + streams - 1) / streams;
      outcomes[s] = RunPipeline(
          *pipeline_stubs_[s], *contexts[s], count,
          [&](size_t j) {
            return ChunkBytes(request, without_rows, plan[s + j * streams], absl::StrCat(j), lease);
          },
          options_.pipeline_depth);
      if (outcomes[s].failed_chunk >= 0 || !outcomes[s].stream_status.ok()) {
        for (grpc::ClientContext* c : contexts) c->TryCancel();  // the other streams stop too
      }
    };
    std::vector<std::thread> threads;
    for (size_t s = 1; s < streams; ++s) threads.emplace_back(run, s);
    run(0);
    for (std::thread& t : threads) t.join();
    grpc::Status first_error = grpc::Status::OK;
    for (const PipelineOutcome& o : outcomes) {
      if (o.failed_chunk >= 0) return grpc::Status::OK;  // reported below, not retried
      // A stream cancelled because another failed says CANCELLED; the other's status is the one.
      if (!o.stream_status.ok() &&
          (first_error.ok() || first_error.error_code() == grpc::StatusCode::CANCELLED)) {
        first_error = o.stream_status;
      }
    }
    return first_error;
  });
  // The server ends a stream whose deadline passed as CANCELLED, and may say so before the
  // client's own timer fires; this client cancels only after a failed chunk (handled below).
  if (status.error_code() == grpc::StatusCode::CANCELLED &&
      std::chrono::system_clock::now() >= deadline) {
    status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("deadline of ", absl::FormatDuration(options_.rpc_timeout),
                                       " exceeded (", plan.size(), "-chunk pipelined request)"));
  }
  PipelineOutcome outcome;
  for (size_t s = 0; s < streams; ++s) {
    if (outcomes[s].failed_chunk >= 0 &&
        (outcome.failed_chunk < 0 ||
         static_cast<int64_t>(s) + outcomes[s].failed_chunk * static_cast<int64_t>(streams) <
             outcome.failed_chunk)) {
      outcome.failed_chunk =
          static_cast<int64_t>(s) + outcomes[s].failed_chunk * static_cast<int64_t>(streams);
      outcome.chunk_error = outcomes[s].chunk_error;
    }
  }
  if (outcome.failed_chunk < 0 && status.ok()) {
    outcome.responses.resize(plan.size());
    for (size_t s = 0; s < streams; ++s) {
      for (size_t j = 0; j < outcomes[s].responses.size(); ++j) {
        outcome.responses[s + j * streams] = std::move(outcomes[s].responses[j]);
      }
    }
  }
  const int64_t total_rows = RequestRows(request);
  if (outcome.failed_chunk >= 0) {
    const RowChunk& chunk = plan[static_cast<size_t>(outcome.failed_chunk)];
    const absl::Status& s = outcome.chunk_error;
    return absl::Status(
        s.code(),
        absl::StrCat("rows [", chunk.row_begin, ", ", chunk.row_end, ") of ", total_rows,
                     " (chunk ", outcome.failed_chunk + 1, " of ", plan.size(),
                     " of a pipelined request): ", RebaseRowNumbers(s.message(), chunk.row_begin)));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  ScoreOutput out;
  for (size_t i = 0; i < plan.size(); ++i) {
    const v1::ScoreResponse& response = outcome.responses[i];
    if (i > 0 && (response.head_version() != out.head_version ||
                  response.reference_head_version() != out.reference_head_version)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "head_version: a head was replaced while the request was in flight (rows [",
          plan[i].row_begin, ", ", plan[i].row_end, ") ran on version ", response.head_version(),
          "/", response.reference_head_version(), ", earlier rows on ", out.head_version, "/",
          out.reference_head_version, "); pin head_version or retry"));
    }
    LOGITSERVE_RETURN_IF_ERROR(AppendChunkResponse(response, plan[i], out));
  }
  out.request_id = request.request_id();
  return out;
}

}  // namespace logitserve::client
