#include "server/service/status.h"

#include "gtest/gtest.h"

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
