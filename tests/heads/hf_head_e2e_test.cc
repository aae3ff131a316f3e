// The real `logitserve` binary serving Hugging Face model folders (`--head NAME=DIR`) over
// loopback: Score results against the fp64 reference computed from the test's own weights and
// config values, for a sharded bf16 head with bias + Cohere logit_scale + softcap, an fp32 head
// with bias + Granite logits_scaling + softcap, and a tied fp16 head; ListHeads reports what was
// read; a broken folder stops the server before it listens, naming the problem.
//
// With scale, bias and softcap all active (softcap well inside the logits' range), any other
// order than z = softcap(scale * (h W^T + bias)) moves logits by far more than the tolerances.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "logitserve/kernels/dtype.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/heads/hf_test_checkpoint.h"
#include "tests/service/e2e_support.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve::e2e {
namespace {

using ::logitserve::testing::EncodeValues;
using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::HfTensor;
using ::logitserve::testing::IdTensor;
using ::logitserve::testing::MakeTempFolder;
using ::logitserve::testing::Normal;
using ::logitserve::testing::RemoveFolder;
using ::logitserve::testing::ServerProcess;
using ::logitserve::testing::WriteHfFolder;
using ::testing::HasSubstr;
using ::testing::Not;

// Two vocabulary blocks (2048 each), the second partial; two uneven CPU shards.
constexpr int64_t kVocab = 2500;
constexpr int64_t kHidden = 48;

kernels::FloatType FloatTypeOf(SafetensorsDType dtype) {
  return dtype == SafetensorsDType::kFloat32    ? kernels::FloatType::kFloat32
         : dtype == SafetensorsDType::kBFloat16 ? kernels::FloatType::kBFloat16
                                                : kernels::FloatType::kFloat16;
}

// `values` as the server holds them after reading `dtype` from disk: the encoded bytes decoded.
std::vector<float> AsStored(SafetensorsDType dtype, const std::vector<float>& values) {
  const std::vector<uint8_t> bytes = EncodeValues(dtype, values);
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    out[i] = kernels::LoadAsFloat(FloatTypeOf(dtype), bytes.data(), static_cast<int64_t>(i));
  }
  return out;
}

// One HF folder and the head the test expects the server to make of it.
struct HfHead {
  std::string name;
  std::string dir;
  std::shared_ptr<const PreparedHead> expected;  // for the fp64 reference
};

// Writes a folder holding `head_tensor` as the head (lm_head.weight, or the embedding when
// `tied`), optionally `bias`, with `config_extra` in config.json; returns the expected head.
HfHead MakeFolder(const std::string& name, SafetensorsDType dtype, bool tied, bool with_bias,
                  SafetensorsDType bias_dtype, HeadTransform transform,
                  const std::string& config_extra, bool sharded, uint32_t seed) {
  HfHead out;
  out.name = name;
  out.dir = MakeTempFolder(name);
  // Logits with a spread of ~3 nats for unit-normal hidden states, before the transform.
  const std::vector<float> weight =
      Normal(kVocab * kHidden, seed, 3.0f / std::sqrt(static_cast<float>(kHidden)));
  const std::vector<float> other = Normal(kVocab * kHidden, seed + 1, 1.0f);
  const std::vector<float> bias = Normal(kVocab, seed + 2, 1.0f);

  const std::string head_name = tied ? "model.embed_tokens.weight" : "lm_head.weight";
  std::vector<HfTensor> tensors = {
      {head_name, dtype, {kVocab, kHidden}, weight},
      {"model.norm.weight", SafetensorsDType::kFloat32, {kHidden}, Normal(kHidden, seed, 1.0f)}};
  if (!tied) {  // the input embedding of an untied model is a different matrix
    tensors.push_back({"model.embed_tokens.weight", dtype, {kVocab, kHidden}, other});
  }
  if (with_bias) tensors.push_back({"lm_head.bias", bias_dtype, {kVocab}, bias});
  std::map<std::string, std::string> shards;
  if (sharded) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      shards[tensors[i].name] = absl::StrCat("model-0000", i % 2 + 1, "-of-00002.safetensors");
    }
  }
  const std::string config =
      absl::StrCat("{\"architectures\": [\"SomeForCausalLM\"], \"vocab_size\": ", kVocab,
                   ", \"hidden_size\": ", kHidden,
                   ", \"tie_word_embeddings\": ", tied ? "true" : "false", config_extra, "}");
  EXPECT_TRUE(WriteHfFolder(out.dir, config, tensors, shards));

  auto w = std::make_shared<HeadWeights>();
  w->name = name;
  w->vocab_size = kVocab;
  w->hidden_size = kHidden;
  w->dtype = FloatTypeOf(dtype);
  w->weight = EncodeValues(dtype, weight);
  if (with_bias) w->bias = AsStored(bias_dtype, bias);
  w->transform = transform;
  out.expected = std::make_shared<PreparedHead>(std::move(w));
  return out;
}

class HfHeadE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Cohere's multiply and Gemma's softcap, with a bias: z = 4 tanh(1.5 (hW + b) / 4).
    heads_.push_back(MakeFolder("combo", SafetensorsDType::kBFloat16, /*tied=*/false,
                                /*with_bias=*/true, SafetensorsDType::kBFloat16, {1.5f, 1.0f, 4.0f},
                                ", \"logit_scale\": 1.5, \"final_logit_softcapping\": 4.0",
                                /*sharded=*/true, 21));
    // Granite's divide, with softcap and an fp32 bias: z = 3 tanh(((hW + b) / 0.5) / 3).
    heads_.push_back(MakeFolder("granite", SafetensorsDType::kFloat32, false, true,
                                SafetensorsDType::kFloat32, {1.0f, 0.5f, 3.0f},
                                ", \"logits_scaling\": 0.5, \"final_logit_softcapping\": 3.0",
                                false, 31));
    // Tied fp16 embedding, no transform; no logit_scale-family fields at all.
    heads_.push_back(MakeFolder("tied", SafetensorsDType::kFloat16, true, false,
                                SafetensorsDType::kFloat32, {}, "", true, 41));
    std::vector<std::string> args = {"--threads", "2", "--shards", "2"};
    for (const HfHead& h : heads_) {
      args.push_back("--head");
      args.push_back(h.name + "=" + h.dir);
      reference_heads_[h.name] = h.expected;
    }
    server_ = StartServerProcess(args).release();
    if (server_ == nullptr) return;
    stub_ = v1::Scorer::NewStub(Connect(server_->address())).release();
  }
  static void TearDownTestSuite() {
    delete stub_;
    stub_ = nullptr;
    delete server_;
    server_ = nullptr;
    for (const HfHead& h : heads_) RemoveFolder(h.dir);
    heads_.clear();
    reference_heads_.clear();
  }
  void SetUp() override { ASSERT_NE(stub_, nullptr); }

  static v1::ScoreRequest Request(const std::string& head, int64_t n, uint32_t seed) {
    v1::ScoreRequest r;
    r.set_request_id(head);
    r.set_head(head);
    *r.mutable_hidden() =
        FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * kHidden, seed, 1.0f), {n, kHidden});
    std::vector<int64_t> ids(n * 2);
    for (int64_t i = 0; i < n * 2; ++i) ids[i] = (i * 977 + seed) % kVocab;
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {n, 2});
    r.set_top_k(5);
    r.set_entropy(true);
    return r;
  }

  static void ScoreAndCheck(const v1::ScoreRequest& request) {
    v1::ScoreResponse response;
    const grpc::Status status = CallScore(*stub_, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
    EXPECT_EQ(response.head_version(), 1u);
    ExpectMatchesReference(request, response, reference_heads_);
  }

  static inline std::vector<HfHead> heads_;
  static inline HeadMap reference_heads_;
  static inline ServerProcess* server_ = nullptr;
  static inline v1::Scorer::Stub* stub_ = nullptr;
};

TEST_F(HfHeadE2eTest, ListHeadsReportsTheConfig) {
  grpc::ClientContext context;
  v1::ListHeadsResponse response;
  ASSERT_TRUE(stub_->ListHeads(&context, v1::ListHeadsRequest(), &response).ok());
  ASSERT_EQ(response.heads_size(), 3);
  std::map<std::string, v1::HeadInfo> by_name;
  for (const v1::HeadInfo& h : response.heads()) by_name[h.name()] = h;
  const v1::HeadInfo& combo = by_name["combo"];
  EXPECT_EQ(combo.vocab_size(), kVocab);
  EXPECT_EQ(combo.hidden_size(), kHidden);
  EXPECT_EQ(combo.dtype(), v1::DATA_TYPE_BFLOAT16);
  EXPECT_TRUE(combo.has_bias());
  EXPECT_EQ(combo.logit_scale(), 1.5f);
  EXPECT_EQ(combo.logits_scaling(), 1.0f);
  EXPECT_EQ(combo.final_logit_softcapping(), 4.0f);
  EXPECT_EQ(combo.version(), 1u);
  EXPECT_THAT(combo.source(), HasSubstr(heads_[0].dir));
  EXPECT_THAT(combo.source(), HasSubstr(":lm_head.weight"));
  const v1::HeadInfo& granite = by_name["granite"];
  EXPECT_EQ(granite.dtype(), v1::DATA_TYPE_FLOAT32);
  EXPECT_TRUE(granite.has_bias());
  EXPECT_EQ(granite.logit_scale(), 1.0f);
  EXPECT_EQ(granite.logits_scaling(), 0.5f);
  EXPECT_EQ(granite.final_logit_softcapping(), 3.0f);
  const v1::HeadInfo& tied = by_name["tied"];
  EXPECT_EQ(tied.dtype(), v1::DATA_TYPE_FLOAT16);
  EXPECT_FALSE(tied.has_bias());
  EXPECT_THAT(tied.source(), HasSubstr(":model.embed_tokens.weight"));
}

TEST_F(HfHeadE2eTest, ScoreMatchesTheReferenceForEveryHead) {
  uint32_t seed = 100;
  for (const HfHead& h : heads_) {
    SCOPED_TRACE(h.name);
    ScoreAndCheck(Request(h.name, 7, ++seed));
  }
}

TEST_F(HfHeadE2eTest, DivergencesBetweenTransformedHeads) {
  // combo as the model, granite as the reference: both transforms in one pass.
  v1::ScoreRequest r = Request("combo", 6, 7);
  r.set_reference_head("granite");
  *r.mutable_reference_hidden() =
      FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(6 * kHidden, 8, 1.0f), {6, kHidden});
  r.set_reference_entropy(true);
  r.set_forward_kl(true);
  r.set_reverse_kl(true);
  r.set_jsd_beta(0.3f);
  r.set_temperature(0.7f);
  ScoreAndCheck(r);
}

TEST(HfHeadStartupTest, BrokenFolderFailsBeforeListening) {
  const std::string dir = MakeTempFolder("broken");
  ASSERT_TRUE(WriteHfFolder(
      dir, absl::StrCat("{\"vocab_size\": 10, \"hidden_size\": 4}"),
      {{"lm_head.weight", SafetensorsDType::kFloat32, {10, 5}, std::vector<float>(50, 0.5f)}}));
  absl::StatusOr<ServerProcess::ExitResult> r =
      ServerProcess::RunToExit({"--head", "broken=" + dir});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->exit_code, 0);
  EXPECT_THAT(r->output, HasSubstr("head \"broken\""));
  EXPECT_THAT(r->output, HasSubstr("lm_head.weight: shape [10, 5] is not [vocab_size, "
                                   "hidden_size] = [10, 4]"));
  EXPECT_THAT(r->output, Not(HasSubstr("listening")));
  RemoveFolder(dir);
}

}  // namespace
}  // namespace logitserve::e2e
