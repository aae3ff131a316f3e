// Unit tests of the client's tensor builders and request splitting (no server).
#include "client/request_split.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "client/pipeline.h"
#include "client/shm.h"
#include "client/tensor.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "gtest/gtest.h"

namespace logitserve::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<float> Iota(int64_t n, float start = 0.0f) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(TensorTest, BuildersPackLittleEndianBytesAndShape) {
  const std::vector<float> f = {1.0f, -2.5f, 3.25f, 0.0f, 5.0f, 6.0f};
  const v1::Tensor t = TensorOf(f, {2, 3});
  EXPECT_EQ(t.dtype(), v1::DATA_TYPE_FLOAT32);
  EXPECT_THAT(t.shape(), ElementsAre(2, 3));
  ASSERT_EQ(t.data().size(), 24u);
  float back[6];
  std::memcpy(back, t.data().data(), 24);
  EXPECT_EQ(std::vector<float>(back, back + 6), f);
  EXPECT_TRUE(CheckTensor(t, "hidden").ok());

  const std::vector<int32_t> ids = {7, -100};
  EXPECT_EQ(TensorOf(ids, {2}).dtype(), v1::DATA_TYPE_INT32);
  EXPECT_EQ(*IntsOf(TensorOf(ids, {2})), (std::vector<int64_t>{7, -100}));
  const std::vector<int64_t> ids64 = {1, 2, 3};
  EXPECT_EQ(*IntsOf(TensorOf(ids64, {3})), ids64);
}

TEST(TensorTest, BFloat16RoundsToNearestEvenAndUpcastsExactly) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even gives 1.
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even gives 1 + 2^-6.
  const std::vector<float> f = {1.0f + 0x1.0p-8f, 1.0f + 3 * 0x1.0p-8f, -3.0f, 0.15625f};
  const v1::Tensor t = BFloat16TensorOf(f, {4});
  EXPECT_EQ(t.dtype(), v1::DATA_TYPE_BFLOAT16);
  EXPECT_EQ(t.data().size(), 8u);
  EXPECT_EQ(*FloatsOf(t), (std::vector<float>{1.0f, 1.0f + 0x1.0p-6f, -3.0f, 0.15625f}));
}

TEST(TensorTest, Float16BitsUpcastExactly) {
  const std::vector<uint16_t> bits = {0x3c00, 0xc000, 0x0001, 0x7c00};  // 1, -2, 2^-24, inf
  const std::vector<float> f = *FloatsOf(Float16TensorFromBits(bits, {2, 2}));
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 0x1.0p-24f);
  EXPECT_TRUE(std::isinf(f[3]));
}

TEST(TensorTest, CheckTensorNamesTheFieldAndTheProblem) {
  const std::vector<float> f = Iota(5);
  absl::Status s = CheckTensor(TensorOf(f, {2, 3}), "reference_hidden");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("reference_hidden"));
  EXPECT_THAT(s.message(), HasSubstr("[2, 3]"));
  EXPECT_FALSE(CheckTensor(TensorOf(f, {-1, 5}), "x").ok());
  EXPECT_FALSE(CheckTensor(v1::Tensor(), "x").ok());  // dtype unspecified
  EXPECT_FALSE(FloatsOf(TensorOf(std::vector<int32_t>{1}, {1})).ok());
  EXPECT_FALSE(IntsOf(TensorOf(std::vector<float>{1.0f}, {1})).ok());
}

TEST(TensorTest, SliceRowsCopiesWholeRows) {
  const std::vector<float> f = Iota(12);
  const v1::Tensor s = SliceRows(TensorOf(f, {4, 3}), 1, 3);
  EXPECT_THAT(s.shape(), ElementsAre(2, 3));
  EXPECT_EQ(*FloatsOf(s), (std::vector<float>{3, 4, 5, 6, 7, 8}));
  EXPECT_THAT(SliceRows(TensorOf(f, {4, 3}), 4, 4).shape(), ElementsAre(0, 3));
}

// A logits-mode request of `rows` rows of width 4 with [rows, 2] target ids.
v1::ScoreRequest Request(int64_t rows) {
  v1::ScoreRequest r;
  r.set_request_id("req");
  r.set_entropy(true);
  r.set_top_k(2);
  *r.mutable_logits() = TensorOf(Iota(rows * 4), {rows, 4});
  std::vector<int32_t> ids(rows * 2, 1);
  *r.mutable_target_ids() = TensorOf(ids, {rows, 2});
  return r;
}

std::vector<std::pair<int64_t, int64_t>> Rows(const std::vector<RowChunk>& chunks) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const RowChunk& c : chunks) out.emplace_back(c.row_begin, c.row_end);
  return out;
}

TEST(PlanChunksTest, NoSplitWithinLimits) {
  const auto plan = PlanChunks(Request(13), 13, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Rows(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 13}}));
  EXPECT_EQ(Rows(*PlanChunks(Request(13), 0, 0)).size(), 1u);  // no limit at all
  EXPECT_EQ(Rows(*PlanChunks(Request(0), 5, 0)).size(), 1u);   // empty request
}

TEST(PlanChunksTest, SplitsByRowLimit) {
  const auto plan = PlanChunks(Request(13), 5, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Rows(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 10}, {10, 13}}));
}

TEST(PlanChunksTest, SplitsByMessageBytes) {
  // A row is 4 floats of logits + 2 int32 ids = 24 bytes; room for 3 rows beyond the headroom.
  const auto plan = PlanChunks(Request(7), 0, kMessageHeadroomBytes + 3 * 24 + 5);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Rows(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 6}, {6, 7}}));
}

TEST(PlanChunksTest, KeepsSequencesWhole) {
  v1::ScoreRequest r = Request(13);
  for (int64_t len : {3, 2, 0, 4, 4}) r.add_sequence_lengths(len);
  const auto plan = PlanChunks(r, 5, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 3u);
  EXPECT_EQ(Rows(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 9}, {9, 13}}));
  EXPECT_EQ((*plan)[0].seq_begin, 0);
  EXPECT_EQ((*plan)[0].seq_end, 3);  // the empty sequence rides along with the first chunk
  EXPECT_EQ((*plan)[1].seq_begin, 3);
  EXPECT_EQ((*plan)[2].seq_end, 5);

  const v1::ScoreRequest c1 = MakeChunkRequest(r, v1::ScoreRequest(), (*plan)[1]);
  EXPECT_THAT(c1.sequence_lengths(), ElementsAre(4));
}

TEST(PlanChunksTest, RejectsASequenceLongerThanTheLimit) {
  v1::ScoreRequest r = Request(13);
  for (int64_t len : {3, 6, 4}) r.add_sequence_lengths(len);
  const auto plan = PlanChunks(r, 5, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("sequence 1 has 6 rows"));
}

TEST(PlanChunksTest, RejectsBadSequenceLengthsOnlyWhenSplitting) {
  v1::ScoreRequest r = Request(13);
  for (int64_t len : {3, 3}) r.add_sequence_lengths(len);
  EXPECT_TRUE(PlanChunks(r, 13, 0).ok());  // the server judges an unsplit request
  EXPECT_EQ(PlanChunks(r, 5, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlanChunksTest, RejectsInconsistentRowTensorsOnlyWhenSplitting) {
  v1::ScoreRequest r = Request(13);
  *r.mutable_target_ids() = TensorOf(std::vector<int32_t>(12, 0), {12});
  EXPECT_TRUE(PlanChunks(r, 13, 0).ok());
  const auto plan = PlanChunks(r, 5, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("target_ids"));
}

TEST(MakeChunkRequestTest, SlicesEveryRowTensorAndKeepsTheRest) {
  v1::ScoreRequest r = Request(6);
  *r.mutable_reference_logits() = TensorOf(Iota(24, 100.0f), {6, 4});
  v1::ScoreRequest without_rows = r;
  without_rows.clear_logits();
  without_rows.clear_reference_logits();
  without_rows.clear_target_ids();
  const v1::ScoreRequest c = MakeChunkRequest(r, without_rows, RowChunk{2, 4, 0, 0});
  EXPECT_EQ(c.request_id(), "req");
  EXPECT_TRUE(c.entropy());
  EXPECT_EQ(c.top_k(), 2u);
  EXPECT_FALSE(c.has_hidden());
  EXPECT_EQ(*FloatsOf(c.logits()), (std::vector<float>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ((*FloatsOf(c.reference_logits()))[0], 108.0f);
  EXPECT_THAT(c.target_ids().shape(), ElementsAre(2, 2));
}

// The chunks' template keeps every non-row field exactly (presence of optional fields and unknown
// fields included) and none of the row tensors or sequence lengths.
TEST(RequestWithoutRowsTest, KeepsEveryOtherFieldAndNoRowBytes) {
  v1::ScoreRequest r = Request(6);
  *r.mutable_hidden() = TensorOf(Iota(12), {6, 2});
  *r.mutable_reference_logits() = TensorOf(Iota(24, 100.0f), {6, 4});
  r.set_reference_head("ref");
  r.set_ignore_index(0);  // explicitly 0: presence must survive
  r.set_jsd_beta(0.0f);
  r.set_head_version(7);
  r.add_sequence_lengths(6);
  r.GetReflection()->MutableUnknownFields(&r)->AddVarint(999, 42);
  const v1::ScoreRequest w = RequestWithoutRows(r);
  EXPECT_FALSE(w.has_hidden());
  EXPECT_FALSE(w.has_logits());
  EXPECT_FALSE(w.has_reference_logits());
  EXPECT_FALSE(w.has_target_ids());
  EXPECT_EQ(w.sequence_lengths_size(), 0);
  EXPECT_EQ(w.request_id(), "req");
  EXPECT_EQ(w.reference_head(), "ref");
  EXPECT_TRUE(w.entropy());
  EXPECT_EQ(w.top_k(), 2u);
  ASSERT_TRUE(w.has_ignore_index());
  EXPECT_EQ(w.ignore_index(), 0);
  ASSERT_TRUE(w.has_jsd_beta());
  EXPECT_FALSE(w.has_temperature());
  EXPECT_EQ(w.head_version(), 7u);
  const google::protobuf::UnknownFieldSet& unknown = w.GetReflection()->GetUnknownFields(w);
  ASSERT_EQ(unknown.field_count(), 1);
  EXPECT_EQ(unknown.field(0).varint(), 42u);
  // The same as copying the request and clearing its rows.
  v1::ScoreRequest expected = r;
  expected.clear_hidden();
  expected.clear_logits();
  expected.clear_reference_hidden();
  expected.clear_reference_logits();
  expected.clear_target_ids();
  expected.clear_sequence_lengths();
  EXPECT_EQ(w.SerializeAsString(), expected.SerializeAsString());
}

// The unary Score's zero-copy body parses as the request itself: same fields, same bytes, nothing
// re-cut (an inconsistent request reaches the server as sent, so the server names its problem).
v1::ScoreRequest ParsedRequestBytes(const v1::ScoreRequest& r) {
  SliceLease lease;
  grpc::ByteBuffer body = RequestBytes(r, RequestWithoutRows(r), lease);
  v1::ScoreRequest parsed;
  EXPECT_TRUE(grpc::SerializationTraits<v1::ScoreRequest>::Deserialize(&body, &parsed).ok());
  return parsed;
}

TEST(RequestBytesTest, ParsesAsTheRequestItself) {
  v1::ScoreRequest r = Request(6);
  *r.mutable_hidden() = TensorOf(Iota(12), {6, 2});
  *r.mutable_reference_logits() = TensorOf(Iota(24, 100.0f), {6, 4});
  r.set_reference_head("ref");
  r.set_ignore_index(0);
  r.add_sequence_lengths(4);
  r.add_sequence_lengths(2);
  r.GetReflection()->MutableUnknownFields(&r)->AddVarint(999, 42);
  const v1::ScoreRequest parsed = ParsedRequestBytes(r);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, r));
  EXPECT_EQ(parsed.hidden().data(), r.hidden().data());
  EXPECT_EQ(parsed.reference_logits().data(), r.reference_logits().data());
}

// The body's data slices point at the request's own bytes and are counted by the lease until the
// last reference to them is gone (a copy of the buffer, as gRPC's transport keeps, included).
TEST(RequestBytesTest, TheLeaseCountsTheSlicesOverTheRequestUntilReleased) {
  v1::ScoreRequest r = Request(6);
  *r.mutable_hidden() = TensorOf(Iota(12), {6, 2});
  *r.mutable_reference_logits() = TensorOf(Iota(24, 100.0f), {6, 4});
  SliceLease lease;
  std::optional<grpc::ByteBuffer> kept;
  {
    grpc::ByteBuffer body = RequestBytes(r, RequestWithoutRows(r), lease);
    EXPECT_EQ(lease.held(), 4);  // hidden, logits, reference_logits, target_ids
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(body.Dump(&slices).ok());
    int in_place = 0;
    for (const grpc::Slice& slice : slices) {
      const auto* p = reinterpret_cast<const char*>(slice.begin());
      // Tensor.data() is the field (a string); its .data() the bytes' address.
      in_place += (p == r.hidden().data().data() || p == r.reference_logits().data().data());
    }
    EXPECT_EQ(in_place, 2);
    kept.emplace(body);  // another holder of the same slices
  }
  EXPECT_EQ(lease.held(), 4);
  kept.reset();
  EXPECT_EQ(lease.held(), 0);
  lease.WaitReleased();  // returns at once
}

TEST(RequestBytesTest, KeepsInconsistentAndSharedMemoryTensorsAsSent) {
  v1::ScoreRequest r = Request(6);
  *r.mutable_hidden() = TensorOf(Iota(5), {6, 2});  // 5 values for a [6, 2] shape
  *r.mutable_target_ids() = TensorOf(std::vector<int32_t>{1, 2, 3}, {3});  // 3 rows, not 6
  *r.mutable_reference_hidden() = SharedMemoryTensor("region", 64, v1::DATA_TYPE_BFLOAT16, {6, 2});
  v1::Tensor* empty = r.mutable_logits();  // present, holding nothing
  empty->set_dtype(v1::DATA_TYPE_FLOAT32);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ParsedRequestBytes(r), r));
  v1::ScoreRequest no_rows = Request(0);
  no_rows.clear_target_ids();
  EXPECT_TRUE(
      google::protobuf::util::MessageDifferencer::Equals(ParsedRequestBytes(no_rows), no_rows));
}

TEST(AppendChunkResponseTest, ConcatenatesInRowOrderAndSumsTimings) {
  ScoreOutput out;
  v1::ScoreResponse a;
  a.set_request_id("req");
  a.set_target_ids_per_row(1);
  for (float v : {-1.0f, -2.0f}) a.add_target_logprobs(v);
  for (float v : {0.5f, 0.25f}) a.add_entropy(v);
  a.mutable_sequence_sums()->add_entropy(0.75f);
  a.mutable_sequence_sums()->add_token_count(2);
  a.set_queue_us(3);
  a.set_compute_us(10);
  v1::ScoreResponse b = a;
  b.set_target_logprobs(0, -3.0f);
  ASSERT_TRUE(AppendChunkResponse(a, RowChunk{0, 2, 0, 1}, out).ok());
  ASSERT_TRUE(AppendChunkResponse(b, RowChunk{2, 4, 1, 2}, out).ok());
  EXPECT_EQ(out.rows, 4);
  EXPECT_EQ(out.chunks, 2);
  EXPECT_EQ(out.target_logprobs, (std::vector<float>{-1, -2, -3, -2}));
  EXPECT_EQ(out.entropy.size(), 4u);
  ASSERT_TRUE(out.sequence_sums.has_value());
  EXPECT_EQ(out.sequence_sums->token_count, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(out.queue_us, 6);
  EXPECT_EQ(out.compute_us, 20);

  v1::ScoreResponse bad = a;
  bad.add_entropy(1.0f);  // 3 values for 2 rows
  EXPECT_EQ(AppendChunkResponse(bad, RowChunk{4, 6, 0, 0}, out).code(),
            absl::StatusCode::kInternal);
}

TEST(RebaseRowNumbersTest, NamesTheRowsOfTheWholeRequest) {
  EXPECT_EQ(RebaseRowNumbers("hidden: row 3 contains NaN (column 5)", 60),
            "hidden: row 63 contains NaN (column 5)");
  EXPECT_EQ(RebaseRowNumbers("target_ids: row 0, column 1: id 9 is outside; row 12", 7),
            "target_ids: row 7, column 1: id 9 is outside; row 19");
  // Not a row number: "rows", "arrow 5", "row x", a trailing "row".
  EXPECT_EQ(RebaseRowNumbers("hidden: 300 rows exceed, arrow 5, row x, row", 10),
            "hidden: 300 rows exceed, arrow 5, row x, row");
  EXPECT_EQ(RebaseRowNumbers("", 4), "");
}

}  // namespace
}  // namespace logitserve::client
