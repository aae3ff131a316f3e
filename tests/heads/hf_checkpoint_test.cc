// Hugging Face model folders as heads: config.json fields, single-file and sharded checkpoints,
// the tie rule, bias, every float dtype, multimodal text_config, and a clear error (naming the
// file, the tensor or the config field) for everything a folder can get wrong. The folders are
// written by the test in the exact save_pretrained layout, with values the test chose, so every
// expectation is the test's own data, never something read back through the loader.
#include "server/heads/hf_checkpoint.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/heads/head_loader.h"
#include "tests/heads/hf_test_checkpoint.h"

namespace logitserve {
namespace {

using kernels::FloatType;
using ::logitserve::testing::EncodeValues;
using ::logitserve::testing::HfTensor;
using ::logitserve::testing::MakeTempFolder;
using ::logitserve::testing::RemoveFolder;
using ::logitserve::testing::WriteHfFolder;
using ::logitserve::testing::WriteTextFile;
using ::testing::HasSubstr;

constexpr int64_t kV = 6;
constexpr int64_t kH = 4;
constexpr SafetensorsDType kF32 = SafetensorsDType::kFloat32;
constexpr SafetensorsDType kBF16 = SafetensorsDType::kBFloat16;
constexpr SafetensorsDType kF16 = SafetensorsDType::kFloat16;

// kV x kH values exactly representable in bf16 and fp16 (multiples of 1/8 below 64), distinct
// per `salt` so that the embedding, lm_head and bias can be told apart.
std::vector<float> Values(int64_t n, int salt) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + salt * 13) % 41 - 20) / 8.0f;
  return v;
}

HfTensor Embedding(SafetensorsDType dtype = kF32,
                   const std::string& name = "model.embed_tokens.weight") {
  return {name, dtype, {kV, kH}, Values(kV * kH, 1)};
}
HfTensor LmHead(SafetensorsDType dtype = kF32, const std::string& name = "lm_head.weight") {
  return {name, dtype, {kV, kH}, Values(kV * kH, 2)};
}
HfTensor LmBias(SafetensorsDType dtype = kF32) {
  return {"lm_head.bias", dtype, {kV}, Values(kV, 3)};
}
// A tensor every real checkpoint has besides the head (the final norm), as a distractor.
HfTensor Norm() { return {"model.norm.weight", kF32, {kH}, Values(kH, 4)}; }

std::string Config(const std::string& extra = "") {
  return absl::StrCat("{\n  \"architectures\": [\"LlamaForCausalLM\"],\n",
                      "  \"hidden_size\": ", kH, ",\n  \"vocab_size\": ", kV,
                      extra.empty() ? "" : ",\n  ", extra, "\n}\n");
}

// The weight bytes a tensor of the test's values has on disk.
std::vector<uint8_t> BytesOf(const HfTensor& t) { return EncodeValues(t.dtype, t.values); }

void ExpectError(const absl::StatusOr<std::shared_ptr<HeadWeights>>& head, absl::StatusCode code,
                 const std::vector<std::string>& parts) {
  ASSERT_FALSE(head.ok()) << "loaded, but expected an error mentioning " << parts[0];
  EXPECT_EQ(head.status().code(), code) << head.status();
  for (const std::string& part : parts) {
    EXPECT_THAT(std::string(head.status().message()), HasSubstr(part));
  }
  EXPECT_THAT(std::string(head.status().message()), HasSubstr("head \"h\""));
}

class HfHeadTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempFolder("hf_checkpoint_test"); }
  void TearDown() override { RemoveFolder(dir_); }
  absl::StatusOr<std::shared_ptr<HeadWeights>> Load() { return LoadHfHead("h", dir_); }
  std::string dir_;
};

TEST_F(HfHeadTest, UntiedTakesLmHeadInEveryDType) {
  for (SafetensorsDType dtype : {kF32, kBF16, kF16}) {
    SCOPED_TRACE(SafetensorsDTypeName(dtype));
    const HfTensor lm_head = LmHead(dtype);
    ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": false"),
                              {Embedding(dtype), Norm(), lm_head}));
    auto head = Load();
    ASSERT_TRUE(head.ok()) << head.status();
    const HeadWeights& w = **head;
    EXPECT_EQ(w.name, "h");
    EXPECT_EQ(w.vocab_size, kV);
    EXPECT_EQ(w.hidden_size, kH);
    EXPECT_EQ(w.dtype, dtype == kF32    ? FloatType::kFloat32
                       : dtype == kBF16 ? FloatType::kBFloat16
                                        : FloatType::kFloat16);
    EXPECT_EQ(w.weight, BytesOf(lm_head));
    EXPECT_TRUE(w.bias.empty());
    EXPECT_EQ(w.transform.logit_scale, 1.0f);
    EXPECT_EQ(w.transform.logits_scaling, 1.0f);
    EXPECT_EQ(w.transform.softcap, 0.0f);
    EXPECT_EQ(w.version, 1u);
    EXPECT_EQ(w.source, dir_ + "/model.safetensors:lm_head.weight");
  }
}

TEST_F(HfHeadTest, TiedTakesTheEmbeddingEvenWhenLmHeadIsStored) {
  // transformers ties lm_head.weight to the embedding when tie_word_embeddings is true: a stored
  // lm_head.weight is overwritten by the tie, so the embedding is the head.
  const HfTensor embedding = Embedding();
  ASSERT_TRUE(
      WriteHfFolder(dir_, Config("\"tie_word_embeddings\": true"), {embedding, Norm(), LmHead()}));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(embedding));
  EXPECT_EQ((*head)->source, dir_ + "/model.safetensors:model.embed_tokens.weight");

  // The usual tied checkpoint: no lm_head.weight at all.
  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": true"), {embedding, Norm()}));
  head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(embedding));
}

TEST_F(HfHeadTest, TieAbsentFollowsTheCheckpoint) {
  const HfTensor embedding = Embedding();
  const HfTensor lm_head = LmHead();
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {embedding, Norm(), lm_head}));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));

  std::filesystem::remove(dir_ + "/model.safetensors");
  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": null"), {embedding, Norm()}));
  head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(embedding));
}

TEST_F(HfHeadTest, BiasInEveryDTypeBecomesExactFp32) {
  for (SafetensorsDType dtype : {kF32, kBF16, kF16}) {
    SCOPED_TRACE(SafetensorsDTypeName(dtype));
    const HfTensor bias = LmBias(dtype);
    ASSERT_TRUE(WriteHfFolder(dir_, Config(), {Embedding(), LmHead(kBF16), bias}));
    auto head = Load();
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ((*head)->dtype, FloatType::kBFloat16);
    EXPECT_EQ((*head)->bias, bias.values);  // representable in every dtype: exact
  }
}

TEST_F(HfHeadTest, TransformFields) {
  struct Case {
    std::string json;
    HeadTransform expected;
  };
  const Case cases[] = {
      {"\"final_logit_softcapping\": 30.0", {1.0f, 1.0f, 30.0f}},  // Gemma 2
      {"\"final_logit_softcapping\": null", {1.0f, 1.0f, 0.0f}},   // Gemma 3 may write null
      {"\"logit_scale\": 0.0625", {0.0625f, 1.0f, 0.0f}},          // Cohere: multiply
      {"\"logits_scaling\": 16", {1.0f, 16.0f, 0.0f}},             // Granite: divide (integer)
      {"\"logits_scaling\": 8.0, \"final_logit_softcapping\": 2.5", {1.0f, 8.0f, 2.5f}},
      {"\"logit_scale\": null, \"logits_scaling\": null", {1.0f, 1.0f, 0.0f}},
      // Absent fields take transformers' class defaults for these model types; null is none.
      {"\"model_type\": \"gemma2\"", {1.0f, 1.0f, 30.0f}},
      {"\"model_type\": \"gemma2\", \"final_logit_softcapping\": null", {1.0f, 1.0f, 0.0f}},
      {"\"model_type\": \"cohere\"", {0.0625f, 1.0f, 0.0f}},
      {"\"model_type\": \"cohere2\", \"logit_scale\": 0.125", {0.125f, 1.0f, 0.0f}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    ASSERT_TRUE(WriteHfFolder(dir_, Config(c.json), {LmHead()}));
    auto head = Load();
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ((*head)->transform.logit_scale, c.expected.logit_scale);
    EXPECT_EQ((*head)->transform.logits_scaling, c.expected.logits_scaling);
    EXPECT_EQ((*head)->transform.softcap, c.expected.softcap);
  }
}

TEST_F(HfHeadTest, ShardedCheckpointReadsTheMappedShards) {
  const HfTensor lm_head = LmHead(kBF16);
  const HfTensor bias = LmBias();
  // The head and its bias in different shards; the embedding in a third.
  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": false"),
                            {Embedding(), Norm(), lm_head, bias},
                            {{"model.embed_tokens.weight", "model-00001-of-00003.safetensors"},
                             {"model.norm.weight", "model-00002-of-00003.safetensors"},
                             {"lm_head.weight", "model-00003-of-00003.safetensors"},
                             {"lm_head.bias", "model-00002-of-00003.safetensors"}}));
  ASSERT_FALSE(std::filesystem::exists(dir_ + "/model.safetensors"));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
  EXPECT_EQ((*head)->bias, bias.values);
  EXPECT_EQ((*head)->source, dir_ + "/model-00003-of-00003.safetensors:lm_head.weight");

  // A shard the head does not need may be missing: only the mapped files are opened.
  std::filesystem::remove(dir_ + "/model-00001-of-00003.safetensors");
  head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
}

TEST_F(HfHeadTest, ShardedTiedCheckpoint) {
  const HfTensor embedding = Embedding(kBF16);
  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": true"), {embedding, Norm()},
                            {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
                             {"model.norm.weight", "model-00002-of-00002.safetensors"}}));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(embedding));
}

TEST_F(HfHeadTest, SingleFileWinsOverAnIndex) {
  // from_pretrained looks for model.safetensors first; so do we.
  const HfTensor lm_head = LmHead();
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {lm_head}));
  ASSERT_TRUE(WriteTextFile(dir_ + "/model.safetensors.index.json", "not json"));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
}

TEST_F(HfHeadTest, MultimodalTextConfig) {
  // Gemma 3 style: sizes and softcap under text_config, tie at the top level, the language
  // model's tensors under model.language_model.
  const std::string config = absl::StrCat(
      "{\"model_type\": \"gemma3\", \"tie_word_embeddings\": true, \"vocab_size\": 999,\n"
      " \"text_config\": {\"hidden_size\": ",
      kH, ", \"vocab_size\": ", kV,
      ", \"final_logit_softcapping\": 30.0},\n"
      " \"vision_config\": {\"hidden_size\": 1152}}");
  const HfTensor embedding = Embedding(kBF16, "model.language_model.embed_tokens.weight");
  ASSERT_TRUE(WriteHfFolder(dir_, config, {embedding, Norm()}));
  auto head = Load();
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->vocab_size, kV);
  EXPECT_EQ((*head)->hidden_size, kH);
  EXPECT_EQ((*head)->transform.softcap, 30.0f);
  EXPECT_EQ((*head)->weight, BytesOf(embedding));
}

TEST_F(HfHeadTest, HeadFlagWithAFolder) {
  const HfTensor lm_head = LmHead();
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {lm_head}));
  auto head = ParseHeadFlag("policy=" + dir_);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->name, "policy");
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
  // A folder whose path holds ':' is still a folder, not FILE:TENSOR.
  const std::string odd = dir_ + "/odd:name";
  std::filesystem::create_directories(odd);
  ASSERT_TRUE(WriteHfFolder(odd, Config(), {lm_head}));
  head = ParseHeadFlag("policy=" + odd);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
  // The FILE:TENSOR form still works beside it.
  head = ParseHeadFlag("policy=" + dir_ + "/model.safetensors:lm_head.weight");
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->weight, BytesOf(lm_head));
  // A bad name is caught for folders too.
  EXPECT_EQ(ParseHeadFlag("bad name=" + dir_).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- Errors --------------------------------------------------------------------------------

TEST_F(HfHeadTest, MissingConfig) {
  ASSERT_TRUE(WriteHfFolder(dir_, "{}", {LmHead()}));
  std::filesystem::remove(dir_ + "/config.json");
  ExpectError(Load(), absl::StatusCode::kNotFound, {dir_ + "/config.json"});
}

TEST_F(HfHeadTest, BadConfigs) {
  struct Case {
    std::string config;
    std::vector<std::string> parts;
  };
  const std::string hidden = absl::StrCat("\"hidden_size\": ", kH);
  const std::string vocab = absl::StrCat("\"vocab_size\": ", kV);
  const Case cases[] = {
      {"{\"vocab_size\": 6,", {"config.json: invalid JSON", "parse error"}},
      {"[1, 2]", {"config.json: must be a JSON object, got array"}},
      {"{" + hidden + "}", {"field \"vocab_size\" is missing"}},
      {"{" + vocab + "}", {"field \"hidden_size\" is missing"}},
      {"{\"vocab_size\": \"6\", " + hidden + "}",
       {"field \"vocab_size\" must be an integer, got \"6\""}},
      {"{\"vocab_size\": 6.5, " + hidden + "}", {"field \"vocab_size\" must be an integer"}},
      {"{\"vocab_size\": 0, " + hidden + "}", {"field \"vocab_size\" 0 is outside [1, "}},
      {"{" + vocab + ", \"hidden_size\": -3}", {"field \"hidden_size\" -3 is outside [1, "}},
      {"{" + vocab + ", \"hidden_size\": 18446744073709551615}",
       {"field \"hidden_size\" 18446744073709551615 is outside"}},
      {Config("\"tie_word_embeddings\": \"yes\""),
       {"field \"tie_word_embeddings\" must be true, false or null"}},
      {Config("\"final_logit_softcapping\": 0"),
       {"field \"final_logit_softcapping\" 0 must be > 0"}},
      {Config("\"final_logit_softcapping\": -30"), {"\"final_logit_softcapping\" -30 must be > 0"}},
      {Config("\"final_logit_softcapping\": \"30\""),
       {"field \"final_logit_softcapping\" must be a number or null"}},
      {Config("\"logit_scale\": 1e300"), {"field \"logit_scale\" 1e+300 is not a finite fp32"}},
      {Config("\"logit_scale\": -0.5"), {"logit_scale -0.5 must be finite and > 0"}},
      {Config("\"logits_scaling\": 0"), {"logits_scaling 0 must be finite and > 0"}},
      {Config("\"logit_scale\": 0.0625, \"logits_scaling\": 8"),
       {"logit_scale 0.0625 and logits_scaling 8 are both set"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.config);
    ASSERT_TRUE(WriteHfFolder(dir_, c.config, {LmHead()}));
    std::vector<std::string> parts = c.parts;
    parts.push_back(dir_ + "/config.json");
    ExpectError(Load(), absl::StatusCode::kInvalidArgument, parts);
  }
}

TEST_F(HfHeadTest, MissingHeadTensors) {
  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": false"), {Embedding(), Norm()}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors has no tensor lm_head.weight or language_model.lm_head.weight",
               "sets tie_word_embeddings to false"});

  ASSERT_TRUE(WriteHfFolder(dir_, Config("\"tie_word_embeddings\": true"), {LmHead(), Norm()}));
  ExpectError(
      Load(), absl::StatusCode::kInvalidArgument,
      {"sets tie_word_embeddings, but", "has no input embedding (model.embed_tokens.weight"});

  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {Norm()}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"has neither lm_head.weight", "nor a tied input embedding"});
}

TEST_F(HfHeadTest, ShapeAndDTypeMismatches) {
  ASSERT_TRUE(WriteHfFolder(dir_, Config(),
                            {{"lm_head.weight", kF32, {kV + 1, kH}, Values((kV + 1) * kH, 2)}}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors:lm_head.weight: shape [7, 4] is not [vocab_size, hidden_size] "
               "= [6, 4] of",
               "config.json"});

  ASSERT_TRUE(
      WriteHfFolder(dir_, Config(), {{"lm_head.weight", kF32, {kV * kH}, Values(kV * kH, 2)}}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument, {"shape [24] is not [vocab_size"});

  ASSERT_TRUE(
      WriteHfFolder(dir_, Config(),
                    {{"lm_head.weight", SafetensorsDType::kInt32, {kV, kH}, Values(kV * kH, 2)}}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"lm_head.weight: dtype I32 is not a head weight type"});

  ASSERT_TRUE(WriteHfFolder(dir_, Config(),
                            {LmHead(), {"lm_head.bias", kF32, {kV - 1}, Values(kV - 1, 3)}}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"model.safetensors:lm_head.bias: shape [5] is not [vocab_size] = [6]"});

  ASSERT_TRUE(WriteHfFolder(
      dir_, Config(), {LmHead(), {"lm_head.bias", SafetensorsDType::kInt32, {kV}, Values(kV, 3)}}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"lm_head.bias: dtype I32 is not a float type"});
}

TEST_F(HfHeadTest, NonFiniteValues) {
  HfTensor lm_head = LmHead(kBF16);
  lm_head.values[1 * kH + 2] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {lm_head}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"weight [1, 2] is nan (must be finite)", "model.safetensors:lm_head.weight"});

  HfTensor bias = LmBias();
  bias.values[4] = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {LmHead(), bias}));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument, {"bias [4] is -inf (must be finite)"});
}

TEST_F(HfHeadTest, NoCheckpoint) {
  ASSERT_TRUE(WriteTextFile(dir_ + "/config.json", Config()));
  ExpectError(Load(), absl::StatusCode::kNotFound,
              {"has neither model.safetensors nor model.safetensors.index.json"});
}

TEST_F(HfHeadTest, BrokenIndexes) {
  const std::map<std::string, std::string> shards = {
      {"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
      {"lm_head.weight", "model-00002-of-00002.safetensors"}};
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {Embedding(), LmHead()}, shards));
  const std::string index = dir_ + "/model.safetensors.index.json";

  // The shard holding the head is gone.
  std::filesystem::remove(dir_ + "/model-00002-of-00002.safetensors");
  ExpectError(Load(), absl::StatusCode::kNotFound,
              {"model.safetensors.index.json maps tensor \"lm_head.weight\" to shard "
               "model-00002-of-00002.safetensors, which is missing"});

  // The index points at a shard that lacks the tensor.
  ASSERT_TRUE(WriteTextFile(index,
                            "{\"weight_map\": {\"lm_head.weight\": "
                            "\"model-00001-of-00002.safetensors\"}}"));
  ExpectError(Load(), absl::StatusCode::kInvalidArgument,
              {"model-00001-of-00002.safetensors has no tensor \"lm_head.weight\" although",
               "maps it there"});

  struct Case {
    std::string text;
    std::string part;
  };
  const Case cases[] = {
      {"{\"weight_map\": ", "model.safetensors.index.json: invalid JSON"},
      {"{\"metadata\": {}}", "\"weight_map\" is missing or not an object"},
      {"[]", "\"weight_map\" is missing or not an object"},
      {"{\"weight_map\": {\"lm_head.weight\": 3}}",
       "weight_map[\"lm_head.weight\"] must be a file name, got 3"},
      {"{\"weight_map\": {\"lm_head.weight\": \"../elsewhere.safetensors\"}}",
       "\"../elsewhere.safetensors\" is not a file name in the model folder"},
      {"{\"weight_map\": {\"lm_head.weight\": \"/abs.safetensors\"}}",
       "is not a file name in the model folder"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    ASSERT_TRUE(WriteTextFile(index, c.text));
    ExpectError(Load(), absl::StatusCode::kInvalidArgument, {c.part});
  }
}

TEST_F(HfHeadTest, CorruptSafetensorsNamesTheFile) {
  ASSERT_TRUE(WriteHfFolder(dir_, Config(), {LmHead()}));
  ASSERT_TRUE(WriteTextFile(dir_ + "/model.safetensors", "garbage"));
  const auto head = Load();
  ASSERT_FALSE(head.ok());
  EXPECT_EQ(head.status().code(), absl::StatusCode::kInvalidArgument) << head.status();
  EXPECT_THAT(std::string(head.status().message()), HasSubstr(dir_ + "/model.safetensors"));
}

TEST(HfConfigTest, ParsesWithoutAFolder) {
  auto config = ParseHfConfig(
      "{\"vocab_size\": 256000, \"hidden_size\": 3584, \"tie_word_embeddings\": true, "
      "\"final_logit_softcapping\": 30.0}",
      "gemma2/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->vocab_size, 256000);
  EXPECT_EQ(config->hidden_size, 3584);
  EXPECT_EQ(config->tie_word_embeddings, std::optional<bool>(true));
  EXPECT_EQ(config->transform.softcap, 30.0f);
  config = ParseHfConfig("{\"vocab_size\": 1, \"hidden_size\": 1}", "c");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->tie_word_embeddings, std::nullopt);
}

}  // namespace
}  // namespace logitserve
