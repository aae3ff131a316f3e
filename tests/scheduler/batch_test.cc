#include "server/scheduler/batch.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/cpu_factories.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve {
namespace {

using testing::Encode;
using testing::FloatType;
using testing::OwnedJob;
using testing::Share;

OwnedJob LogitsJob(std::mt19937_64& rng, int64_t rows, int64_t vocab) {
  OwnedJob j;
  j.SetModelLogits(Share(
      Encode(FloatType::kBFloat16, rows, vocab, testing::RandomNormal(rng, rows * vocab, 3.0))));
  j.WithTargets(testing::RandomTargets(rng, rows, 2, vocab, -100, 0.2), 2).WithTopK(3);
  j.WithEntropy();
  return j;
}

TEST(CanShareBatchTest, OnlyJobsThatDifferInTheirRowsShareABatch) {
  std::mt19937_64 rng(1);
  const OwnedJob a = LogitsJob(rng, 3, 100);
  const OwnedJob b = LogitsJob(rng, 5, 100);
  EXPECT_TRUE(CanShareBatch(a.job, b.job));

  const auto differs = [&](auto mutate) {
    OwnedJob c = b;
    mutate(c.job);
    return !CanShareBatch(a.job, c.job);
  };
  EXPECT_TRUE(differs([](ScoreJob& j) { j.top_k = 4; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.ignore_index = -1; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.entropy = false; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.reverse_kl = true; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.jsd_beta = 0.5f; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.model.temperature = 0.7f; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.model.logits.type = FloatType::kFloat32; }));
  EXPECT_TRUE(differs([](ScoreJob& j) { j.vocab = 99; }));
  EXPECT_TRUE(differs([](ScoreJob& j) {
    j.ids_per_row = 1;
    j.target_ids.resize(static_cast<size_t>(j.rows));
  }));
}

TEST(CanShareBatchTest, TwoVersionsOfAHeadNeverShareABatch) {
  std::mt19937_64 rng(2);
  auto backend = testing::CpuFactory("cpu", 1).create();
  ASSERT_TRUE(backend.ok());
  auto weights = testing::RandomHead(rng, 64, 16, FloatType::kBFloat16, 0.1, false, {});
  auto v1 = (*backend)->PrepareHead(weights);
  auto v2 = (*backend)->PrepareHead(weights);  // same values, another prepared object
  ASSERT_TRUE(v1.ok() && v2.ok());
  const auto hidden = Share(Encode(FloatType::kBFloat16, 2, 16, testing::RandomNormal(rng, 32, 1)));
  OwnedJob a, b, c;
  a.SetModelHidden(*v1, hidden).WithEntropy();
  b.SetModelHidden(*v1, hidden).WithEntropy();
  c.SetModelHidden(*v2, hidden).WithEntropy();
  EXPECT_TRUE(CanShareBatch(a.job, b.job));
  EXPECT_FALSE(CanShareBatch(a.job, c.job));
}

TEST(MergeJobsTest, MergedRowsAreTheConcatenationAndSlicesGiveEachPartItsRows) {
  std::mt19937_64 rng(3);
  const std::vector<OwnedJob> parts = {LogitsJob(rng, 2, 50), LogitsJob(rng, 0, 50),
                                       LogitsJob(rng, 3, 50)};
  std::vector<const ScoreJob*> ptrs;
  for (const OwnedJob& p : parts) ptrs.push_back(&p.job);
  MergedInputs storage;
  const ScoreJob merged = MergeJobs(ptrs, &storage);
  ASSERT_EQ(merged.rows, 5);
  ASSERT_EQ(merged.target_ids.size(), 10u);
  const auto* bytes = static_cast<const uint16_t*>(merged.model.logits.data);
  int64_t row = 0;
  for (const OwnedJob& p : parts) {
    const auto* src = static_cast<const uint16_t*>(p.job.model.logits.data);
    for (int64_t r = 0; r < p.job.rows; ++r, ++row) {
      for (int64_t c = 0; c < 50; ++c) EXPECT_EQ(bytes[row * 50 + c], src[r * 50 + c]);
      EXPECT_EQ(merged.target_ids[static_cast<size_t>(row * 2)], p.job.target_ids[r * 2]);
    }
  }

  // A fake merged result whose value encodes (row, column) checks the slicing.
  ScoreResult result;
  for (int64_t r = 0; r < 5; ++r) {
    for (int c = 0; c < 2; ++c) result.target_logprobs.push_back(static_cast<float>(r * 10 + c));
    for (int c = 0; c < 3; ++c) {
      result.top_k_ids.push_back(static_cast<int32_t>(r * 10 + c));
      result.top_k_logprobs.push_back(static_cast<float>(-(r * 10 + c)));
    }
    result.entropy.push_back(static_cast<float>(r));
  }
  const ScoreResult last = SliceResult(merged, result, 2, 3);
  EXPECT_EQ(last.target_logprobs, (std::vector<float>{20, 21, 30, 31, 40, 41}));
  EXPECT_EQ(last.top_k_ids, (std::vector<int32_t>{20, 21, 22, 30, 31, 32, 40, 41, 42}));
  EXPECT_EQ(last.entropy, (std::vector<float>{2, 3, 4}));
  EXPECT_TRUE(last.forward_kl.empty());
  const ScoreResult empty = SliceResult(merged, result, 2, 0);
  EXPECT_TRUE(empty.target_logprobs.empty());
  EXPECT_TRUE(empty.entropy.empty());
}

// A worker reuses one MergedInputs for every batch: a smaller batch after a larger one reuses
// the buffer (no new allocation) and still gets exactly its own rows.
TEST(MergeJobsTest, ReusedStagingGivesEachBatchItsOwnRows) {
  std::mt19937_64 rng(5);
  MergedInputs staging;
  const std::vector<OwnedJob> big = {LogitsJob(rng, 4, 50), LogitsJob(rng, 3, 50)};
  const std::vector<OwnedJob> small = {LogitsJob(rng, 1, 50), LogitsJob(rng, 2, 50)};
  const void* first_buffer = nullptr;
  for (const std::vector<OwnedJob>* parts : {&big, &small}) {
    std::vector<const ScoreJob*> ptrs;
    for (const OwnedJob& p : *parts) ptrs.push_back(&p.job);
    const ScoreJob merged = MergeJobs(ptrs, &staging);
    if (first_buffer == nullptr) {
      first_buffer = merged.model.logits.data;
    } else {
      EXPECT_EQ(merged.model.logits.data, first_buffer);  // reused, not reallocated
    }
    const auto* bytes = static_cast<const uint16_t*>(merged.model.logits.data);
    int64_t row = 0;
    for (const OwnedJob& p : *parts) {
      const auto* src = static_cast<const uint16_t*>(p.job.model.logits.data);
      for (int64_t r = 0; r < p.job.rows; ++r, ++row) {
        for (int64_t c = 0; c < 50; ++c) ASSERT_EQ(bytes[row * 50 + c], src[r * 50 + c]);
      }
    }
    EXPECT_EQ(row, merged.rows);
  }
  EXPECT_EQ(staging.model.capacity(), size_t{7 * 50 * 2});
  staging.Trim();  // small: kept
  EXPECT_EQ(staging.model.capacity(), size_t{7 * 50 * 2});
  staging.model.TrimTo(100);  // over the limit: freed
  EXPECT_EQ(staging.model.capacity(), 0u);
}

}  // namespace
}  // namespace logitserve
