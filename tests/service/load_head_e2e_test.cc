// End-to-end tests of LoadHead against the real `logitserve` binary over loopback: uploads of new
// heads (bf16 and fp32, with bias and transforms) scored against the fp64 reference built from
// the test's own weights; replacement and the version rules (ListHeads, head_version and
// reference_head_version pins); every malformed, oversized, non-finite or cancelled upload
// failing with a status naming the field while the old head keeps serving bit-identical results;
// bearer-token roles; and a hot swap under load in which every response must match the fp64
// reference of exactly the version it reports.
//
// Long file: one server fixture and its upload helpers serve every LoadHead case; split, each
// part would repeat them.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/e2e_support.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve::e2e {
namespace {

using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::IdTensor;
using ::logitserve::testing::Normal;
using ::logitserve::testing::RoundedTo;
using ::logitserve::testing::ServerProcess;
using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A head to upload: its spec, its values and their wire bytes.
struct Upload {
  v1::HeadSpec spec;
  std::vector<float> weight;  // [V * H] before rounding to spec.dtype
  std::vector<float> bias;    // [V] or empty
  std::string weight_bytes;   // as sent
  std::string bias_bytes;

  // The head the server should hold after this upload, at `version`, for the reference.
  std::shared_ptr<const PreparedHead> Expected(uint64_t version) const {
    auto w = std::make_shared<HeadWeights>();
    w->name = spec.name();
    w->vocab_size = spec.vocab_size();
    w->hidden_size = spec.hidden_size();
    w->dtype = spec.dtype() == v1::DATA_TYPE_FLOAT32    ? kernels::FloatType::kFloat32
               : spec.dtype() == v1::DATA_TYPE_BFLOAT16 ? kernels::FloatType::kBFloat16
                                                        : kernels::FloatType::kFloat16;
    w->weight.assign(weight_bytes.begin(), weight_bytes.end());
    if (!bias.empty()) w->bias = RoundedTo(spec.dtype(), bias);
    w->transform.logit_scale = spec.logit_scale() == 0.0f ? 1.0f : spec.logit_scale();
    w->transform.logits_scaling = spec.logits_scaling() == 0.0f ? 1.0f : spec.logits_scaling();
    w->transform.softcap = spec.final_logit_softcapping();
    w->version = version;
    return std::make_shared<PreparedHead>(std::move(w));
  }
};

// Weights with a logit spread of ~3 nats for unit-normal hidden states; bias ~ N(0, 1).
Upload MakeUpload(const std::string& name, int64_t vocab, int64_t hidden, v1::DataType dtype,
                  bool with_bias, uint32_t seed) {
  Upload u;
  u.spec.set_name(name);
  u.spec.set_vocab_size(vocab);
  u.spec.set_hidden_size(hidden);
  u.spec.set_dtype(dtype);
  u.spec.set_has_bias(with_bias);
  u.weight = Normal(vocab * hidden, seed, 3.0f / std::sqrt(static_cast<float>(hidden)));
  u.weight_bytes = FloatTensor(dtype, u.weight, {vocab, hidden}).data();
  if (with_bias) {
    u.bias = Normal(vocab, seed + 1000);
    u.bias_bytes = FloatTensor(dtype, u.bias, {vocab}).data();
  }
  return u;
}

// The upload as chunks of at most `chunk_bytes` payload bytes over weight || bias: the first
// carries the spec, and one chunk may hold the end of the weight and the start of the bias.
std::vector<v1::LoadHeadRequest> Chunks(const Upload& u, size_t chunk_bytes = 1000) {
  std::vector<v1::LoadHeadRequest> chunks;
  const std::string& w = u.weight_bytes;
  const std::string& b = u.bias_bytes;
  const size_t total = w.size() + b.size();
  for (size_t at = 0; at < total || chunks.empty(); at += chunk_bytes) {
    v1::LoadHeadRequest c;
    if (chunks.empty()) *c.mutable_spec() = u.spec;
    const size_t end = std::min(total, at + chunk_bytes);
    if (at < w.size()) c.set_weight_data(w.substr(at, std::min(end, w.size()) - at));
    if (end > w.size()) {
      const size_t from = std::max(at, w.size()) - w.size();
      c.set_bias_data(b.substr(from, end - w.size() - from));
    }
    chunks.push_back(std::move(c));
  }
  return chunks;
}

// Streams `chunks` (stopping early if the server already failed the call), half-closes and
// returns the call's status; `info` gets LoadHeadResponse.head. With `cancel_after`, cancels the
// call after that many chunks instead.
grpc::Status Send(v1::Scorer::Stub& stub, const std::vector<v1::LoadHeadRequest>& chunks,
                  v1::HeadInfo* info, std::optional<size_t> cancel_after = std::nullopt,
                  const std::string& token = "") {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  v1::LoadHeadResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::LoadHeadRequest>> writer =
      stub.LoadHead(&context, &response);
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (cancel_after.has_value() && i == *cancel_after) {
      context.TryCancel();
      break;
    }
    if (!writer->Write(chunks[i])) break;
  }
  if (!cancel_after.has_value()) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  *info = response.head();
  return status;
}

grpc::Status SendUpload(v1::Scorer::Stub& stub, const Upload& u, v1::HeadInfo* info) {
  return Send(stub, Chunks(u), info);
}

std::string Describe(const grpc::Status& s) {
  return absl::StrCat(s.error_code(), ": ", s.error_message());
}

// A server with one synthetic head, two uneven CPU shards.
const SyntheticHead kStatic{"static", 600, 16, 5};

class LoadHeadE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ =
        StartServerProcess({"--synthetic-head", kStatic.Flag(), "--threads", "2", "--shards", "2"})
            .release();
    if (server_ == nullptr) return;
    channel_ = new std::shared_ptr<grpc::Channel>(Connect(server_->address()));
    stub_ = v1::Scorer::NewStub(*channel_).release();
  }
  static void TearDownTestSuite() {
    delete stub_;
    stub_ = nullptr;
    delete channel_;
    channel_ = nullptr;
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(SIGTERM), 0);
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(stub_, nullptr); }

  static v1::Scorer::Stub& stub() { return *stub_; }

  // Installs `u` and checks the returned HeadInfo against the spec and `version`.
  static void Install(const Upload& u, uint64_t version) {
    v1::HeadInfo info;
    const grpc::Status s = SendUpload(stub(), u, &info);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(info.name(), u.spec.name());
    EXPECT_EQ(info.version(), version);
    EXPECT_EQ(info.vocab_size(), u.spec.vocab_size());
    EXPECT_EQ(info.hidden_size(), u.spec.hidden_size());
    EXPECT_EQ(info.dtype(), u.spec.dtype());
    EXPECT_EQ(info.has_bias(), u.spec.has_bias());
    EXPECT_THAT(info.source(), HasSubstr("LoadHead"));
    // The same description as ListHeads.
    const std::optional<v1::HeadInfo> listed = Listed(u.spec.name());
    ASSERT_TRUE(listed.has_value());
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(info, *listed))
        << info.DebugString() << " vs ListHeads " << listed->DebugString();
  }

  // The listed head's version, 0 when there is no such head.
  static uint64_t ListedVersion(const std::string& name) {
    const std::optional<v1::HeadInfo> info = Listed(name);
    return info.has_value() ? info->version() : 0;
  }

  static std::optional<v1::HeadInfo> Listed(const std::string& name) {
    grpc::ClientContext context;
    v1::ListHeadsResponse response;
    const grpc::Status s = stub().ListHeads(&context, v1::ListHeadsRequest(), &response);
    EXPECT_TRUE(s.ok()) << Describe(s);
    for (const v1::HeadInfo& h : response.heads()) {
      if (h.name() == name) return h;
    }
    return std::nullopt;
  }

  // n rows of bf16 hidden states for `head`, [n, 2] target ids, top-5, entropy.
  static v1::ScoreRequest Request(const std::string& head, int64_t vocab, int64_t hidden, int64_t n,
                                  uint32_t seed) {
    v1::ScoreRequest r;
    r.set_request_id(absl::StrCat(head, "-", seed));
    r.set_head(head);
    *r.mutable_hidden() =
        FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * hidden, seed), {n, hidden});
    std::vector<int64_t> ids(n * 2);
    for (int64_t i = 0; i < n * 2; ++i) ids[i] = (i * 131 + seed) % vocab;
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {n, 2});
    r.set_top_k(5);
    r.set_entropy(true);
    return r;
  }
  static v1::ScoreRequest Request(const Upload& u, int64_t n, uint32_t seed) {
    return Request(u.spec.name(), u.spec.vocab_size(), u.spec.hidden_size(), n, seed);
  }

  static void ScoreAndCheck(const v1::ScoreRequest& request, uint64_t version,
                            const HeadMap& heads) {
    v1::ScoreResponse response;
    const grpc::Status s = CallScore(stub(), request, &response);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(response.head_version(), version);
    ExpectMatchesReference(request, response, heads);
  }

  static inline ServerProcess* server_ = nullptr;
  static inline std::shared_ptr<grpc::Channel>* channel_ = nullptr;
  static inline v1::Scorer::Stub* stub_ = nullptr;
};

TEST_F(LoadHeadE2eTest, NewBf16HeadWithBiasAndTransformScoresLikeTheReference) {
  // 2500 ids: two vocabulary blocks over two uneven shards; softcap well inside the logit range.
  Upload u = MakeUpload("up-bf16", 2500, 24, v1::DATA_TYPE_BFLOAT16, /*with_bias=*/true, 1);
  u.spec.set_logit_scale(1.25f);
  u.spec.set_final_logit_softcapping(4.0f);
  ASSERT_FALSE(Listed("up-bf16").has_value());
  Install(u, 1);
  const std::optional<v1::HeadInfo> info = Listed("up-bf16");
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->logit_scale(), 1.25f);
  EXPECT_EQ(info->logits_scaling(), 1.0f);
  EXPECT_EQ(info->final_logit_softcapping(), 4.0f);
  ScoreAndCheck(Request(u, 7, 11), 1, {{"up-bf16", u.Expected(1)}});
}

TEST_F(LoadHeadE2eTest, NewFp32HeadWithBiasScoresLikeTheReference) {
  Upload u = MakeUpload("up-fp32", 777, 20, v1::DATA_TYPE_FLOAT32, /*with_bias=*/true, 2);
  u.spec.set_logits_scaling(0.5f);  // Granite's divide
  Install(u, 1);
  ScoreAndCheck(Request(u, 5, 12), 1, {{"up-fp32", u.Expected(1)}});
  // Large chunks too (one chunk holding everything).
  const Upload v = MakeUpload("up-fp32-one-chunk", 777, 20, v1::DATA_TYPE_FLOAT32, true, 3);
  v1::HeadInfo info;
  ASSERT_TRUE(Send(stub(), Chunks(v, size_t{1} << 30), &info).ok());
  ASSERT_EQ(Chunks(v, size_t{1} << 30).size(), 1u);
  ScoreAndCheck(Request(v, 5, 13), 1, {{v.spec.name(), v.Expected(1)}});
}

TEST_F(LoadHeadE2eTest, ReplacementVersionsAndPins) {
  const Upload v1_upload = MakeUpload("pin", 300, 16, v1::DATA_TYPE_BFLOAT16, false, 10);
  Install(v1_upload, 1);
  const v1::ScoreRequest request = Request(v1_upload, 4, 21);
  ScoreAndCheck(request, 1, {{"pin", v1_upload.Expected(1)}});

  // Version 0 = current + 1, with different weights (and now a bias).
  const Upload v2_upload = MakeUpload("pin", 300, 16, v1::DATA_TYPE_BFLOAT16, true, 11);
  Install(v2_upload, 2);
  EXPECT_EQ(ListedVersion("pin"), 2u);
  ScoreAndCheck(request, 2, {{"pin", v2_upload.Expected(2)}});

  // Pins: the current version passes, the old one is FAILED_PRECONDITION naming the field.
  v1::ScoreRequest pinned = request;
  pinned.set_head_version(2);
  ScoreAndCheck(pinned, 2, {{"pin", v2_upload.Expected(2)}});
  pinned.set_head_version(1);
  v1::ScoreResponse response;
  grpc::Status s = CallScore(stub(), pinned, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("head_version: pinned to 1"));
  EXPECT_THAT(s.error_message(), HasSubstr("at version 2"));

  v1::ScoreRequest with_reference = request;
  with_reference.set_reference_head("pin");
  *with_reference.mutable_reference_hidden() = request.hidden();
  with_reference.set_forward_kl(true);
  with_reference.set_reference_head_version(1);
  s = CallScore(stub(), with_reference, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_THAT(s.error_message(), HasSubstr("reference_head_version: pinned to 1"));
  with_reference.set_reference_head_version(2);
  ScoreAndCheck(with_reference, 2, {{"pin", v2_upload.Expected(2)}});

  // Explicit versions: a jump is fine; equal or lower is FAILED_PRECONDITION and changes nothing.
  Upload v10 = MakeUpload("pin", 300, 16, v1::DATA_TYPE_FLOAT32, false, 12);
  v10.spec.set_version(10);
  Install(v10, 10);
  for (uint64_t stale : {10u, 3u}) {
    SCOPED_TRACE(stale);
    Upload bad = MakeUpload("pin", 300, 16, v1::DATA_TYPE_FLOAT32, false, 13);
    bad.spec.set_version(stale);
    v1::HeadInfo info;
    s = SendUpload(stub(), bad, &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
    EXPECT_THAT(s.error_message(),
                HasSubstr(absl::StrCat("spec.version: ", stale,
                                       " is not greater than head \"pin\"'s current version 10")));
  }
  ScoreAndCheck(request, 10, {{"pin", v10.Expected(10)}});
  const Upload v11 = MakeUpload("pin", 300, 16, v1::DATA_TYPE_FLOAT32, false, 14);
  Install(v11, 11);  // version 0 again: 10 + 1
  ScoreAndCheck(request, 11, {{"pin", v11.Expected(11)}});

  // A head loaded at start-up is replaced the same way.
  const Upload static_v2 =
      MakeUpload(kStatic.name, kStatic.vocab, kStatic.hidden, v1::DATA_TYPE_BFLOAT16, false, 15);
  Install(static_v2, 2);
  ScoreAndCheck(Request(static_v2, 3, 22), 2, {{kStatic.name, static_v2.Expected(2)}});
}

TEST_F(LoadHeadE2eTest, LargestVersionsCannotLockAHead) {
  // 2^64 - 1 (and anything from 2^63) is refused; the head then still takes version 0 uploads.
  const Upload base = MakeUpload("maxed", 200, 16, v1::DATA_TYPE_BFLOAT16, false, 30);
  Install(base, 1);
  for (uint64_t huge : {UINT64_MAX, uint64_t{1} << 63}) {
    SCOPED_TRACE(huge);
    Upload bad = MakeUpload("maxed", 200, 16, v1::DATA_TYPE_BFLOAT16, false, 31);
    bad.spec.set_version(huge);
    v1::HeadInfo info;
    grpc::Status s = SendUpload(stub(), bad, &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("spec.version: ", huge, " is above")));
  }
  // The largest allowed version, then version 0 = current + 1 still works.
  Upload top = MakeUpload("maxed", 200, 16, v1::DATA_TYPE_BFLOAT16, false, 32);
  top.spec.set_version((uint64_t{1} << 63) - 1);
  Install(top, (uint64_t{1} << 63) - 1);
  const Upload next = MakeUpload("maxed", 200, 16, v1::DATA_TYPE_BFLOAT16, false, 33);
  Install(next, uint64_t{1} << 63);
  ScoreAndCheck(Request(next, 3, 34), uint64_t{1} << 63,
                {{"maxed", next.Expected(uint64_t{1} << 63)}});
}

// A failing upload: how to build its chunks from a valid upload of the "keep" head, and the
// status it must get.
struct BadUpload {
  std::string name;
  std::function<std::vector<v1::LoadHeadRequest>(const Upload&)> chunks;
  grpc::StatusCode code;
  std::vector<std::string> message_parts;
};

std::vector<BadUpload> BadUploads() {
  using Chunks_t = std::vector<v1::LoadHeadRequest>;
  const auto with_spec = [](std::function<void(v1::HeadSpec&)> edit) {
    return [edit](const Upload& good) {
      Upload u = good;
      edit(u.spec);
      return Chunks(u);
    };
  };
  return {
      {"TruncatedWeight",
       [](const Upload& good) {
         Upload u = good;
         u.weight_bytes.resize(u.weight_bytes.size() / 2);
         u.bias_bytes.clear();
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"weight_data: the upload ended after 1600 of 3200 bytes", "nothing installed"}},
      {"TruncatedBias",
       [](const Upload& good) {
         Upload u = good;
         u.bias_bytes.resize(u.bias_bytes.size() - 2);
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"bias_data: the upload ended after 198 of 200 bytes"}},
      {"ExtraWeightBytes",
       [](const Upload& good) {
         Upload u = good;
         u.weight_bytes += "xx";
         u.bias_bytes.clear();
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"weight_data: more than the 3200 bytes spec declares ([100, 16] bf16)"}},
      {"ExtraBiasBytes",
       [](const Upload& good) {
         Upload u = good;
         u.bias_bytes += "xx";
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"bias_data: more than the 200 bytes spec declares"}},
      {"OversizeSpec",
       with_spec([](v1::HeadSpec& s) {
         s.set_vocab_size(int64_t{1} << 24);
         s.set_hidden_size(int64_t{1} << 12);
         s.set_dtype(v1::DATA_TYPE_FLOAT32);
       }),
       grpc::StatusCode::RESOURCE_EXHAUSTED,
       {"spec: [16777216, 4096] fp32 weight and bias are", "over the server's limit"}},
      {"IntegerDType",
       with_spec([](v1::HeadSpec& s) { s.set_dtype(v1::DATA_TYPE_INT32); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.dtype: INT32 is not a head weight type"}},
      {"UnsetDType",
       with_spec([](v1::HeadSpec& s) { s.set_dtype(v1::DATA_TYPE_UNSPECIFIED); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.dtype: UNSPECIFIED"}},
      {"NaNWeight",
       [](const Upload& good) {
         Upload u = good;
         u.weight[5 * 16 + 3] = kNaN;
         u.weight_bytes = FloatTensor(v1::DATA_TYPE_BFLOAT16, u.weight, {100, 16}).data();
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"weight_data: head \"keep\": weight [5, 3] is nan (must be finite)"}},
      {"InfBias",
       [](const Upload& good) {
         Upload u = good;
         u.bias[42] = kInf;
         u.bias_bytes = FloatTensor(v1::DATA_TYPE_BFLOAT16, u.bias, {100}).data();
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"bias_data: head \"keep\": bias [42] is inf (must be finite)"}},
      {"SpecMissingOnFirstChunk",
       [](const Upload& good) {
         Chunks_t c = Chunks(good);
         c.front().clear_spec();
         return c;
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec: required on the first LoadHeadRequest"}},
      {"SpecRepeated",
       [](const Upload& good) {
         Chunks_t c = Chunks(good);
         *c[1].mutable_spec() = good.spec;
         return c;
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec: only the first LoadHeadRequest may carry it"}},
      {"NoChunksAtAll",
       [](const Upload&) { return Chunks_t(); },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec: the upload ended before its first LoadHeadRequest"}},
      {"BiasBeforeWeight",
       [](const Upload& good) {
         Chunks_t c = Chunks(good);
         c[1].set_bias_data("ab");
         return c;
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"bias_data: sent before all weight_data (2000 of 3200 weight bytes so far)"}},
      {"BiasWithoutHasBias",
       [](const Upload& good) {
         Upload u = good;
         u.spec.set_has_bias(false);
         return Chunks(u);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       {"bias_data: sent, but spec.has_bias is false"}},
      {"BadName",
       with_spec([](v1::HeadSpec& s) { s.set_name("kee p"); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.name: head name \"kee p\" has character ' '"}},
      {"EmptyName",
       with_spec([](v1::HeadSpec& s) { s.clear_name(); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.name: head name is empty"}},
      {"ZeroVocab",
       with_spec([](v1::HeadSpec& s) { s.set_vocab_size(0); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.vocab_size: 0 is outside [1, "}},
      {"HugeHidden",
       with_spec([](v1::HeadSpec& s) { s.set_hidden_size(int64_t{1} << 40); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.hidden_size: 1099511627776 is outside [1, "}},
      {"NegativeLogitScale",
       with_spec([](v1::HeadSpec& s) { s.set_logit_scale(-2.0f); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.logit_scale -2 must be finite and > 0"}},
      {"BothScales",
       with_spec([](v1::HeadSpec& s) {
         s.set_logit_scale(2.0f);
         s.set_logits_scaling(4.0f);
       }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.logit_scale 2 and logits_scaling 4 are both set"}},
      {"NaNSoftcap",
       with_spec([](v1::HeadSpec& s) { s.set_final_logit_softcapping(kNaN); }),
       grpc::StatusCode::INVALID_ARGUMENT,
       {"spec.final_logit_softcapping nan must be finite and >= 0"}},
      {"StaleExplicitVersion",
       with_spec([](v1::HeadSpec& s) { s.set_version(1); }),
       grpc::StatusCode::FAILED_PRECONDITION,
       {"spec.version: 1 is not greater than head \"keep\"'s current version 1"}},
  };
}

TEST_F(LoadHeadE2eTest, EveryBadUploadFailsAndTheOldHeadKeepsServing) {
  // "keep" v1: [100, 16] bf16 with bias; 1000-byte chunks: 3200 weight bytes, then 200 of bias.
  const Upload good = MakeUpload("keep", 100, 16, v1::DATA_TYPE_BFLOAT16, true, 30);
  Install(good, 1);
  const v1::ScoreRequest request = Request(good, 6, 31);
  v1::ScoreResponse baseline;
  ASSERT_TRUE(CallScore(stub(), request, &baseline).ok());
  ExpectMatchesReference(request, baseline, {{"keep", good.Expected(1)}});
  baseline.clear_queue_us();
  baseline.clear_compute_us();
  const std::optional<v1::HeadInfo> info_before = Listed("keep");
  ASSERT_TRUE(info_before.has_value());

  // A replacement with different weights, so that any leak of a failed upload would show.
  const Upload replacement = MakeUpload("keep", 100, 16, v1::DATA_TYPE_BFLOAT16, true, 32);
  for (const BadUpload& bad : BadUploads()) {
    SCOPED_TRACE(bad.name);
    v1::HeadInfo info;
    const grpc::Status s = Send(stub(), bad.chunks(replacement), &info);
    EXPECT_EQ(s.error_code(), bad.code) << Describe(s);
    for (const std::string& part : bad.message_parts) {
      EXPECT_THAT(s.error_message(), HasSubstr(part));
    }
    const std::optional<v1::HeadInfo> info_after = Listed("keep");
    ASSERT_TRUE(info_after.has_value());
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*info_before, *info_after))
        << info_after->DebugString();
    v1::ScoreResponse again;
    const grpc::Status scored = CallScore(stub(), request, &again);
    ASSERT_TRUE(scored.ok()) << Describe(scored);
    again.clear_queue_us();
    again.clear_compute_us();
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(baseline, again))
        << "results changed after a failed upload";
  }
  // No failed upload left a head behind under another name.
  EXPECT_FALSE(Listed("kee p").has_value());
}

TEST_F(LoadHeadE2eTest, FailedUploadOfANewHeadInstallsNothing) {
  Upload ghost = MakeUpload("ghost", 100, 16, v1::DATA_TYPE_FLOAT32, false, 40);
  ghost.weight_bytes.resize(100);
  v1::HeadInfo info;
  const grpc::Status s = SendUpload(stub(), ghost, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_FALSE(Listed("ghost").has_value());
  v1::ScoreResponse response;
  const grpc::Status scored = CallScore(stub(), Request("ghost", 100, 16, 2, 41), &response);
  EXPECT_EQ(scored.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(scored);
}

TEST_F(LoadHeadE2eTest, CancelledUploadKeepsTheOldHead) {
  const Upload good = MakeUpload("cancel", 200, 16, v1::DATA_TYPE_FLOAT32, false, 50);
  Install(good, 1);
  const v1::ScoreRequest request = Request(good, 4, 51);
  v1::ScoreResponse baseline;
  ASSERT_TRUE(CallScore(stub(), request, &baseline).ok());
  ExpectMatchesReference(request, baseline, {{"cancel", good.Expected(1)}});
  baseline.clear_queue_us();
  baseline.clear_compute_us();

  const Upload replacement = MakeUpload("cancel", 200, 16, v1::DATA_TYPE_FLOAT32, false, 52);
  const std::vector<v1::LoadHeadRequest> chunks = Chunks(replacement);  // 13 chunks
  ASSERT_GT(chunks.size(), 4u);
  v1::HeadInfo info;
  const grpc::Status s = Send(stub(), chunks, &info, /*cancel_after=*/3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << Describe(s);

  EXPECT_EQ(ListedVersion("cancel"), 1u);
  v1::ScoreResponse again;
  ASSERT_TRUE(CallScore(stub(), request, &again).ok());
  again.clear_queue_us();
  again.clear_compute_us();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(baseline, again));
  // The server is fine afterwards: the next upload installs version 2.
  Install(replacement, 2);
}

TEST_F(LoadHeadE2eTest, ConcurrentVersionZeroUploadsGetConsecutiveVersions) {
  // "version 0 = current + 1" is decided under the install lock: racing uploads never collide.
  constexpr int kUploaders = 4;
  Install(MakeUpload("race", 200, 16, v1::DATA_TYPE_BFLOAT16, false, 70), 1);
  std::vector<Upload> uploads;
  for (int i = 0; i < kUploaders; ++i) {
    uploads.push_back(MakeUpload("race", 200, 16, v1::DATA_TYPE_BFLOAT16, true, 71 + i));
  }
  std::vector<grpc::Status> statuses(kUploaders);
  std::vector<v1::HeadInfo> infos(kUploaders);
  std::vector<std::thread> threads;
  for (int i = 0; i < kUploaders; ++i) {
    threads.emplace_back([&, i] {
      auto own_stub = v1::Scorer::NewStub(Connect(server_->address()));
      statuses[i] = SendUpload(*own_stub, uploads[i], &infos[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<uint64_t> versions;
  for (int i = 0; i < kUploaders; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << Describe(statuses[i]);
    versions.push_back(infos[i].version());
  }
  EXPECT_THAT(versions, ::testing::UnorderedElementsAre(2, 3, 4, 5));
  EXPECT_EQ(ListedVersion("race"), 5u);
  // The head now serving is the upload that got version 5.
  for (int i = 0; i < kUploaders; ++i) {
    if (infos[i].version() == 5) {
      ScoreAndCheck(Request(uploads[i], 3, 72), 5, {{"race", uploads[i].Expected(5)}});
    }
  }
}

TEST_F(LoadHeadE2eTest, HotSwapUnderLoadNeverMixesVersions) {
  // Scorer threads score continuously while this thread uploads versions 2..kLast, each with
  // different weights. Every response must match the fp64 reference of the weights of the version
  // it reports; each next version is uploaded only after the current one was seen in responses,
  // so every version is seen without relying on timing.
  constexpr int64_t kVocab = 300, kHidden = 16;
  constexpr uint64_t kLast = 8;
  constexpr int kScorers = 3;
  constexpr int kSightingsPerVersion = 4;
  std::map<uint64_t, Upload> uploads;
  for (uint64_t v = 1; v <= kLast; ++v) {
    uploads.emplace(v, MakeUpload("hot", kVocab, kHidden,
                                  v % 2 ? v1::DATA_TYPE_BFLOAT16 : v1::DATA_TYPE_FLOAT32,
                                  v % 3 == 0, static_cast<uint32_t>(100 + v)));
  }
  std::map<uint64_t, HeadMap> references;
  for (const auto& [v, u] : uploads) references[v] = {{"hot", u.Expected(v)}};
  Install(uploads.at(1), 1);

  absl::Mutex mu;
  std::map<uint64_t, int> seen;  // version -> responses
  int failures = 0;
  std::atomic<bool> stop{false};
  std::vector<std::thread> scorers;
  for (int t = 0; t < kScorers; ++t) {
    scorers.emplace_back([&, t] {
      auto own_stub = v1::Scorer::NewStub(Connect(server_->address()));
      for (uint32_t i = 0; !stop.load(); ++i) {
        const v1::ScoreRequest request =
            Request("hot", kVocab, kHidden, 1 + (i + t) % 5, 1000 * (t + 1) + i);
        v1::ScoreResponse response;
        const grpc::Status s = CallScore(*own_stub, request, &response);
        const auto reference = references.find(response.head_version());
        absl::MutexLock lock(&mu);
        if (!s.ok() || reference == references.end()) {
          ++failures;
          ADD_FAILURE() << "status " << Describe(s) << ", version " << response.head_version();
          if (failures > 5) return;
          continue;
        }
        ++seen[response.head_version()];
        // Under the lock: keeps gtest's failure output per response together.
        ExpectMatchesReference(request, response, reference->second);
      }
    });
  }
  for (uint64_t v = 1; v <= kLast; ++v) {
    {
      const auto sighted = [&] { return seen[v] >= kSightingsPerVersion || failures > 0; };
      absl::MutexLock lock(&mu);
      // A generous bound that only matters if the server stops answering.
      EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&sighted), absl::Seconds(60)))
          << "version " << v << " never seen";
    }
    if (v == kLast) break;
    Install(uploads.at(v + 1), v + 1);
  }
  stop.store(true);
  for (std::thread& t : scorers) t.join();
  EXPECT_EQ(failures, 0);
  for (uint64_t v = 1; v <= kLast; ++v) EXPECT_GE(seen[v], kSightingsPerVersion) << v;
  EXPECT_EQ(ListedVersion("hot"), kLast);
}

// Bearer tokens: LoadHead needs the admin token; a user token is PERMISSION_DENIED, none is
// UNAUTHENTICATED, and neither reads a byte of the upload or changes anything.
TEST(LoadHeadAuthTest, OnlyTheAdminTokenMayUpload) {
  const std::string dir = ::testing::TempDir();
  const std::string user_file = absl::StrCat(dir, "/load_head_user_", getpid());
  const std::string admin_file = absl::StrCat(dir, "/load_head_admin_", getpid());
  std::ofstream(user_file) << "user-secret\n";
  std::ofstream(admin_file) << "admin-secret\n";
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start({"--synthetic-head", kStatic.Flag(), "--threads", "1",
                            "--auth-token-file", user_file, "--admin-token-file", admin_file});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Scorer::NewStub(Connect((*server)->address()));
  const Upload u = MakeUpload("secured", 50, 8, v1::DATA_TYPE_FLOAT32, false, 60);

  v1::HeadInfo info;
  grpc::Status s = Send(*stub, Chunks(u), &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);
  s = Send(*stub, Chunks(u), &info, std::nullopt, "user-secret");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  s = Send(*stub, Chunks(u), &info, std::nullopt, "wrong");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << Describe(s);

  const auto listed_names = [&] {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer user-secret");
    v1::ListHeadsResponse response;
    EXPECT_TRUE(stub->ListHeads(&context, v1::ListHeadsRequest(), &response).ok());
    std::vector<std::string> names;
    for (const v1::HeadInfo& h : response.heads()) names.push_back(h.name());
    return names;
  };
  EXPECT_THAT(listed_names(), ::testing::ElementsAre(kStatic.name));

  s = Send(*stub, Chunks(u), &info, std::nullopt, "admin-secret");
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(info.version(), 1u);
  EXPECT_THAT(listed_names(), ::testing::ElementsAre("secured", kStatic.name));  // sorted
  std::remove(user_file.c_str());
  std::remove(admin_file.c_str());
}

}  // namespace
}  // namespace logitserve::e2e
