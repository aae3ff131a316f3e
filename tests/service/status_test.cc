#include "server/service/status.h"

#include <string>

#include "gtest/gtest.h"
#include "server/service/client_text.h"

namespace logitserve {
namespace {

TEST(StatusTest, OkIsOk) { EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok()); }

TEST(StatusTest, EveryCodeMapsToTheSameCodeWithTheSameMessage) {
  // absl and gRPC both number their codes after google.rpc.Code.
  for (int code = 1; code <= 16; ++code) {
    const absl::Status s(static_cast<absl::StatusCode>(code), "hidden: row 3 is bad");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(g.error_message(), "hidden: row 3 is bad");
  }
}

TEST(StatusTest, UnknownCodeBecomesUnknown) {
  const absl::Status s(static_cast<absl::StatusCode>(99), "odd");
  EXPECT_EQ(ToGrpcStatus(s).error_code(), grpc::StatusCode::UNKNOWN);
}

}  // namespace
}  // namespace logitserve

namespace logitserve {
namespace {

TEST(StatusTest, LongMessagesAreCappedUnderTheClientsMetadataLimit) {
  const std::string long_message(100000, 'm');
  const grpc::Status g = ToGrpcStatus(absl::InvalidArgumentError(long_message));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(g.error_message().size(), kMaxStatusMessageBytes);
  EXPECT_EQ(g.error_message().substr(0, 10), "mmmmmmmmmm");
  EXPECT_EQ(g.error_message().substr(g.error_message().size() - 14), "...(truncated)");
}

TEST(ClientTextTest, QuotesAPrefixWithTheLengthAndNeverSplitsUtf8) {
  EXPECT_EQ(QuoteClientText("policy"), "policy");
  const std::string name(kMaxQuotedClientBytes - 1, 'a');
  // A two-byte UTF-8 character straddling the cut is left out whole.
  const std::string quoted = QuoteClientText(name + "\xc3\xa9" + std::string(100, 'b'));
  EXPECT_EQ(quoted, name + "...(" + std::to_string(name.size() + 2 + 100) + " bytes)");
}

TEST(ClientTextTest, ShapesShowTheirFirstDimensionsAndRank) {
  google::protobuf::RepeatedField<int64_t> shape;
  for (int i = 0; i < 3; ++i) shape.Add(i + 1);
  EXPECT_EQ(ShapePrefix(shape), "[1, 2, 3]");
  for (int i = 3; i < 10000; ++i) shape.Add(7);
  EXPECT_EQ(ShapePrefix(shape), "[1, 2, 3, 7, 7, 7, 7, 7, ...(10000 dims)]");
}

}  // namespace
}  // namespace logitserve
