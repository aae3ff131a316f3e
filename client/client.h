// logitserve C++ client: a typed, blocking API over the logitserve.v1.Scorer and
// grpc.health.v1.Health services.
//
//   auto client = logitserve::client::Client::Create("127.0.0.1:50051");
//   logitserve::v1::ScoreRequest req;
//   req.set_head("policy");
//   *req.mutable_hidden() = logitserve::client::BFloat16TensorOf(hidden, {n, h});
//   *req.mutable_target_ids() = logitserve::client::TensorOf(ids, {n});
//   req.set_entropy(true);
//   absl::StatusOr<logitserve::client::ScoreOutput> out = (*client)->Score(req);
//
// What the client adds over the raw stub:
//   - a deadline on every RPC (ClientOptions::rpc_timeout, default 60 s);
//   - bounded retries with exponential backoff on UNAVAILABLE (server starting, draining, or
//     unreachable); Score, Health and ListHeads are idempotent, so a retry is always safe;
//   - message-size limits raised to gRPC's maximum (the server's own limit is what binds);
//   - automatic splitting of a Score request by rows when it exceeds the server's
//     max_tokens_per_request or max_receive_message_bytes (as reported by ListHeads); see Score;
//   - grpc::Status converted to absl::Status (same code, same message).
//
// Thread safety: a Client may be used from any number of threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/shm_channel.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/status.h"
#include "logitserve/v1/logitserve.grpc.pb.h"

namespace logitserve::client {

struct ClientOptions {
  // Deadline of each RPC attempt (each chunk of a split request gets its own).
  absl::Duration rpc_timeout = absl::Seconds(60);

  // Retries on UNAVAILABLE: at most max_attempts attempts per RPC in total; the k-th retry waits
  // min(initial_backoff * backoff_multiplier^(k-1), max_backoff), less up to `backoff_jitter`
  // of it drawn at random (so many clients do not retry in lockstep). The channel's reconnect
  // backoff follows the same bounds, so a retry really tries to reconnect.
  int max_attempts = 5;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  double backoff_multiplier = 2.0;
  absl::Duration max_backoff = absl::Seconds(2);
  double backoff_jitter = 0.2;

  // Largest message the client sends or accepts, bytes. gRPC's default receive limit (4 MiB) is
  // far below a long request's top-k output; the server's --max-receive-message-bytes binds.
  int max_message_bytes = 2147483647;

  // Split Score requests that exceed the server's limits (see Client::Score).
  bool split_requests = true;
  // Rows per chunk when splitting; 0 = the server's max_tokens_per_request from ListHeads.
  int64_t max_rows_per_request = 0;

  // Pipelining of large requests (issue 12): when the row tensors a request carries in `data`
  // exceed pipeline_chunk_bytes, Score sends them as chunks of about that many bytes over one
  // ScoreStream call, at most pipeline_depth of them unanswered, so transfer and compute overlap;
  // the outputs are reassembled in row order, bitwise those of one request. The call's deadline
  // is rpc_timeout for all chunks together. pipeline_chunk_bytes 0 = off.
  int64_t pipeline_chunk_bytes = int64_t{4} << 20;
  int pipeline_depth = 4;  // per stream
  // The chunks are dealt round-robin over this many ScoreStream calls, each on a connection of
  // its own, so that building, sending and parsing chunks run on several threads at both ends
  // (one HTTP/2 connection moves about 1.6 GB/s on the H200 host's loopback).
  int pipeline_streams = 2;

  // A request that carries no tensor bytes (every row tensor in shared memory) and needs no
  // split goes over a long-lived ScoreStream instead of a unary Score (client/session_stream.h):
  // ~0.1 ms less fixed cost a call on the build box. One stream per concurrent caller, at most
  // session_streams of them kept open between calls; 0 = always unary. A call that times out is
  // reported as DEADLINE_EXCEEDED (the server may still run it); a stream that fails is dropped
  // and the call goes unary (with the retries below).
  int session_streams = 8;

  // Such a request (no tensor bytes, no split) goes through a shared-memory call channel
  // (client/shm_channel.h) when it fits one: the server on this host reads it from and answers
  // into a region both map, with no gRPC round trip per call. One channel per concurrent caller,
  // at most shm_channels kept open between calls; 0 = off. When the server cannot serve one (an
  // older server: UNIMPLEMENTED; not on this host: NOT_FOUND; no shared memory, permissions)
  // channels are off for this Client from then on and such calls take the session streams; a
  // channel that breaks is dropped and the call goes over gRPC.
  int shm_channels = 8;
  // Each channel's request and response areas (bytes; a request or a possible answer larger than
  // its area goes over gRPC), how long a call spins for its answer before it sleeps on the
  // futex, and the control region's file mode.
  ShmChannelOptions shm_channel;

  // Sent as "authorization: Bearer <token>" on every RPC when non-empty.
  std::string bearer_token;

  // TLS: off = plaintext. PEM strings; empty root_certs = the system roots. A client certificate
  // and key (both or neither) enable mutual TLS.
  bool use_tls = false;
  std::string tls_root_certs;
  std::string tls_client_cert;
  std::string tls_client_key;

  // gRPC load-balancing policy, e.g. "round_robin" with a "dns:///host:port" target spreading
  // requests over the replicas behind a headless Service. Empty = gRPC's default (pick_first).
  std::string load_balancing_policy;
};

// Per-sequence sums or means (ScoreRequest.sequence_lengths set); field meanings as in
// logitserve.v1.SequenceStats. Every value in nats.
struct SequenceStatsOutput {
  std::vector<float> target_logprobs;  // [S * K]
  std::vector<float> entropy;          // [S]
  std::vector<float> reference_entropy;
  std::vector<float> forward_kl;
  std::vector<float> reverse_kl;
  std::vector<float> jsd;
  std::vector<int64_t> token_count;  // [S] rows counted in each sequence
};

// A Score result, fields named and laid out as in logitserve.v1.ScoreResponse. A vector is
// empty when its output was not requested. Every value in nats; "model" = p, "reference" = q.
struct ScoreOutput {
  std::string request_id;
  int64_t rows = 0;                      // N
  uint32_t target_ids_per_row = 0;       // K (0 without target_ids)
  uint32_t top_k = 0;                    // k
  std::vector<float> target_logprobs;    // [N * K] log p(target), 0.0 where ignored
  std::vector<int32_t> top_k_ids;        // [N * k] descending probability, ties by smaller id
  std::vector<float> top_k_logprobs;     // [N * k]
  std::vector<float> entropy;            // [N] H(p)
  std::vector<float> reference_entropy;  // [N] H(q)
  std::vector<float> forward_kl;         // [N] KL(q || p)
  std::vector<float> reverse_kl;         // [N] KL(p || q)
  std::vector<float> jsd;                // [N] JSD_beta(p, q)
  std::optional<SequenceStatsOutput> sequence_sums;
  std::optional<SequenceStatsOutput> sequence_means;  // sums / token_count (NaN when 0)
  uint64_t head_version = 0;                          // 0 in logits mode
  uint64_t reference_head_version = 0;
  int64_t queue_us = 0;    // server queue time, summed over chunks
  int64_t compute_us = 0;  // server compute time, summed over chunks
  int chunks = 0;          // RPCs the request was split into (1 = not split)
};

struct ShardRange {
  int32_t shard = 0;
  int64_t vocab_begin = 0;  // ids [vocab_begin, vocab_end)
  int64_t vocab_end = 0;
};

// A served head (logitserve.v1.HeadInfo).
struct HeadInfo {
  std::string name;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  v1::DataType dtype = v1::DATA_TYPE_UNSPECIFIED;
  uint64_t version = 0;
  std::vector<ShardRange> shards;
  bool has_bias = false;
  float logit_scale = 1.0f;     // multiplier
  float logits_scaling = 1.0f;  // divisor
  float final_logit_softcapping = 0.0f;
  std::string source;
};

struct ListHeadsOutput {
  std::vector<HeadInfo> heads;
  std::string backend;  // "cpu" or "cuda"
  // The server build (ListHeadsResponse.server_info); empty from servers before 0.1.0's.
  std::string server_version;     // e.g. "0.1.0"
  std::string server_git_commit;  // e.g. "6e2d902a1b3c"
  uint32_t max_top_k = 0;
  int64_t max_tokens_per_request = 0;     // 0 = no limit reported
  int64_t max_receive_message_bytes = 0;  // 0 = no limit reported
};

enum class ServingStatus { kUnknown, kServing, kNotServing, kServiceUnknown };
const char* ServingStatusName(ServingStatus status);  // "SERVING", ...

// The one mapping from grpc::Status to absl::Status: same code (the numbering is shared), same
// message.
absl::Status FromGrpcStatus(const grpc::Status& status);

struct RowChunk;      // client/request_split.h
class SessionStream;  // client/session_stream.h

class Client {
 public:
  // Creates a client for `target` ("host:port", "dns:///host:port", "unix:/path", ...). Does not
  // connect: the first RPC does. Fails only on invalid options.
  static absl::StatusOr<std::unique_ptr<Client>> Create(std::string target,
                                                        ClientOptions options = {});
  ~Client();

  // Scores `request` (see logitserve.proto). When split_requests is on and the request has more
  // rows than the server accepts in one message (max_tokens_per_request, or rows whose bytes
  // exceed max_receive_message_bytes), the rows are sent as consecutive chunks and the outputs
  // concatenated in row order; the server's batch invariance makes that bit-identical to one
  // request. With sequence_lengths set, chunks hold whole sequences (a single sequence longer
  // than the limit is INVALID_ARGUMENT). After the first chunk the head versions it used are
  // pinned, so a head replaced mid-request fails with FAILED_PRECONDITION instead of mixing
  // versions. Large requests are pipelined (ClientOptions::pipeline_chunk_bytes): their chunks
  // run concurrently, and a head replaced mid-request gives FAILED_PRECONDITION when the chunks
  // report different versions. An error in a chunk names the chunk's rows and, in the server's
  // message, the row numbers of the whole request.
  absl::StatusOr<ScoreOutput> Score(const v1::ScoreRequest& request);

  // grpc.health.v1.Health/Check; `service` "" asks about the whole server.
  absl::StatusOr<ServingStatus> Health(const std::string& service = "");

  absl::StatusOr<ListHeadsOutput> ListHeads();

  // Shared-memory inputs (client/shm.h): registers bytes [offset, offset + byte_size) of the
  // POSIX shared-memory object `key` on the server under `name`; tensors then name it
  // (SharedMemoryTensor). Only for a server on this host (it opens `key` itself).
  absl::Status RegisterSharedMemory(const std::string& name, const std::string& key,
                                    uint64_t offset, uint64_t byte_size);
  // Returns once the server has dropped the region and no request reads it any more.
  absl::Status UnregisterSharedMemory(const std::string& name);

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }

 private:
  // The server's limits that govern splitting (0 = none).
  struct Limits {
    int64_t max_rows = 0;
    int64_t max_bytes = 0;
  };

  Client(std::string target, ClientOptions options, std::shared_ptr<grpc::Channel> channel,
         std::vector<std::shared_ptr<grpc::Channel>> pipeline_channels);

  // Runs `rpc(context)` with a fresh context (deadline, auth) per attempt, retrying on
  // UNAVAILABLE with backoff. Returns the last status.
  template <typename Rpc>
  grpc::Status CallWithRetry(Rpc&& rpc);
  void PrepareContext(grpc::ClientContext& context) const;

  absl::StatusOr<Limits> GetLimits();
  absl::StatusOr<v1::ScoreResponse> ScoreOnce(const v1::ScoreRequest& request);
  // ScoreOnce over an idle session stream (or a new one); nullopt when the stream failed and the
  // call should go unary.
  std::optional<absl::StatusOr<v1::ScoreResponse>> ScoreOnSessionStream(
      const v1::ScoreRequest& request);
  // ScoreOnce over an idle shared-memory channel (or a new one); nullopt when no channel could
  // take the call and it should go over gRPC.
  std::optional<absl::StatusOr<v1::ScoreResponse>> ScoreOnShmChannel(
      const v1::ScoreRequest& request);
  // The chunks of `plan` over one ScoreStream (client/pipeline.h), reassembled in order.
  absl::StatusOr<ScoreOutput> ScorePipelined(const v1::ScoreRequest& request,
                                             const std::vector<RowChunk>& plan);

  std::string target_;
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Scorer::Stub> scorer_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  // Generic stubs of the pipeline streams (client/pipeline.h): stream 0 on channel_, the others
  // each on a connection of its own.
  std::vector<std::unique_ptr<grpc::GenericStub>> pipeline_stubs_;

  absl::Mutex mu_;
  std::optional<Limits> limits_ ABSL_GUARDED_BY(mu_);  // fetched once, on the first Score
  // Idle session streams (on pipeline_stubs_[0], declared before: destroyed after them).
  std::vector<std::unique_ptr<SessionStream>> idle_streams_ ABSL_GUARDED_BY(mu_);
  // Idle shared-memory channels; channels_off_ once the server could not serve one.
  std::vector<std::unique_ptr<ShmChannel>> idle_channels_ ABSL_GUARDED_BY(mu_);
  bool channels_off_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace logitserve::client
