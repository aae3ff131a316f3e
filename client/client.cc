#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "client/request_split.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace logitserve::client {
namespace {

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
  return std::unique_ptr<Client>(new Client(std::move(target), std::move(options), channel));
}

Client::Client(std::string target, ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      scorer_(v1::Scorer::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {}

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

absl::StatusOr<v1::ScoreResponse> Client::ScoreOnce(const v1::ScoreRequest& request) {
  v1::ScoreResponse response;
  const grpc::Status status = CallWithRetry([&](grpc::ClientContext& context) {
    response.Clear();
    return scorer_->Score(&context, request, &response);
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
      absl::StatusOr<Limits> server = GetLimits();
      if (!server.ok()) return server.status();
      limits = *server;
    }
  }
  absl::StatusOr<std::vector<RowChunk>> plan =
      PlanChunks(request, limits.max_rows, limits.max_bytes);
  if (!plan.ok()) return plan.status();

  ScoreOutput out;
  if (plan->size() == 1) {
    absl::StatusOr<v1::ScoreResponse> response = ScoreOnce(request);
    if (!response.ok()) return response.status();
    if (absl::Status s = AppendChunkResponse(*response, plan->front(), out); !s.ok()) return s;
    return out;
  }

  // The template copies the whole request once (row bytes included) so that every per-request
  // field, present or added later to the proto, reaches each chunk unchanged.
  v1::ScoreRequest without_rows = request;
  without_rows.clear_hidden();
  without_rows.clear_logits();
  without_rows.clear_reference_hidden();
  without_rows.clear_reference_logits();
  without_rows.clear_target_ids();
  without_rows.clear_sequence_lengths();
  const int64_t total_rows = RequestRows(request);
  for (const RowChunk& chunk : *plan) {
    const v1::ScoreRequest chunk_request = MakeChunkRequest(request, without_rows, chunk);
    absl::StatusOr<v1::ScoreResponse> response = ScoreOnce(chunk_request);
    if (!response.ok()) {
      const absl::Status& s = response.status();
      return absl::Status(s.code(),
                          absl::StrCat("rows [", chunk.row_begin, ", ", chunk.row_end, ") of ",
                                       total_rows, " (request split into ", plan->size(),
                                       " chunks by the server's limits; row numbers in the message "
                                       "below count from ",
                                       chunk.row_begin, "): ", s.message()));
    }
    if (absl::Status s = AppendChunkResponse(*response, chunk, out); !s.ok()) return s;
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

}  // namespace logitserve::client
