// Client outputs against the fp64 reference: a ScoreOutput becomes the kernels harness's
// ScoreResult / SequenceSums, checked by e2e::ExpectOutputsMatchReference against the reference
// computed from the request's own bytes (one comparison and one set of tolerances for every
// suite: tests/kernels/expect_reference.h).
#pragma once

#include <cstdint>
#include <vector>

#include "client/client.h"
#include "tests/service/e2e_support.h"

namespace logitserve::client::testing {

// Every output of `out` (and its per-sequence sums, when `request` has sequence_lengths) against
// the reference of `request`; `heads` are the request's heads as the server holds them (hidden
// mode only). Also checks the shape fields: rows, K, k.
void ExpectMatchesReference(const v1::ScoreRequest& request, const ScoreOutput& out,
                            const e2e::HeadMap& heads = {});

// The same floats as bit patterns (NaN-safe exact comparison).
std::vector<uint32_t> Bits(const std::vector<float>& v);

}  // namespace logitserve::client::testing
