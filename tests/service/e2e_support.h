// Shared pieces of the end-to-end tests (tests/service and tests/client): a channel to a
// ServerProcess, the heads the service test server is started with (rebuilt here bit for bit, for
// the fp64 reference), and the comparison of a server's answer with the fp64 reference computed
// from the request's own bytes. The comparison is the kernels' harness
// (tests/kernels/expect_reference.h: one set of tolerances for every suite); this file only turns
// wire messages into its ScoreJob / ScoreResult / SequenceSums.
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "logitserve/v1/logitserve.grpc.pb.h"
#include "server/backend/backend.h"
#include "tests/support/server_process.h"

namespace logitserve::e2e {

struct SyntheticHead {
  std::string name;
  int64_t vocab;
  int64_t hidden;
  uint64_t seed;
  // "NAME:vocab=V,hidden=H,seed=S" for --synthetic-head.
  std::string Flag() const;
};

// The heads of the main test server: uneven vocabulary (not a multiple of the 2048 block), so
// two shards are uneven; "small" differs in vocabulary and hidden size.
const SyntheticHead kPolicy{"policy", 3000, 64, 11};
const SyntheticHead kReference{"ref", 3000, 64, 12};
const SyntheticHead kSmall{"small", 500, 32, 13};

// The same weights the server builds for `head` (MakeSyntheticHead is deterministic), prepared
// for the reference only (no backend).
std::shared_ptr<const PreparedHead> ReferenceHead(const SyntheticHead& head);

// Starts the real `logitserve` with `args` (ServerProcess::Start); when it cannot start, adds a
// non-fatal test failure ("cannot start logitserve: ...") and returns null.
std::unique_ptr<testing::ServerProcess> StartServerProcess(std::vector<std::string> args);

std::shared_ptr<grpc::Channel> Connect(const std::string& address);

// Calls Score with a 60 s deadline.
grpc::Status CallScore(v1::Scorer::Stub& stub, const v1::ScoreRequest& request,
                       v1::ScoreResponse* response);

// Head name -> the head's weights, as the reference reads them.
using HeadMap = std::map<std::string, std::shared_ptr<const PreparedHead>>;

// The job a valid request describes, built directly from its fields (the tests' own reading of
// the wire contract, not the service's validation code). The job's views point into the
// request's bytes: the request must outlive the job.
ScoreJob JobOf(const v1::ScoreRequest& request, const HeadMap& heads);

// Per-sequence sums laid out as the harness takes them: a ScoreResult over S sequences (no
// top-k) plus the counted rows [S].
struct SequenceSums {
  ScoreResult sums;
  std::vector<int64_t> token_count;
  std::optional<ScoreResult> means;  // checked when present (token_count as for the sums)
};

// Checks per-token outputs `got` (and, when the request has sequence_lengths, the per-sequence
// sums `sums`, which must then be non-null) against the fp64 reference of `request`.
void ExpectOutputsMatchReference(const v1::ScoreRequest& request, const ScoreResult& got,
                                 const SequenceSums* sums, const HeadMap& heads);

// The same for a ScoreResponse, plus what the response echoes: request_id, K, k, timings, and no
// sequence sums unless they were asked for.
void ExpectMatchesReference(const v1::ScoreRequest& request, const v1::ScoreResponse& response,
                            const HeadMap& heads);

}  // namespace logitserve::e2e
