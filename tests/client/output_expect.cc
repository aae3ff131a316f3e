#include "tests/client/output_expect.h"

#include <bit>

#include "gtest/gtest.h"

namespace logitserve::client::testing {

namespace {

// The per-token outputs ScoreOutput and SequenceStatsOutput both hold, under the same names.
template <typename Outputs>
ScoreResult PerTokenOutputs(const Outputs& o) {
  ScoreResult r;
  r.target_logprobs = o.target_logprobs;
  r.entropy = o.entropy;
  r.reference_entropy = o.reference_entropy;
  r.forward_kl = o.forward_kl;
  r.reverse_kl = o.reverse_kl;
  r.jsd = o.jsd;
  return r;
}

}  // namespace

void ExpectMatchesReference(const v1::ScoreRequest& request, const ScoreOutput& out,
                            const e2e::HeadMap& heads) {
  const ScoreJob job = e2e::JobOf(request, heads);
  EXPECT_EQ(out.rows, job.rows);
  EXPECT_EQ(out.target_ids_per_row, static_cast<uint32_t>(job.ids_per_row));
  EXPECT_EQ(out.top_k, static_cast<uint32_t>(job.top_k));
  ScoreResult got = PerTokenOutputs(out);
  got.top_k_ids = out.top_k_ids;
  got.top_k_logprobs = out.top_k_logprobs;
  if (!out.sequence_sums.has_value()) {
    EXPECT_EQ(request.sequence_lengths_size(), 0) << "sequence sums asked for, none returned";
    e2e::ExpectOutputsMatchReference(request, got, nullptr, heads);
    return;
  }
  EXPECT_GT(request.sequence_lengths_size(), 0) << "sequence sums returned, none asked for";
  const e2e::SequenceSums sums{PerTokenOutputs(*out.sequence_sums), out.sequence_sums->token_count};
  e2e::ExpectOutputsMatchReference(request, got, &sums, heads);
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<uint32_t>(v[i]);
  return out;
}

}  // namespace logitserve::client::testing
