#include "server/service/sequence_sums.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using ::testing::ElementsAre;

ScoreJob JobWithIds(int64_t rows, int32_t k, std::vector<int32_t> ids) {
  ScoreJob job;
  job.rows = rows;
  job.vocab = 100;
  job.ids_per_row = k;
  job.target_ids = std::move(ids);
  return job;
}

TEST(SequenceSumsTest, SumsPerSequenceAndSkipsFullyIgnoredRows) {
  // 5 rows, K = 2, sequences [2, 3]. Row 1 is entirely ignored (a prompt row): excluded from every
  // sum; row 3 is half ignored: counted, its ignored column contributes 0.
  ScoreJob job = JobWithIds(5, 2, {1, 2, -100, -100, 3, 4, 5, -100, 6, 7});
  job.entropy = true;
  job.forward_kl = true;
  ScoreResult result;
  result.target_logprobs = {-1, -2, 0, 0, -3, -4, -5, 0, -6, -7};
  result.entropy = {0.5f, 100.0f, 1.0f, 2.0f, 4.0f};
  result.forward_kl = {1, 1, 1, 1, 1};
  v1::SequenceStats sums, means;
  const std::vector<int64_t> lengths = {2, 3};
  ComputeSequenceSums(job, lengths, result, &sums, &means);
  EXPECT_THAT(sums.target_logprobs(), ElementsAre(-1.0f, -2.0f, -14.0f, -11.0f));
  EXPECT_THAT(sums.entropy(), ElementsAre(0.5f, 7.0f));
  EXPECT_THAT(sums.forward_kl(), ElementsAre(1.0f, 3.0f));
  EXPECT_THAT(sums.token_count(), ElementsAre(1, 3));
  // Means divide by the counted rows: sequence 0 counts 1 row, sequence 1 counts 3.
  EXPECT_THAT(means.target_logprobs(), ElementsAre(-1.0f, -2.0f, -14.0f / 3, -11.0f / 3));
  EXPECT_THAT(means.entropy(), ElementsAre(0.5f, 7.0f / 3));
  EXPECT_THAT(means.forward_kl(), ElementsAre(1.0f, 1.0f));
  EXPECT_THAT(means.token_count(), ElementsAre(1, 3));
  EXPECT_EQ(means.reverse_kl_size(), 0);
  EXPECT_EQ(sums.reverse_kl_size(), 0);
  EXPECT_EQ(sums.jsd_size(), 0);
  EXPECT_EQ(sums.reference_entropy_size(), 0);
}

TEST(SequenceSumsTest, WithoutTargetIdsEveryRowCounts) {
  ScoreJob job = JobWithIds(3, 0, {});
  job.entropy = true;
  ScoreResult result;
  result.entropy = {1, 2, 3};
  v1::SequenceStats sums, means;
  const std::vector<int64_t> lengths = {0, 3, 0};
  ComputeSequenceSums(job, lengths, result, &sums, &means);
  EXPECT_THAT(sums.entropy(), ElementsAre(0.0f, 6.0f, 0.0f));
  // An empty sequence has no mean.
  ASSERT_EQ(means.entropy_size(), 3);
  EXPECT_TRUE(std::isnan(means.entropy(0)));
  EXPECT_EQ(means.entropy(1), 2.0f);
  EXPECT_TRUE(std::isnan(means.entropy(2)));
  EXPECT_THAT(sums.token_count(), ElementsAre(0, 3, 0));
  EXPECT_EQ(sums.target_logprobs_size(), 0);
}

TEST(SequenceSumsTest, AccumulatesInDouble) {
  // 2^24 followed by 4095 values just above 1: an fp32 running sum rounds every step up to the
  // next even integer (ulp 2 above 2^24) and ends ~4095 too high; a double sum is exact here.
  const int64_t n = 1 << 12;
  ScoreJob job = JobWithIds(n, 0, {});
  job.entropy = true;
  ScoreResult result;
  result.entropy.assign(n, 1.0f + 0x1p-23f);
  result.entropy[0] = 1 << 24;
  v1::SequenceStats sums, means;
  const std::vector<int64_t> lengths = {n};
  ComputeSequenceSums(job, lengths, result, &sums, &means);
  const double exact = double{1 << 24} + (n - 1) * (1.0 + 0x1p-23);
  EXPECT_EQ(sums.entropy(0), static_cast<float>(exact));
}

TEST(SequenceSumsTest, NaNPropagatesToItsSequenceOnly) {
  ScoreJob job = JobWithIds(2, 0, {});
  job.entropy = true;
  ScoreResult result;
  result.entropy = {NAN, 1.0f};
  v1::SequenceStats sums, means;
  const std::vector<int64_t> lengths = {1, 1};
  ComputeSequenceSums(job, lengths, result, &sums, &means);
  EXPECT_TRUE(std::isnan(sums.entropy(0)));
  EXPECT_EQ(sums.entropy(1), 1.0f);
}

TEST(SequenceSumsTest, EmptyRequestGivesZeroSums) {
  ScoreJob job = JobWithIds(0, 1, {});
  job.jsd_beta = 0.5f;
  ScoreResult result;
  v1::SequenceStats sums, means;
  const std::vector<int64_t> lengths = {0, 0};
  ComputeSequenceSums(job, lengths, result, &sums, &means);
  EXPECT_THAT(sums.jsd(), ElementsAre(0.0f, 0.0f));
  EXPECT_THAT(sums.target_logprobs(), ElementsAre(0.0f, 0.0f));
  EXPECT_THAT(sums.token_count(), ElementsAre(0, 0));
}

}  // namespace
}  // namespace logitserve
