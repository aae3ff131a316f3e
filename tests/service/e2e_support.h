// Shared pieces of the end-to-end service tests: a channel to a ServerProcess, the heads the
// test server is started with (rebuilt here bit for bit, for the fp64 reference), and the
// comparison of a ScoreResponse with the fp64 reference computed from the same request bytes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "logitserve/v1/logitserve.grpc.pb.h"
#include "server/backend/backend.h"

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

std::shared_ptr<grpc::Channel> Connect(const std::string& address);

// Calls Score with a 60 s deadline.
grpc::Status CallScore(v1::Scorer::Stub& stub, const v1::ScoreRequest& request,
                       v1::ScoreResponse* response);

// Checks every output of `response` against the fp64 reference of `request` (computed from the
// request's own bytes; nothing is taken from the server's answer). `heads` maps head names of
// the request to ReferenceHead()s.
void ExpectMatchesReference(
    const v1::ScoreRequest& request, const v1::ScoreResponse& response,
    const std::map<std::string, std::shared_ptr<const PreparedHead>>& heads);

}  // namespace logitserve::e2e
