// Safetensors reader/writer: round trips for every dtype, and one test per way a file can be
// malformed, each checking the error code and that the message names the problem.
#include "common/safetensors/safetensors.h"

#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors/float_type.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/safetensors_test_", ::getpid(), "_", name);
}

// A raw file: 8-byte little-endian header length, header text, `data_bytes` bytes of data.
std::vector<uint8_t> Raw(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + data_bytes);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  for (const char c : header) out.push_back(static_cast<uint8_t>(c));
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<uint8_t>(i * 7 + 1));
  return out;
}

void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

// Parses in memory and expects InvalidArgument whose message contains `problem` and the source.
void ExpectInvalid(const std::vector<uint8_t>& bytes, const std::string& problem) {
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(bytes, "test.safetensors");
  ASSERT_FALSE(view.ok()) << "parsed a malformed file; expected: " << problem;
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << view.status();
  EXPECT_THAT(std::string(view.status().message()), HasSubstr(problem));
  EXPECT_THAT(std::string(view.status().message()), HasSubstr("test.safetensors"));
}

std::vector<uint8_t> Pattern(size_t n, uint8_t salt) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + salt);
  return v;
}

TEST(SafetensorsTest, RoundTripEveryDType) {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<SafetensorsTensorToWrite> tensors;
  uint8_t salt = 0;
  for (SafetensorsDType dtype : kAllSafetensorsDTypes) {
    const std::vector<int64_t> shape = {2, 3};
    storage.push_back(Pattern(6 * SafetensorsDTypeSize(dtype), ++salt));
    tensors.push_back({absl::StrCat("t_", SafetensorsDTypeName(dtype)), dtype, shape, {}});
  }
  storage.push_back(Pattern(8, ++salt));  // a scalar F64
  tensors.push_back({"scalar", SafetensorsDType::kFloat64, {}, {}});
  storage.push_back({});  // an empty [0, 5] F32
  tensors.push_back({"empty", SafetensorsDType::kFloat32, {0, 5}, {}});
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = storage[i];
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "héllo"}};

  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->path(), path);
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensor_names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(tensors[i].name);
    const SafetensorsTensor* t = file->Find(tensors[i].name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, tensors[i].dtype);
    EXPECT_EQ(t->shape, tensors[i].shape);
    ASSERT_EQ(t->bytes, storage[i].size());
    if (t->bytes > 0) {  // memcmp on an empty vector's null data() is undefined
      EXPECT_EQ(std::memcmp(t->data, storage[i].data(), t->bytes), 0);
    }
  }
  EXPECT_EQ(file->Find("scalar")->num_elements(), 1);
  EXPECT_EQ(file->Find("empty")->num_elements(), 0);

  // The file and the in-memory serialisation are the same bytes.
  absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors(tensors, metadata);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(bytes->size(), file->size());
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> on_disk((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
  EXPECT_EQ(on_disk, *bytes);
  // The data buffer starts 8-byte aligned (header padded with spaces).
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | (*bytes)[i];
  EXPECT_EQ((8 + n) % 8, 0u);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, DTypeNamesRoundTrip) {
  for (SafetensorsDType dtype : kAllSafetensorsDTypes) {
    EXPECT_EQ(SafetensorsDTypeFromName(SafetensorsDTypeName(dtype)), dtype);
    EXPECT_GE(SafetensorsDTypeSize(dtype), 1);
  }
  EXPECT_EQ(SafetensorsDTypeFromName("bf16"), std::nullopt);  // names are case-sensitive
  EXPECT_EQ(SafetensorsDTypeSize(SafetensorsDType::kBFloat16), 2);
  EXPECT_EQ(SafetensorsDTypeSize(SafetensorsDType::kComplex64), 8);
}

// Only F32, BF16 and F16 hold the kernels' float types, each one of them.
TEST(SafetensorsTest, FloatTypeMapping) {
  for (SafetensorsDType dtype : kAllSafetensorsDTypes) {
    const std::optional<kernels::FloatType> t = FloatTypeFromSafetensors(dtype);
    const bool is_float = dtype == SafetensorsDType::kFloat32 ||
                          dtype == SafetensorsDType::kBFloat16 ||
                          dtype == SafetensorsDType::kFloat16;
    EXPECT_EQ(t.has_value(), is_float) << SafetensorsDTypeName(dtype);
    if (t.has_value()) {
      EXPECT_EQ(SafetensorsDTypeFromFloatType(*t), dtype);
    }
  }
  EXPECT_EQ(FloatTypeFromSafetensors(SafetensorsDType::kBFloat16), kernels::FloatType::kBFloat16);
  EXPECT_EQ(SafetensorsDTypeFromFloatType(kernels::FloatType::kFloat16),
            SafetensorsDType::kFloat16);
}

// The exact bytes the reference Python implementation writes for {"a": float32 [1, 2]}: its key
// order inside an entry, and its space padding.
TEST(SafetensorsTest, ReadsReferenceLayout) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::vector<uint8_t> bytes = Raw(header + std::string(8 - (8 + header.size()) % 8, ' '), 0);
  const float values[2] = {1.0f, 2.0f};
  bytes.insert(bytes.end(), reinterpret_cast<const uint8_t*>(values),
               reinterpret_cast<const uint8_t*>(values) + 8);
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(bytes);
  ASSERT_TRUE(view.ok()) << view.status();
  const SafetensorsTensor* a = view->Find("a");
  ASSERT_NE(a, nullptr);
  float read[2];
  std::memcpy(read, a->data, 8);
  EXPECT_EQ(read[0], 1.0f);
  EXPECT_EQ(read[1], 2.0f);
  EXPECT_TRUE(view->metadata().empty());
}

TEST(SafetensorsTest, NoTensors) {
  absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors({});
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(*bytes);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->num_tensors(), 0u);
  EXPECT_TRUE(ParseSafetensors(Raw(R"({"__metadata__":null})", 0)).ok());
}

TEST(SafetensorsTest, GetMissingTensorListsNames) {
  const std::vector<uint8_t> bytes =
      Raw(R"({"lm_head.weight":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
          R"("model.norm":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
          3);
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(bytes, "m.safetensors");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->Find("nope"), nullptr);
  absl::StatusOr<const SafetensorsTensor*> t = view->Get("nope");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("m.safetensors has no tensor \"nope\""));
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("\"lm_head.weight\", \"model.norm\""));
  EXPECT_EQ(view->tensor_names(), (std::vector<std::string>{"lm_head.weight", "model.norm"}));
}

// ---- malformed files -------------------------------------------------------------------------

TEST(SafetensorsMalformedTest, TruncatedFile) {
  ExpectInvalid({1, 0, 0, 0, 0}, "truncated: 5 bytes");
  ExpectInvalid({}, "truncated: 0 bytes");
}

TEST(SafetensorsMalformedTest, TruncatedAtEveryLength) {
  std::vector<uint8_t> data = Pattern(24, 3);
  const SafetensorsTensorToWrite tensors[] = {
      {"a", SafetensorsDType::kFloat32, {2, 2}, absl::MakeConstSpan(data).subspan(0, 16)},
      {"b", SafetensorsDType::kInt64, {1}, absl::MakeConstSpan(data).subspan(16, 8)}};
  absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors(tensors);
  ASSERT_TRUE(bytes.ok());
  ASSERT_TRUE(ParseSafetensors(*bytes).ok());
  // Every proper prefix of a valid file is rejected: no cut leaves a file that parses.
  for (size_t n = 0; n < bytes->size(); ++n) {
    absl::StatusOr<SafetensorsView> view =
        ParseSafetensors(absl::MakeConstSpan(bytes->data(), n), "cut");
    ASSERT_FALSE(view.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(SafetensorsMalformedTest, HeaderLengthTooBig) {
  std::vector<uint8_t> bytes = Raw("{}", 0);
  const uint64_t n = 200'000'000;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  ExpectInvalid(bytes, "header length 200000000 is too large");
  for (int i = 0; i < 8; ++i) bytes[i] = 0xff;
  ExpectInvalid(bytes, "is too large");
}

TEST(SafetensorsMalformedTest, HeaderLengthPastEndOfFile) {
  std::vector<uint8_t> bytes = Raw("{}", 0);
  bytes[0] = 100;
  ExpectInvalid(bytes, "header length 100 runs past the end of the file (10 bytes");
}

TEST(SafetensorsMalformedTest, BadJson) {
  ExpectInvalid(Raw(R"({"a": {"dtype": )", 0), "header is not valid JSON");
  ExpectInvalid(Raw(R"({"a": 1} trailing)", 0), "header is not valid JSON");
  ExpectInvalid(Raw("{\"\xff\": 1}", 0), "header is not valid JSON");  // not UTF-8
}

TEST(SafetensorsMalformedTest, HeaderNotAnObject) {
  ExpectInvalid(Raw("[1, 2]", 0), "header does not start with '{'");
  ExpectInvalid(Raw("", 0), "header does not start with '{'");
  ExpectInvalid(Raw(R"({"a": [1, 2]})", 0), "tensor \"a\": entry must be an object, not array");
}

TEST(SafetensorsMalformedTest, HeaderNestedTooDeep) {
  ExpectInvalid(Raw(R"({"a": {"shape": [[1]]}})", 0), "nests deeper");
  ExpectInvalid(Raw("{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}", 0),
                "nests deeper");
}

TEST(SafetensorsMalformedTest, MissingDtype) {
  ExpectInvalid(Raw(R"({"a": {"shape": [1], "data_offsets": [0, 4]}})", 4),
                "tensor \"a\": missing \"dtype\"");
}

TEST(SafetensorsMalformedTest, MissingShapeOrOffsets) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
                "tensor \"a\": missing \"shape\"");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1]}})", 4),
                "tensor \"a\": missing \"data_offsets\"");
}

TEST(SafetensorsMalformedTest, IllTypedKeys) {
  ExpectInvalid(Raw(R"({"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}})", 4),
                "\"dtype\" must be a string, not an unsigned integer");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})", 4),
                "\"shape\" must be an array");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 4),
                "\"data_offsets\" must be an array [begin, end]");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})", 4),
                "data_offsets end must be a non-negative integer, not string");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
                "dimension 0 must be a non-negative integer, not a non-integer number");
}

TEST(SafetensorsMalformedTest, UnexpectedKey) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}})", 4),
                "tensor \"a\": unexpected key \"x\"");
}

TEST(SafetensorsMalformedTest, BadDtype) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}})", 4),
                "tensor \"a\": unknown dtype \"Q7\"");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})", 1),
                "unsupported sub-byte dtype \"F4\"");
}

TEST(SafetensorsMalformedTest, NegativeDim) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]}})", 4),
                "tensor \"a\": dimension 1 is negative (-1)");
}

TEST(SafetensorsMalformedTest, ShapeOverflow) {
  ExpectInvalid(
      Raw(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}})",
          4),
      "overflows 64-bit sizes");
  ExpectInvalid(
      Raw(R"({"a": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 4]}})", 4),
      "overflows 64-bit sizes");
  ExpectInvalid(
      Raw(R"({"a": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 4]}})", 4),
      "dimension 0 18446744073709551615 is too large");
}

TEST(SafetensorsMalformedTest, SizeMismatch) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8),
                "size mismatch: data_offsets [0, 8] span 8 bytes but shape [3] of F32 needs 12");
}

TEST(SafetensorsMalformedTest, OffsetsOutOfRange) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8),
                "data_offsets [0, 16] out of range: the data buffer is 8 bytes");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
                "data_offsets [8, 4] end before they begin");
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8),
                "data_offsets begin is negative");
}

TEST(SafetensorsMalformedTest, OverlappingTensors) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                    R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                    12),
                "tensors \"a\" [0, 8) and \"b\" [4, 12) overlap");
  // Aliasing (the same bytes twice) is an overlap too.
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                    R"( "b": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})",
                    8),
                "overlap");
}

TEST(SafetensorsMalformedTest, HoleBetweenTensors) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                    R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                    12),
                "hole of 4 unused bytes in the data buffer before tensor \"b\" at offset 8");
}

TEST(SafetensorsMalformedTest, TrailingBytes) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6),
                "data buffer is 6 bytes but the tensors cover only 4 (2 trailing bytes)");
}

TEST(SafetensorsMalformedTest, DuplicateTensorName) {
  ExpectInvalid(Raw(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                    R"( "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                    8),
                "header names \"a\" twice");
}

TEST(SafetensorsMalformedTest, BadMetadata) {
  ExpectInvalid(Raw(R"({"__metadata__": {"k": 1}})", 0),
                "\"__metadata__\" value for \"k\" must be a string, not an unsigned integer");
  ExpectInvalid(Raw(R"({"__metadata__": "x"})", 0), "\"__metadata__\" must be an object");
}

TEST(SafetensorsMalformedTest, HostileNamesAreEscapedInMessages) {
  const std::string name = "a\\u0001" + std::string(200, 'z');
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(
      Raw(R"({")" + name + R"(": {"dtype": "Q", "shape": [], "data_offsets": [0, 0]}})", 0));
  ASSERT_FALSE(view.ok());
  const std::string message(view.status().message());
  EXPECT_THAT(message, HasSubstr("\"a\\x01zzz"));
  EXPECT_THAT(message, HasSubstr("...\""));
  EXPECT_LT(message.size(), 200u);
}

// ---- files on disk ---------------------------------------------------------------------------

TEST(SafetensorsFileTest, MalformedFileErrorNamesThePath) {
  const std::string path = TempPath("bad.safetensors");
  WriteBytes(path, Raw(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4));
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("out of range"));
  std::remove(path.c_str());
}

TEST(SafetensorsFileTest, ShortAndEmptyFiles) {
  const std::string path = TempPath("short.safetensors");
  for (size_t n : {0, 3}) {
    WriteBytes(path, std::vector<uint8_t>(n, 0));
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(file.status().message()), HasSubstr(absl::StrCat("truncated: ", n)));
  }
  std::remove(path.c_str());
}

TEST(SafetensorsFileTest, MissingFileAndDirectory) {
  absl::StatusOr<SafetensorsFile> missing = SafetensorsFile::Open(TempPath("does_not_exist"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("does_not_exist"));

  absl::StatusOr<SafetensorsFile> dir = SafetensorsFile::Open(::testing::TempDir());
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dir.status().message()), HasSubstr("not a regular file"));
}

TEST(SafetensorsFileTest, MovedFileKeepsTheMapping) {
  const std::string path = TempPath("move.safetensors");
  const std::vector<uint8_t> data = Pattern(12, 9);
  const SafetensorsTensorToWrite t[] = {{"w", SafetensorsDType::kInt32, {3}, data}};
  ASSERT_TRUE(WriteSafetensors(path, t).ok());
  absl::StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok());
  SafetensorsFile file = *std::move(opened);
  SafetensorsFile other = std::move(file);
  const SafetensorsTensor* w = other.Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(std::memcmp(w->data, data.data(), 12), 0);
  std::remove(path.c_str());
}

// ---- writer errors ---------------------------------------------------------------------------

TEST(SafetensorsWriterTest, RejectsInconsistentTensors) {
  const std::vector<uint8_t> four(4);
  const auto error = [](std::vector<SafetensorsTensorToWrite> tensors) {
    absl::StatusOr<std::vector<uint8_t>> bytes = SerializeSafetensors(tensors);
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(bytes.status().message());
  };
  EXPECT_THAT(error({{"a", SafetensorsDType::kFloat32, {2}, four}}),
              HasSubstr("does not match the 4 data bytes"));
  EXPECT_THAT(error({{"a", SafetensorsDType::kFloat32, {-1}, four}}),
              HasSubstr("negative dimension"));
  EXPECT_THAT(error({{"a", SafetensorsDType::kFloat32, {1}, four},
                     {"a", SafetensorsDType::kFloat32, {1}, four}}),
              HasSubstr("duplicate name"));
  EXPECT_THAT(error({{"__metadata__", SafetensorsDType::kFloat32, {1}, four}}),
              HasSubstr("reserved"));
  EXPECT_THAT(error({{"\xff", SafetensorsDType::kFloat32, {1}, four}}), HasSubstr("UTF-8"));
}

TEST(SafetensorsWriterTest, UnwritablePathLeavesNoFile) {
  const std::vector<uint8_t> four(4);
  const SafetensorsTensorToWrite t[] = {{"a", SafetensorsDType::kFloat32, {1}, four}};
  absl::Status s = WriteSafetensors(TempPath("no_such_dir/x.safetensors"), t);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no_such_dir"));
}

}  // namespace
}  // namespace logitserve
