// Head loading: synthetic heads (determinism, pinned bits, logit spread), flag parsing, and
// safetensors heads (exact values for every float dtype; clear errors for everything else).
#include "server/heads/head_loader.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors/float_type.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using kernels::FloatType;
using ::testing::HasSubstr;

constexpr FloatType kAllFloatTypes[] = {FloatType::kFloat32, FloatType::kBFloat16,
                                        FloatType::kFloat16};

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/head_loader_test_", ::getpid(), "_", name);
}

uint64_t Fnv1a(const std::vector<uint8_t>& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

void ExpectInvalid(const absl::Status& status, const std::string& problem) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(problem));
}

// ---- fp16 encoding ---------------------------------------------------------------------------

TEST(Float16Test, ExactOnEveryFloat16Value) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    if ((bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0) {  // NaN stays a NaN
      EXPECT_TRUE(std::isnan(
          kernels::Float16ToFloat(kernels::FloatToFloat16(kernels::Float16ToFloat(bits)))));
      continue;
    }
    ASSERT_EQ(kernels::FloatToFloat16(kernels::Float16ToFloat(bits)), bits) << std::hex << h;
  }
}

TEST(Float16Test, RoundsToNearestEven) {
  // Between 1 (0x3c00) and its successor 1 + 2^-10 (0x3c01): ties go to the even 0x3c00, and
  // the tie above 1 + 2^-10 goes up to the even 0x3c02.
  EXPECT_EQ(kernels::FloatToFloat16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(kernels::FloatToFloat16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  EXPECT_EQ(kernels::FloatToFloat16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(kernels::FloatToFloat16(65504.0f), 0x7bff);
  EXPECT_EQ(kernels::FloatToFloat16(65519.0f), 0x7bff);
  EXPECT_EQ(kernels::FloatToFloat16(65520.0f), 0x7c00);  // tie between 65504 and 2^16 -> inf
  EXPECT_EQ(kernels::FloatToFloat16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even zero
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp tie -> even 2
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)),
            0x0400);  // to normal
  // The tie between the largest subnormal (0x03ff, odd) and the smallest normal: up, to even.
  EXPECT_EQ(kernels::FloatToFloat16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);
  EXPECT_EQ(kernels::FloatToFloat16(-std::ldexp(1.0f, -14)), 0x8400);  // smallest normal, negative
  EXPECT_EQ(kernels::FloatToFloat16(-0.0f), 0x8000);
  EXPECT_EQ(kernels::FloatToFloat16(1e-30f), 0x0000);
}

// ---- synthetic heads -------------------------------------------------------------------------

TEST(SyntheticHeadTest, SameSeedSameBitsDifferentSeedDiffers) {
  for (FloatType dtype : kAllFloatTypes) {
    SCOPED_TRACE(FloatTypeName(dtype));
    auto a = MakeSyntheticHead("h", 111, 64, 42, dtype);
    auto b = MakeSyntheticHead("h", 111, 64, 42, dtype);
    auto c = MakeSyntheticHead("h", 111, 64, 43, dtype);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ((*a)->weight, (*b)->weight);
    EXPECT_NE((*a)->weight, (*c)->weight);
    EXPECT_EQ((*a)->weight.size(), 111u * 64u * kernels::SizeOf(dtype));
    EXPECT_EQ((*a)->vocab_size, 111);
    EXPECT_EQ((*a)->hidden_size, 64);
    EXPECT_EQ((*a)->dtype, dtype);
    EXPECT_EQ((*a)->version, 1u);
    EXPECT_TRUE((*a)->bias.empty());
    EXPECT_EQ((*a)->source,
              absl::StrCat("synthetic:vocab=111,hidden=64,seed=42,dtype=", FloatTypeName(dtype)));
  }
}

// The bits are a promise across machines, builds and thread counts: pin them. (If the generator
// is ever changed on purpose, these constants change with it, and benchmarks' heads change.)
TEST(SyntheticHeadTest, PinnedBits) {
  struct Case {
    FloatType dtype;
    int64_t vocab, hidden;
    uint64_t seed;
    uint64_t fnv;
  };
  const Case cases[] = {
      {FloatType::kFloat32, 17, 33, 0, 0x1f3dce2938284122ull},
      {FloatType::kBFloat16, 17, 33, 0, 0xfd40bf5e835e14b9ull},
      {FloatType::kFloat16, 17, 33, 0, 0x5db3ed9f2452c4ccull},
      {FloatType::kBFloat16, 4099, 1031, 7,
       0xcfbf27a953682243ull},  // > 2^22 elements: filled by several threads
  };
  for (const Case& c : cases) {
    auto head = MakeSyntheticHead("pinned", c.vocab, c.hidden, c.seed, c.dtype);
    ASSERT_TRUE(head.ok());
    EXPECT_EQ(Fnv1a((*head)->weight), c.fnv)
        << FloatTypeName(c.dtype) << " [" << c.vocab << ", " << c.hidden << "] seed " << c.seed
        << ": 0x" << std::hex << Fnv1a((*head)->weight);
  }
}

// Element i depends only on (seed, i): a smaller head with the same hidden size is a prefix of a
// larger one, however many threads built either.
TEST(SyntheticHeadTest, RowsIndependentOfVocabAndThreads) {
  auto small = MakeSyntheticHead("s", 9, 1024, 5, FloatType::kFloat32);
  auto large = MakeSyntheticHead("l", 8192, 1024, 5, FloatType::kFloat32);
  ASSERT_TRUE(small.ok() && large.ok());
  ASSERT_EQ(std::memcmp((*small)->weight.data(), (*large)->weight.data(), (*small)->weight.size()),
            0);
}

// Logits h.W for unit-normal h should spread like real LM logits: std = kSyntheticLogitStd.
TEST(SyntheticHeadTest, LogitSpread) {
  constexpr int64_t kVocab = 4096;
  constexpr int64_t kHidden = 1024;
  // Per-row sample std over 4096 logits has relative standard error ~1/sqrt(2 * 4096) = 1.1%;
  // averaged over kRows rows, and with bf16 weight rounding (relative 2^-9), 5% is generous.
  constexpr int kRows = 8;
  constexpr double kRelTol = 0.05;
  for (FloatType dtype : kAllFloatTypes) {
    SCOPED_TRACE(FloatTypeName(dtype));
    auto head = MakeSyntheticHead("spread", kVocab, kHidden, 11, dtype);
    ASSERT_TRUE(head.ok());
    std::mt19937_64 rng(123);
    std::normal_distribution<double> normal;
    double std_sum = 0, mean_sum = 0, max_abs = 0;
    for (int r = 0; r < kRows; ++r) {
      std::vector<double> h(kHidden);
      for (double& x : h) x = normal(rng);
      double sum = 0, sum_sq = 0;
      for (int64_t j = 0; j < kVocab; ++j) {
        const uint8_t* row = (*head)->weight.data() + j * kHidden * kernels::SizeOf(dtype);
        double z = 0;
        for (int64_t k = 0; k < kHidden; ++k) z += h[k] * kernels::LoadAsFloat(dtype, row, k);
        sum += z;
        sum_sq += z * z;
        max_abs = std::max(max_abs, std::abs(z));
      }
      const double mean = sum / kVocab;
      mean_sum += mean;
      std_sum += std::sqrt(sum_sq / kVocab - mean * mean);
    }
    const double measured_std = std_sum / kRows;
    EXPECT_NEAR(measured_std, kSyntheticLogitStd, kRelTol * kSyntheticLogitStd);
    EXPECT_GE(measured_std, 2.0);
    EXPECT_LE(measured_std, 4.0);
    // The mean of 4096 logits of std 3 is within ~6 standard errors (0.047 each) of 0.
    EXPECT_NEAR(mean_sum / kRows, 0.0, 0.3);
    EXPECT_LT(max_abs, 8 * kSyntheticLogitStd);  // nothing wild
  }
}

TEST(SyntheticHeadTest, RejectsBadArguments) {
  ExpectInvalid(MakeSyntheticHead("", 10, 10, 0).status(), "head name is empty");
  ExpectInvalid(MakeSyntheticHead("a b", 10, 10, 0).status(), "has character ' '");
  ExpectInvalid(MakeSyntheticHead(std::string(129, 'x'), 10, 10, 0).status(),
                "longer than 128 characters");
  ExpectInvalid(MakeSyntheticHead("h", 0, 10, 0).status(), "vocab size 0 is outside [1, ");
  ExpectInvalid(MakeSyntheticHead("h", 10, -1, 0).status(), "hidden size -1 is outside [1, ");
  ExpectInvalid(MakeSyntheticHead("h", kMaxHeadVocab + 1, 10, 0).status(), "vocab size");
  ExpectInvalid(
      MakeSyntheticHead("h", kMaxHeadVocab, kMaxHeadHidden, 0, FloatType::kFloat32).status(),
      "over the limit of");
  EXPECT_TRUE(MakeSyntheticHead("Qwen2.5-7B_lm-head", 1, 1, 0).ok());
}

TEST(SyntheticHeadSpecTest, Parses) {
  auto spec = ParseSyntheticHeadSpec("policy:vocab=32000,hidden=4096,seed=1");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "policy");
  EXPECT_EQ(spec->vocab, 32000);
  EXPECT_EQ(spec->hidden, 4096);
  EXPECT_EQ(spec->seed, 1u);
  EXPECT_EQ(spec->dtype, FloatType::kBFloat16);

  spec = ParseSyntheticHeadSpec("r.1:seed=18446744073709551615,dtype=fp16,hidden=7,vocab=5");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->seed, 18446744073709551615ull);
  EXPECT_EQ(spec->dtype, FloatType::kFloat16);
  EXPECT_EQ(spec->vocab, 5);
  EXPECT_EQ(spec->hidden, 7);
  EXPECT_EQ(ParseSyntheticHeadSpec("a:vocab=1,hidden=1,seed=0,dtype=fp32")->dtype,
            FloatType::kFloat32);

  auto head = MakeSyntheticHead(*ParseSyntheticHeadSpec("x:vocab=3,hidden=2,seed=9"));
  ASSERT_TRUE(head.ok());
  EXPECT_EQ((*head)->weight, (*MakeSyntheticHead("x", 3, 2, 9))->weight);
}

TEST(SyntheticHeadSpecTest, PreciseErrors) {
  const auto error = [](const std::string& spec) { return ParseSyntheticHeadSpec(spec).status(); };
  ExpectInvalid(error("policy"), "missing ':' after the head name");
  ExpectInvalid(error(":vocab=1,hidden=1,seed=1"), "head name is empty");
  ExpectInvalid(error("p/q:vocab=1,hidden=1,seed=1"), "has character '/'");
  ExpectInvalid(error("p:hidden=1,seed=1"), "missing vocab=");
  ExpectInvalid(error("p:vocab=1,seed=1"), "missing hidden=");
  ExpectInvalid(error("p:vocab=1,hidden=1"), "missing seed=");
  ExpectInvalid(error("p:vocab=1,hidden=1,seed=1,"), "empty field");
  ExpectInvalid(error("p:"), "empty field");
  ExpectInvalid(error("p:vocab=1,hidden=1,seed"), "field \"seed\" is not KEY=VALUE");
  ExpectInvalid(error("p:vocab=1,hidden=1,seed=1,size=3"), "unknown key \"size\"");
  ExpectInvalid(error("p:vocab=1,vocab=2,hidden=1,seed=1"), "key \"vocab\" given twice");
  ExpectInvalid(error("p:vocab=1k,hidden=1,seed=1"),
                "vocab \"1k\" is not a non-negative decimal integer");
  ExpectInvalid(error("p:vocab=-5,hidden=1,seed=1"), "vocab \"-5\" is not");
  ExpectInvalid(error("p:vocab=+5,hidden=1,seed=1"), "vocab \"+5\" is not");
  ExpectInvalid(error("p:vocab= 5,hidden=1,seed=1"), "vocab \" 5\" is not");
  ExpectInvalid(error("p:vocab=,hidden=1,seed=1"), "vocab \"\" is not");
  ExpectInvalid(error("p:vocab=1,hidden=1,seed=18446744073709551616"),
                "seed \"18446744073709551616\"");
  ExpectInvalid(error("p:vocab=0,hidden=1,seed=1"), "vocab 0 is outside [1, 16777216]");
  ExpectInvalid(error("p:vocab=1,hidden=999999,seed=1"), "hidden 999999 is outside [1, 131072]");
  ExpectInvalid(error("p:vocab=1,hidden=1,seed=1,dtype=f16"),
                "dtype \"f16\" is not bf16, fp16 or fp32");
  // Every message repeats the flag and the expected form.
  EXPECT_THAT(std::string(error("p:vocab=0,hidden=1,seed=1").message()),
              HasSubstr("--synthetic-head \"p:vocab=0,hidden=1,seed=1\""));
  EXPECT_THAT(std::string(error("p").message()),
              HasSubstr("expected NAME:vocab=V,hidden=H,seed=S[,dtype=bf16|fp16|fp32]"));
}

// ---- safetensors heads -----------------------------------------------------------------------

// Writes `values` [vocab, hidden] as `dtype` to a file, as tensor "lm_head.weight" beside a
// 1-D "bias" and an I32 "ids".
struct HeadFile {
  std::string path;
  std::vector<uint8_t> weight_bytes;
};

HeadFile WriteHeadFile(const std::string& name, FloatType dtype, int64_t vocab, int64_t hidden,
                       const std::vector<float>& values) {
  HeadFile out;
  out.path = TempPath(name);
  for (float v : values) {
    uint8_t bytes[4];
    size_t n = 2;
    if (dtype == FloatType::kFloat32) {
      std::memcpy(bytes, &v, 4);
      n = 4;
    } else {
      const uint16_t bits =
          dtype == FloatType::kBFloat16 ? kernels::FloatToBFloat16(v) : kernels::FloatToFloat16(v);
      std::memcpy(bytes, &bits, 2);
    }
    out.weight_bytes.insert(out.weight_bytes.end(), bytes, bytes + n);
  }
  const std::vector<uint8_t> bias(vocab * 4, 0);
  const std::vector<uint8_t> ids(12, 1);
  const SafetensorsTensorToWrite tensors[] = {
      {"lm_head.weight", SafetensorsDTypeFromFloatType(dtype), {vocab, hidden}, out.weight_bytes},
      {"bias", SafetensorsDType::kFloat32, {vocab}, bias},
      {"ids", SafetensorsDType::kInt32, {3, 1}, ids},
      {"cube", SafetensorsDType::kFloat32, {1, 1, 1}, absl::MakeConstSpan(bias).subspan(0, 4)},
      {"no_rows", SafetensorsDType::kFloat32, {0, 4}, {}},
  };
  EXPECT_TRUE(WriteSafetensors(out.path, tensors).ok());
  return out;
}

TEST(SafetensorsHeadTest, LoadsEveryFloatDTypeExactly) {
  constexpr int64_t kVocab = 5, kHidden = 3;
  // Values exactly representable in bf16 and fp16, so every dtype reads back the same floats.
  const std::vector<float> values = {1.0f,  -2.5f, 0.375f, 1024.0f, -0.0f,  3.0f, 0.5f, -0.125f,
                                     96.0f, 7.0f,  -1.0f,  0.25f,   255.0f, 2.0f, -8.0f};
  for (FloatType dtype : kAllFloatTypes) {
    SCOPED_TRACE(FloatTypeName(dtype));
    const HeadFile file = WriteHeadFile(absl::StrCat("head_", FloatTypeName(dtype), ".safetensors"),
                                        dtype, kVocab, kHidden, values);
    auto head = LoadSafetensorsHead("policy", file.path, "lm_head.weight");
    ASSERT_TRUE(head.ok()) << head.status();
    EXPECT_EQ((*head)->name, "policy");
    EXPECT_EQ((*head)->vocab_size, kVocab);
    EXPECT_EQ((*head)->hidden_size, kHidden);
    EXPECT_EQ((*head)->dtype, dtype);
    EXPECT_EQ((*head)->version, 1u);
    EXPECT_EQ((*head)->source, file.path + ":lm_head.weight");
    EXPECT_EQ((*head)->weight, file.weight_bytes);
    for (int64_t i = 0; i < kVocab * kHidden; ++i) {
      const float v = kernels::LoadAsFloat(dtype, (*head)->weight.data(), i);
      EXPECT_EQ(std::signbit(v), std::signbit(values[i])) << i;
      EXPECT_EQ(v, values[i]) << i;
    }
    // The same through the flag.
    auto flagged = ParseHeadFlag("policy=" + file.path + ":lm_head.weight");
    ASSERT_TRUE(flagged.ok()) << flagged.status();
    EXPECT_EQ((*flagged)->weight, file.weight_bytes);
    std::remove(file.path.c_str());
  }
}

TEST(SafetensorsHeadTest, WrongTensorNameListsAvailable) {
  const HeadFile file = WriteHeadFile("names.safetensors", FloatType::kFloat32, 2, 2, {1, 2, 3, 4});
  absl::Status s = LoadSafetensorsHead("h", file.path, "lm_head.weights").status();
  ExpectInvalid(s, "has no tensor \"lm_head.weights\"");
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("available: \"bias\", \"cube\", \"ids\", \"lm_head.weight\", \"no_rows\""));
  EXPECT_THAT(std::string(s.message()), HasSubstr("head \"h\""));
  std::remove(file.path.c_str());
}

TEST(SafetensorsHeadTest, RejectsWrongRankDTypeAndEmpty) {
  const HeadFile file =
      WriteHeadFile("shapes.safetensors", FloatType::kFloat32, 2, 2, {1, 2, 3, 4});
  ExpectInvalid(LoadSafetensorsHead("h", file.path, "bias").status(),
                "tensor has rank 1 (shape [2]); a head is a 2-D [vocab, hidden] matrix");
  ExpectInvalid(LoadSafetensorsHead("h", file.path, "cube").status(), "tensor has rank 3");
  ExpectInvalid(LoadSafetensorsHead("h", file.path, "ids").status(),
                "dtype I32 is not a head weight type (BF16, F16 or F32)");
  ExpectInvalid(LoadSafetensorsHead("h", file.path, "no_rows").status(),
                "vocab size 0 is outside [1, ");
  ExpectInvalid(LoadSafetensorsHead("bad name", file.path, "lm_head.weight").status(),
                "has character ' '");
  std::remove(file.path.c_str());
}

TEST(SafetensorsHeadTest, RejectsNonFiniteWeights) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (FloatType dtype : kAllFloatTypes) {
    SCOPED_TRACE(FloatTypeName(dtype));
    HeadFile file = WriteHeadFile("nan.safetensors", dtype, 3, 2, {0, 1, 2, 3, nan, 5});
    ExpectInvalid(LoadSafetensorsHead("h", file.path, "lm_head.weight").status(),
                  "weight [2, 0] is nan (must be finite)");
    std::remove(file.path.c_str());
    file = WriteHeadFile("inf.safetensors", dtype, 3, 2, {0, 1, 2, -inf, 4, 5});
    ExpectInvalid(LoadSafetensorsHead("h", file.path, "lm_head.weight").status(),
                  "weight [1, 1] is -inf");
    std::remove(file.path.c_str());
  }
}

TEST(SafetensorsHeadTest, FileErrorsKeepTheirCode) {
  absl::Status s = LoadSafetensorsHead("h", TempPath("missing.safetensors"), "w").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("missing.safetensors"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("head \"h\""));
}

TEST(HeadFlagTest, ParsesNameFileAndTensor) {
  auto spec = ParseHeadFileSpec("policy=/models/a.safetensors:lm_head.weight");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "policy");
  EXPECT_EQ(spec->path, "/models/a.safetensors");
  EXPECT_EQ(spec->tensor, "lm_head.weight");
  spec = ParseHeadFileSpec("r=C:/odd:dir/b.safetensors:w");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->path, "C:/odd:dir/b.safetensors");
  EXPECT_EQ(spec->tensor, "w");
}

TEST(HeadFlagTest, PreciseErrors) {
  const auto error = [](const std::string& flag) { return ParseHeadFileSpec(flag).status(); };
  ExpectInvalid(error("policy"), "missing '=' after the head name");
  ExpectInvalid(error("=a.safetensors:w"), "head name is empty");
  ExpectInvalid(error("p q=a.safetensors:w"), "has character ' '");
  ExpectInvalid(error("p=a.safetensors"), "missing ':TENSOR'");
  ExpectInvalid(error("p=:w"), "empty file path");
  ExpectInvalid(error("p=a.safetensors:"), "empty tensor name");
  EXPECT_THAT(std::string(error("p").message()),
              HasSubstr("(expected NAME=FILE.safetensors:TENSOR or NAME=DIR, a Hugging Face "
                        "model folder)"));
  EXPECT_EQ(ParseHeadFlag("p=" + TempPath("nope.safetensors") + ":w").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(HeadDTypeTest, Names) {
  EXPECT_EQ(FloatTypeName(FloatType::kFloat32), "fp32");
  EXPECT_EQ(FloatTypeName(FloatType::kBFloat16), "bf16");
  EXPECT_EQ(FloatTypeName(FloatType::kFloat16), "fp16");
}

}  // namespace
}  // namespace logitserve
