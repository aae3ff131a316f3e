// ParseScoreRequest / ParseScoreStreamRequest (server/service/request_parse.h): the message
// parsed from any cut of its bytes into slices equals protobuf's own parse of the whole (the
// reference), each tensor's bytes are allocated once at their size (capacity == size, no growth
// by doubling), and bytes that are not a message are refused.
#include "server/service/request_parse.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve {
namespace {

// `bytes` as a ByteBuffer of slices of `slice` bytes (the last one shorter).
grpc::ByteBuffer Sliced(const std::string& bytes, size_t slice) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice) {
    slices.emplace_back(bytes.data() + at, std::min(slice, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back(grpc::Slice());  // an empty message: one empty slice
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Allocated once at its size: capacity == size (strings within the small-string buffer aside).
bool AllocatedOnce(const std::string& s) { return s.size() <= 15 || s.capacity() == s.size(); }

std::string Pattern(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
}

v1::ScoreRequest Request(size_t hidden_bytes) {
  v1::ScoreRequest r;
  r.set_request_id("r-1");
  r.set_head("policy");
  r.mutable_hidden()->set_dtype(v1::DataType::DATA_TYPE_BFLOAT16);
  r.mutable_hidden()->add_shape(static_cast<int64_t>(hidden_bytes / 64));
  r.mutable_hidden()->add_shape(32);
  r.mutable_hidden()->set_data(Pattern(hidden_bytes, 1));
  r.mutable_reference_logits()->set_data(Pattern(hidden_bytes / 3 + 5, 2));
  r.mutable_target_ids()->set_data(Pattern(4 * (hidden_bytes / 64), 3));
  r.set_top_k(5);
  r.set_entropy(true);
  r.set_jsd_beta(0.25f);
  r.add_sequence_lengths(3);
  r.add_sequence_lengths(4);
  return r;
}

TEST(RequestParse, AnySlicingParsesAsProtobufDoesWithTensorsAllocatedOnce) {
  // 50 MB is protobuf's own reserve cap: one tensor above it.
  for (size_t hidden : {size_t{0}, size_t{4096}, size_t{(4 << 20) + 64}, size_t{52'000'000}}) {
    const v1::ScoreRequest want = Request(hidden);
    const std::string bytes = want.SerializeAsString();
    for (size_t slice : {size_t{1} << 20, size_t{16384}, size_t{7}}) {
      if (slice == 7 && hidden > 4096) continue;  // millions of slices: slow, nothing new
      SCOPED_TRACE(std::to_string(hidden) + " bytes of hidden states, slices of " +
                   std::to_string(slice));
      v1::ScoreRequest got;
      ASSERT_TRUE(ParseScoreRequest(Sliced(bytes, slice), &got));
      EXPECT_EQ(got.SerializeAsString(), bytes);
      EXPECT_EQ(got.has_hidden(), want.has_hidden());
      EXPECT_FALSE(got.has_logits());  // absent tensors stay absent
      EXPECT_FALSE(got.has_reference_hidden());
      EXPECT_TRUE(AllocatedOnce(got.hidden().data()));
      EXPECT_TRUE(AllocatedOnce(got.reference_logits().data()));
      EXPECT_TRUE(AllocatedOnce(got.target_ids().data()));

      v1::ScoreStreamRequest stream_want;
      *stream_want.mutable_request() = want;
      v1::ScoreStreamRequest stream_got;
      ASSERT_TRUE(
          ParseScoreStreamRequest(Sliced(stream_want.SerializeAsString(), slice), &stream_got));
      EXPECT_EQ(stream_got.SerializeAsString(), stream_want.SerializeAsString());
      EXPECT_TRUE(AllocatedOnce(stream_got.request().hidden().data()));
    }
  }
}

TEST(RequestParse, RefusesWhatIsNotAMessage) {
  // Field 2 (head), length-delimited, claiming 100 bytes of which 3 follow.
  const std::string truncated = std::string("\x12\x64") + "abc";
  v1::ScoreRequest r;
  EXPECT_FALSE(ParseScoreRequest(Sliced(truncated, 2), &r));
  // A tensor whose data field claims more bytes than the tensor holds.
  const std::string bad_tensor = std::string("\x1a\x03\x1a\x10x", 5);
  v1::ScoreRequest t;
  EXPECT_FALSE(ParseScoreRequest(Sliced(bad_tensor, 1), &t));
  // Wire type 7 does not exist.
  v1::ScoreStreamRequest s;
  EXPECT_FALSE(ParseScoreStreamRequest(Sliced(std::string("\x0f\x00", 2), 1), &s));
  // A buffer without a message is refused; no bytes are the empty message.
  v1::ScoreRequest none;
  EXPECT_FALSE(ParseScoreRequest(grpc::ByteBuffer(), &none));
  v1::ScoreRequest empty;
  EXPECT_TRUE(ParseScoreRequest(Sliced("", 1), &empty));
  EXPECT_EQ(empty.ByteSizeLong(), 0u);
}

}  // namespace
}  // namespace logitserve
