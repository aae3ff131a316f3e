// Unit tests of ValidateScoreRequest: every rule, its status code, and that the message names the
// field (and row / column where relevant). The end-to-end suite repeats the important ones over
// the wire.
#include "server/service/validate.h"

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/heads/head_loader.h"
#include "tests/support/test_tensors.h"

namespace logitserve {
namespace {

using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::IdTensor;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 50;
constexpr int64_t kHidden = 8;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::shared_ptr<const PreparedHead> Prepared(const std::string& name, int64_t vocab, int64_t hidden,
                                             uint64_t seed) {
  absl::StatusOr<std::shared_ptr<HeadWeights>> w = MakeSyntheticHead(name, vocab, hidden, seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return std::make_shared<PreparedHead>(*std::move(w));
}

std::vector<float> Ramp(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(i % 17) - 2.0f;
  return v;
}

std::vector<int64_t> Ids(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = (i * 7) % kVocab;
  return v;
}

class ValidateTest : public ::testing::Test {
 protected:
  ValidateTest() {
    heads_["policy"] = Prepared("policy", kVocab, kHidden, 1);
    heads_["ref"] = Prepared("ref", kVocab, kHidden, 2);
    heads_["wide"] = Prepared("wide", kVocab, 2 * kHidden, 3);
    heads_["small"] = Prepared("small", kVocab - 10, kHidden, 4);
  }

  absl::StatusOr<ValidatedRequest> Validate(const v1::ScoreRequest& request) {
    return ValidateScoreRequest(
        request,
        [this](const std::string& name) -> std::shared_ptr<const PreparedHead> {
          auto it = heads_.find(name);
          return it == heads_.end() ? nullptr : it->second;
        },
        limits_);
  }

  // A valid hidden-mode request of n rows: head "policy", bf16 hidden, INT32 ids [n].
  static v1::ScoreRequest HiddenRequest(int64_t n) {
    v1::ScoreRequest r;
    r.set_head("policy");
    *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_BFLOAT16, Ramp(n * kHidden), {n, kHidden});
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, Ids(n), {n});
    return r;
  }

  // A valid logits-mode request of n rows over kVocab.
  static v1::ScoreRequest LogitsRequest(int64_t n) {
    v1::ScoreRequest r;
    *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(n * kVocab), {n, kVocab});
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, Ids(n), {n});
    return r;
  }

  std::map<std::string, std::shared_ptr<const PreparedHead>> heads_;
  RequestLimits limits_;
};

#define EXPECT_STATUS(result, status_code, ...)                          \
  do {                                                                   \
    const auto& r_ = (result);                                           \
    ASSERT_FALSE(r_.ok()) << "expected an error";                        \
    EXPECT_EQ(r_.status().code(), (status_code)) << r_.status();         \
    EXPECT_THAT(std::string(r_.status().message()), AllOf(__VA_ARGS__)); \
  } while (0)

TEST_F(ValidateTest, HiddenRequestBecomesZeroCopyJob) {
  v1::ScoreRequest r = HiddenRequest(3);
  r.set_entropy(true);
  r.set_top_k(5);
  r.set_head_version(1);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  const ScoreJob& job = v->job;
  EXPECT_EQ(job.rows, 3);
  EXPECT_EQ(job.vocab, kVocab);
  EXPECT_TRUE(job.model.hidden_mode());
  EXPECT_EQ(job.model.head, heads_["policy"]);
  EXPECT_EQ(job.model.hidden.data, r.hidden().data().data());  // a view, not a copy
  EXPECT_EQ(job.model.hidden.type, kernels::FloatType::kBFloat16);
  EXPECT_EQ(job.model.hidden.rows, 3);
  EXPECT_EQ(job.model.hidden.cols, kHidden);
  EXPECT_EQ(job.model.field, "hidden");
  EXPECT_EQ(job.model.temperature, 1.0f);
  EXPECT_FALSE(job.reference.present());
  EXPECT_EQ(job.ids_per_row, 1);
  EXPECT_EQ(job.target_ids, (std::vector<int32_t>{0, 7, 14}));
  EXPECT_EQ(job.ignore_index, -100);
  EXPECT_EQ(job.top_k, 5);
  EXPECT_TRUE(job.entropy);
  EXPECT_EQ(v->head_version, 1u);
  EXPECT_TRUE(v->sequence_lengths.empty());
}

TEST_F(ValidateTest, LogitsRequestWithReference) {
  v1::ScoreRequest r = LogitsRequest(4);
  *r.mutable_reference_logits() = FloatTensor(v1::DATA_TYPE_FLOAT16, Ramp(4 * kVocab), {4, kVocab});
  r.set_forward_kl(true);
  r.set_jsd_beta(0.5f);
  r.set_temperature(0.7f);
  r.set_reference_temperature(2.0f);
  r.add_sequence_lengths(1);
  r.add_sequence_lengths(3);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  const ScoreJob& job = v->job;
  EXPECT_FALSE(job.model.hidden_mode());
  EXPECT_EQ(job.model.logits.data, r.logits().data().data());
  EXPECT_EQ(job.model.temperature, 0.7f);
  EXPECT_EQ(job.reference.logits.type, kernels::FloatType::kFloat16);
  EXPECT_EQ(job.reference.field, "reference_logits");
  EXPECT_EQ(job.reference.temperature, 2.0f);
  EXPECT_EQ(job.jsd_beta, 0.5f);
  EXPECT_EQ(v->head_version, 0u);
  EXPECT_EQ(v->sequence_lengths, (std::vector<int64_t>{1, 3}));
}

TEST_F(ValidateTest, HiddenReferenceAndVersions) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_reference_head("ref");
  *r.mutable_reference_hidden() =
      FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(2 * kHidden), {2, kHidden});
  r.set_reverse_kl(true);
  r.set_reference_head_version(1);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->job.reference.head, heads_["ref"]);
  EXPECT_EQ(v->reference_head_version, 1u);
}

TEST_F(ValidateTest, EmptyRequestIsValid) {
  v1::ScoreRequest r = HiddenRequest(0);
  r.set_entropy(true);
  r.add_sequence_lengths(0);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->job.rows, 0);
  EXPECT_TRUE(v->job.target_ids.empty());
}

TEST_F(ValidateTest, TwoDimensionalIdsAndCustomIgnoreIndex) {
  v1::ScoreRequest r = LogitsRequest(2);
  const std::vector<int64_t> ids = {0, -1, 49, -1, -1, 3};
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {2, 3});
  r.set_ignore_index(-1);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->job.ids_per_row, 3);
  EXPECT_EQ(v->job.ignore_index, -1);
  EXPECT_EQ(v->job.target_ids, (std::vector<int32_t>{0, -1, 49, -1, -1, 3}));
  // -1 is not ignorable under the default ignore_index.
  r.clear_ignore_index();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("row 0"), HasSubstr("column 1"));
}

TEST_F(ValidateTest, IgnoreIndexInsideTheVocabulary) {
  // ignore_index may be a real id: those ids are ignored (kept as is in the job), the others are
  // ordinary ids, and range checks still apply to them.
  v1::ScoreRequest r = LogitsRequest(2);
  *r.mutable_target_ids() =
      IdTensor(v1::DATA_TYPE_INT64, std::vector<int64_t>{7, 3, 7, 49}, {2, 2});
  r.set_ignore_index(7);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->job.ignore_index, 7);
  EXPECT_EQ(v->job.target_ids, (std::vector<int32_t>{7, 3, 7, 49}));
  // -100 is no longer ignorable.
  *r.mutable_target_ids() =
      IdTensor(v1::DATA_TYPE_INT64, std::vector<int64_t>{7, -100, 7, 49}, {2, 2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("row 0"), HasSubstr("column 1"), HasSubstr("-100"));
}

TEST_F(ValidateTest, TargetIdsPerRowLimit) {
  limits_.max_target_ids_per_row = 4;
  v1::ScoreRequest r = LogitsRequest(2);
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, Ids(8), {2, 4});
  EXPECT_TRUE(Validate(r).ok());
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, Ids(10), {2, 5});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("5 ids per row"), HasSubstr("4"), HasSubstr("--max-target-ids-per-row"));

  // N = 0 makes any [0, K] tensor zero bytes long: K is still bounded (the default limit).
  limits_ = RequestLimits();
  r = HiddenRequest(0);
  r.mutable_target_ids()->set_shape(0, 0);
  r.mutable_target_ids()->add_shape(std::numeric_limits<int32_t>::max());
  r.add_sequence_lengths(0);
  r.set_entropy(true);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("2147483647 ids per row"), HasSubstr("1024"));
  r.mutable_target_ids()->set_shape(1, 1024);
  EXPECT_TRUE(Validate(r).ok());
}

TEST_F(ValidateTest, SequenceCountLimit) {
  // Zero-length sequences are allowed, so there may be more sequences than rows, but no more
  // than --max-tokens-per-request of them.
  limits_.max_tokens_per_request = 4;
  v1::ScoreRequest r = HiddenRequest(2);
  for (int64_t len : {0, 1, 0, 1}) r.add_sequence_lengths(len);
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->sequence_lengths, (std::vector<int64_t>{0, 1, 0, 1}));
  r.add_sequence_lengths(0);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kResourceExhausted, HasSubstr("sequence_lengths"),
                HasSubstr("5 sequences"), HasSubstr("4"));
}

TEST_F(ValidateTest, ResponseArraysFitARepeatedField) {
  // Only raised limits get here: 2^15 empty sequences x K = 2^16 - 1 ids per row is
  // 2147450880 sums, within INT32_MAX; one sequence more is 2147516415, beyond it.
  limits_.max_tokens_per_request = int64_t{1} << 40;
  limits_.max_target_ids_per_row = 1 << 16;
  v1::ScoreRequest r = HiddenRequest(0);
  r.mutable_target_ids()->set_shape(0, 0);
  r.mutable_target_ids()->add_shape((1 << 16) - 1);
  for (int i = 0; i < (1 << 15); ++i) r.add_sequence_lengths(0);
  EXPECT_TRUE(Validate(r).ok());
  r.add_sequence_lengths(0);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kResourceExhausted, HasSubstr("sequence_lengths"),
                HasSubstr("2147516415 values"));
}

TEST_F(ValidateTest, ByteLengthMustMatchShape) {
  v1::ScoreRequest r = HiddenRequest(3);
  r.mutable_hidden()->mutable_data()->push_back('x');
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("bytes"));
  r = LogitsRequest(3);
  r.mutable_target_ids()->mutable_data()->resize(5);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"));
}

TEST_F(ValidateTest, NegativeAndOverflowingDims) {
  v1::ScoreRequest r = HiddenRequest(1);
  r.mutable_hidden()->set_shape(0, -1);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("negative"));
  r = LogitsRequest(1);
  r.mutable_logits()->set_shape(0, int64_t{1} << 40);
  r.mutable_logits()->set_shape(1, int64_t{1} << 40);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("logits"));
  // Elements fit in int64, bytes do not.
  r.mutable_logits()->set_shape(0, int64_t{1} << 31);
  r.mutable_logits()->set_shape(1, int64_t{1} << 31);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("logits"));
}

TEST_F(ValidateTest, WrongRank) {
  v1::ScoreRequest r = LogitsRequest(2);
  r.mutable_logits()->add_shape(1);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("logits"),
                HasSubstr("rank 3"));
  r = HiddenRequest(2);
  r.mutable_target_ids()->add_shape(1);
  r.mutable_target_ids()->add_shape(1);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("rank 3"));
}

TEST_F(ValidateTest, UnsupportedDtypes) {
  v1::ScoreRequest r = LogitsRequest(2);
  r.mutable_logits()->set_dtype(v1::DATA_TYPE_INT32);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("logits"),
                HasSubstr("INT32"));
  r = HiddenRequest(2);
  r.mutable_hidden()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("dtype UNSPECIFIED"));
  r = HiddenRequest(2);
  r.mutable_target_ids()->set_dtype(v1::DATA_TYPE_FLOAT32);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("FLOAT32"));
  r = HiddenRequest(2);
  r.mutable_hidden()->set_dtype(static_cast<v1::DataType>(42));
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("42"));
}

TEST_F(ValidateTest, ExactlyOneModelInput) {
  v1::ScoreRequest r = HiddenRequest(2);
  *r.mutable_logits() = LogitsRequest(2).logits();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("logits"), HasSubstr("both"));
  r.clear_hidden();
  r.clear_logits();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("logits"), HasSubstr("neither"));
}

TEST_F(ValidateTest, HeadRules) {
  v1::ScoreRequest r = LogitsRequest(2);
  r.set_head("policy");
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("head"));
  r = HiddenRequest(2);
  r.clear_head();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("head"),
                HasSubstr("required"));
  r = HiddenRequest(2);
  r.set_head("nope");
  EXPECT_STATUS(Validate(r), absl::StatusCode::kNotFound, HasSubstr("head"), HasSubstr("'nope'"));
  r = LogitsRequest(2);
  r.set_head_version(1);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("head_version"));
}

TEST_F(ValidateTest, VersionPinMismatch) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_head_version(2);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kFailedPrecondition, HasSubstr("head_version"),
                HasSubstr("version 1"));
  r = HiddenRequest(2);
  r.set_forward_kl(true);
  r.set_reference_head("ref");
  *r.mutable_reference_hidden() = r.hidden();
  r.set_reference_head_version(7);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kFailedPrecondition,
                HasSubstr("reference_head_version"));
}

TEST_F(ValidateTest, ReferenceNeededButAbsent) {
  for (int option = 0; option < 4; ++option) {
    v1::ScoreRequest r = HiddenRequest(2);
    const char* name = "";
    switch (option) {
      case 0:
        r.set_reference_entropy(true);
        name = "reference_entropy";
        break;
      case 1:
        r.set_forward_kl(true);
        name = "forward_kl";
        break;
      case 2:
        r.set_reverse_kl(true);
        name = "reverse_kl";
        break;
      case 3:
        r.set_jsd_beta(0.5f);
        name = "jsd_beta";
        break;
    }
    EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_hidden"),
                  HasSubstr(name));
  }
}

TEST_F(ValidateTest, UnusedReferenceIsAllowedAndIgnored) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_reference_head("ref");
  *r.mutable_reference_logits() =
      FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(3), {7});  // even malformed
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->job.reference.present());
}

TEST_F(ValidateTest, ReferenceSideRules) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_reverse_kl(true);
  r.set_reference_head("ref");
  *r.mutable_reference_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(2 * kVocab), {2, kVocab});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_head"));
  r.clear_reference_head();
  *r.mutable_reference_hidden() = r.hidden();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_hidden"),
                HasSubstr("reference_logits"), HasSubstr("both"));
  r.clear_reference_logits();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_head"),
                HasSubstr("required"));
  r.set_reference_head("missing");
  EXPECT_STATUS(Validate(r), absl::StatusCode::kNotFound, HasSubstr("reference_head"),
                HasSubstr("missing"));
}

TEST_F(ValidateTest, IdsOutOfRange) {
  v1::ScoreRequest r = HiddenRequest(3);
  std::vector<int64_t> ids = {1, 2, 3, 4, kVocab, 6};
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {3, 2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("row 2"), HasSubstr("column 0"), HasSubstr("50"));
  ids[4] = -5;
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {3, 2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("row 2"), HasSubstr("column 0"), HasSubstr("-5"));
  ids[4] = -100;  // ignore_index
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {3, 2});
  EXPECT_TRUE(Validate(r).ok());
}

TEST_F(ValidateTest, Int64IdsBeyondInt32) {
  v1::ScoreRequest r = HiddenRequest(2);
  const std::vector<int64_t> ids = {1, int64_t{1} << 32};
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("row 1"), HasSubstr("int32"));
  // An INT64 id that wraps to ignore_index in 32 bits is still rejected.
  const std::vector<int64_t> wrap = {1, (int64_t{1} << 32) - 100};
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, wrap, {2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"));
}

TEST_F(ValidateTest, IdRowsMustMatch) {
  v1::ScoreRequest r = HiddenRequest(3);
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, Ids(2), {2});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("target_ids"),
                HasSubstr("2 rows"), HasSubstr("N = 3"));
}

TEST_F(ValidateTest, HiddenWidthMustMatchHead) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_head("wide");
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("hidden"),
                HasSubstr("width 8"), HasSubstr("hidden size 16"), HasSubstr("'wide'"));
}

TEST_F(ValidateTest, ReferenceVocabAndRowsMustMatch) {
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_forward_kl(true);
  r.set_reference_head("small");
  *r.mutable_reference_hidden() = r.hidden();
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_hidden"),
                HasSubstr("vocabulary size 40"), HasSubstr("50"));
  r = LogitsRequest(2);
  r.set_reverse_kl(true);
  *r.mutable_reference_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(3 * kVocab), {3, kVocab});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_logits"),
                HasSubstr("3 rows"), HasSubstr("2 rows"));
  // Logits mode: the reference's vocabulary (its width) must be the model's too.
  *r.mutable_reference_logits() =
      FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(2 * (kVocab + 1)), {2, kVocab + 1});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_logits"),
                HasSubstr("vocabulary size 51"), HasSubstr("model vocabulary size 50"));
  // A hidden-mode model against a logits-mode reference of the wrong width.
  r = HiddenRequest(2);
  r.set_reverse_kl(true);
  *r.mutable_reference_logits() =
      FloatTensor(v1::DATA_TYPE_FLOAT32, Ramp(2 * (kVocab - 1)), {2, kVocab - 1});
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("reference_logits"),
                HasSubstr("vocabulary size 49"), HasSubstr("50"));
}

TEST_F(ValidateTest, Temperatures) {
  for (float t : {0.0f, -1.0f, kNaN, kInf, -kInf}) {
    v1::ScoreRequest r = HiddenRequest(2);
    r.set_temperature(t);
    EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("temperature"));
    r = HiddenRequest(2);
    r.set_reference_temperature(t);
    EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument,
                  HasSubstr("reference_temperature"));
  }
}

TEST_F(ValidateTest, JsdBeta) {
  for (float beta : {-0.01f, 1.01f, kNaN, kInf}) {
    v1::ScoreRequest r = LogitsRequest(2);
    *r.mutable_reference_logits() = r.logits();
    r.set_jsd_beta(beta);
    EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("jsd_beta"));
  }
  for (float beta : {0.0f, 1.0f}) {
    v1::ScoreRequest r = LogitsRequest(2);
    *r.mutable_reference_logits() = r.logits();
    r.set_jsd_beta(beta);
    EXPECT_TRUE(Validate(r).ok());
  }
}

TEST_F(ValidateTest, TopKLimits) {
  limits_.max_top_k = 64;
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_top_k(65);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("top_k"),
                HasSubstr("64"));
  r.set_top_k(kVocab + 1);  // below the cap, above V
  limits_.max_top_k = 1024;
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("top_k"),
                HasSubstr("vocabulary size 50"));
  r.set_top_k(kVocab);
  EXPECT_TRUE(Validate(r).ok());
}

TEST_F(ValidateTest, TooManyTokensIsResourceExhausted) {
  limits_.max_tokens_per_request = 4;
  EXPECT_TRUE(Validate(HiddenRequest(4)).ok());
  EXPECT_STATUS(Validate(HiddenRequest(5)), absl::StatusCode::kResourceExhausted,
                HasSubstr("hidden"), HasSubstr("5 rows"), HasSubstr("4"));
  EXPECT_STATUS(Validate(LogitsRequest(5)), absl::StatusCode::kResourceExhausted,
                HasSubstr("logits"));
}

TEST_F(ValidateTest, SequenceLengths) {
  v1::ScoreRequest r = HiddenRequest(4);
  r.add_sequence_lengths(2);
  r.add_sequence_lengths(-1);
  r.add_sequence_lengths(3);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("sequence_lengths"),
                HasSubstr("entry 1"), HasSubstr("negative"));
  r.set_sequence_lengths(1, 1);
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("sequence_lengths"),
                HasSubstr("sum 6"), HasSubstr("N = 4"));
  r.set_sequence_lengths(2, std::numeric_limits<int64_t>::max());
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument, HasSubstr("sequence_lengths"));
  r.set_sequence_lengths(2, 1);
  EXPECT_TRUE(Validate(r).ok());
}

// The hidden-state scan is not part of validation (which never reads the bulk of a request);
// the service runs CheckHiddenStatesFinite on the validated job.
TEST_F(ValidateTest, NonFiniteHiddenStates) {
  for (v1::DataType dtype :
       {v1::DATA_TYPE_FLOAT32, v1::DATA_TYPE_BFLOAT16, v1::DATA_TYPE_FLOAT16}) {
    for (float bad : {kNaN, kInf, -kInf}) {
      SCOPED_TRACE(v1::DataType_Name(dtype) + " " + std::to_string(bad));
      std::vector<float> h = Ramp(4 * kHidden);
      h[2 * kHidden + 5] = bad;
      h[3 * kHidden + 1] = bad;  // a later bad row is not the one reported
      v1::ScoreRequest r = HiddenRequest(4);
      *r.mutable_hidden() = FloatTensor(dtype, h, {4, kHidden});
      absl::StatusOr<ValidatedRequest> v = Validate(r);
      ASSERT_TRUE(v.ok()) << v.status();
      const absl::Status s = CheckHiddenStatesFinite(v->job);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()),
                  AllOf(HasSubstr("hidden"), HasSubstr("row 2"), HasSubstr("column 5"),
                        HasSubstr(std::isnan(bad) ? "NaN" : (bad > 0 ? "+inf" : "-inf"))));
    }
  }
  // The reference side too.
  std::vector<float> h = Ramp(2 * kHidden);
  h[kHidden] = kNaN;
  v1::ScoreRequest r = HiddenRequest(2);
  r.set_reverse_kl(true);
  r.set_reference_head("ref");
  *r.mutable_reference_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, h, {2, kHidden});
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  const absl::Status s = CheckHiddenStatesFinite(v->job);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("reference_hidden"), HasSubstr("row 1"), HasSubstr("NaN")));
  // Finite hidden states, and logits-mode jobs, pass.
  EXPECT_TRUE(CheckHiddenStatesFinite(Validate(HiddenRequest(3))->job).ok());
  EXPECT_TRUE(CheckHiddenStatesFinite(Validate(LogitsRequest(3))->job).ok());
}

// A large tensor is scanned in row ranges on several threads: the lowest bad row is reported
// whichever range holds it, and bad rows in later ranges do not displace it.
TEST_F(ValidateTest, NonFiniteHiddenStatesInALargeTensor) {
  constexpr int64_t kRows = 600000;  // fp32 [600000, 8]: 19.2 MB, up to four 4 MiB ranges
  std::vector<float> h = Ramp(kRows * kHidden);
  v1::ScoreRequest r;
  r.set_head("policy");
  r.set_entropy(true);
  limits_.max_tokens_per_request = kRows;
  auto check = [&](int threads) {
    *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, h, {kRows, kHidden});
    absl::StatusOr<ValidatedRequest> v = Validate(r);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? CheckHiddenStatesFinite(v->job, threads) : v.status();
  };
  for (int threads : {1, 3, 8}) {
    SCOPED_TRACE(threads);
    h = Ramp(kRows * kHidden);
    EXPECT_TRUE(check(threads).ok());
    h[(kRows - 1) * kHidden + 7] = kNaN;  // the last element of the last range
    EXPECT_THAT(std::string(check(threads).message()),
                AllOf(HasSubstr("row 599999"), HasSubstr("column 7"), HasSubstr("NaN")));
    h[(kRows / 2) * kHidden + 3] = -kInf;  // a middle range
    EXPECT_THAT(std::string(check(threads).message()),
                AllOf(HasSubstr("row 300000"), HasSubstr("column 3"), HasSubstr("-inf")));
    h[5 * kHidden] = kInf;  // the first range
    const absl::Status s = check(threads);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("hidden"), HasSubstr("row 5 "),
                                                HasSubstr("column 0"), HasSubstr("+inf")));
  }
}

TEST_F(ValidateTest, LargeFiniteHiddenValuesAreAccepted) {
  std::vector<float> h = Ramp(2 * kHidden);
  h[0] = 3e38f;
  h[1] = -3e38f;
  v1::ScoreRequest r = HiddenRequest(2);
  *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, h, {2, kHidden});
  absl::StatusOr<ValidatedRequest> v = Validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(CheckHiddenStatesFinite(v->job).ok());
}

TEST_F(ValidateTest, LogitsMayHoldNonFiniteValues) {
  // NaN / +inf logits are the backend's to report (it sees them during its pass); -inf masks.
  std::vector<float> z = Ramp(2 * kVocab);
  z[3] = -kInf;
  z[kVocab + 4] = kNaN;
  v1::ScoreRequest r = LogitsRequest(2);
  *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, z, {2, kVocab});
  EXPECT_TRUE(Validate(r).ok());
}

// Shared-memory tensors: the range is resolved only after dtype and shape passed, with the byte
// count they imply, and the job's views point where the resolver said.
TEST_F(ValidateTest, SharedMemoryTensorsResolveAfterTheirChecks) {
  constexpr int64_t kRows = 3;
  const v1::ScoreRequest by_bytes = HiddenRequest(kRows);
  const std::string region = by_bytes.hidden().data() + by_bytes.target_ids().data();
  v1::ScoreRequest r = by_bytes;
  for (v1::Tensor* t : {r.mutable_hidden(), r.mutable_target_ids()}) {
    t->clear_data();
    t->mutable_shared_memory()->set_region("w");
  }
  r.mutable_target_ids()->mutable_shared_memory()->set_offset(by_bytes.hidden().data().size());
  std::vector<std::string> calls;
  auto resolve = [&](absl::string_view field, const v1::SharedMemoryRef& ref,
                     uint64_t bytes) -> absl::StatusOr<absl::string_view> {
    calls.push_back(absl::StrCat(field, "@", ref.offset(), "+", bytes));
    return absl::string_view(region).substr(ref.offset(), bytes);
  };
  auto validate = [&](const v1::ScoreRequest& req) {
    return ValidateScoreRequest(
        req,
        [this](const std::string& name) -> std::shared_ptr<const PreparedHead> {
          auto it = heads_.find(name);
          return it == heads_.end() ? nullptr : it->second;
        },
        limits_, resolve);
  };
  absl::StatusOr<ValidatedRequest> v = validate(r);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->job.model.hidden.data, region.data());
  EXPECT_EQ(v->job.target_ids, std::vector<int32_t>({0, 7, 14}));
  EXPECT_THAT(calls, ::testing::ElementsAre("hidden@0+48", "target_ids@48+12"));

  // Refused before the resolver is asked: a wrong dtype, a byte_size that the shape contradicts,
  // bytes in data as well.
  calls.clear();
  v1::ScoreRequest wrong_dtype = r;
  wrong_dtype.mutable_hidden()->set_dtype(v1::DATA_TYPE_INT32);
  EXPECT_STATUS(validate(wrong_dtype), absl::StatusCode::kInvalidArgument,
                HasSubstr("hidden: dtype"));
  v1::ScoreRequest wrong_size = r;
  wrong_size.mutable_hidden()->mutable_shared_memory()->set_byte_size(96);
  EXPECT_STATUS(validate(wrong_size), absl::StatusCode::kInvalidArgument,
                HasSubstr("hidden.shared_memory.byte_size: 96 bytes"), HasSubstr("needs 48"));
  v1::ScoreRequest both = r;
  both.mutable_hidden()->set_data("x");
  EXPECT_STATUS(validate(both), absl::StatusCode::kInvalidArgument,
                HasSubstr("must be empty when shared_memory is set"));
  EXPECT_TRUE(calls.empty());
  // The resolver's error is the request's; without a resolver shared memory is refused.
  auto refuse = [](absl::string_view field, const v1::SharedMemoryRef&,
                   uint64_t) -> absl::StatusOr<absl::string_view> {
    return absl::NotFoundError(absl::StrCat(field, ".shared_memory.region: none"));
  };
  EXPECT_STATUS(ValidateScoreRequest(
                    r, [this](const std::string& n) { return heads_[n]; }, limits_, refuse),
                absl::StatusCode::kNotFound, HasSubstr("hidden.shared_memory.region"));
  EXPECT_STATUS(Validate(r), absl::StatusCode::kInvalidArgument,
                HasSubstr("hidden.shared_memory: shared-memory inputs are not available"));
}

}  // namespace
}  // namespace logitserve
