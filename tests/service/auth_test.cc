// Authorizer: the token rules of server/service/auth.h, checked on a real grpc::ServerContext
// whose client metadata is injected (grpc::testing::ServerContextTestSpouse), and the token files.
#include "server/service/auth.h"

#include <grpcpp/server_context.h>
#include <grpcpp/test/server_context_test_spouse.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace logitserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kUser[] = "user-secret-1";
constexpr char kAdmin[] = "admin-secret-2";

// Check() on a server context carrying `authorization: <header>` (no header when nullopt).
absl::Status CheckWith(const Authorizer& auth, std::optional<std::string> header, Role role) {
  grpc::ServerContext context;
  grpc::testing::ServerContextTestSpouse spouse(&context);
  if (header.has_value()) spouse.AddClientMetadata("authorization", *header);
  spouse.AddClientMetadata("x-other", "Bearer user-secret-1");  // never consulted
  return auth.Check(context, role);
}

TEST(AuthorizerTest, NoTokensConfiguredIsOpen) {
  const Authorizer auth("", "");
  EXPECT_FALSE(auth.enabled());
  for (const Role role : {Role::kUser, Role::kAdmin}) {
    EXPECT_TRUE(CheckWith(auth, std::nullopt, role).ok());
    EXPECT_TRUE(CheckWith(auth, "Bearer anything", role).ok());
    EXPECT_TRUE(CheckWith(auth, "garbage", role).ok());
  }
}

TEST(AuthorizerTest, UserRpcAcceptsUserAndAdminTokens) {
  const Authorizer auth(kUser, kAdmin);
  EXPECT_TRUE(auth.enabled());
  EXPECT_TRUE(CheckWith(auth, "Bearer user-secret-1", Role::kUser).ok());
  EXPECT_TRUE(CheckWith(auth, "Bearer admin-secret-2", Role::kUser).ok());
}

TEST(AuthorizerTest, AdminRpcNeedsAdminToken) {
  const Authorizer auth(kUser, kAdmin);
  EXPECT_TRUE(CheckWith(auth, "Bearer admin-secret-2", Role::kAdmin).ok());
  const absl::Status user = CheckWith(auth, "Bearer user-secret-1", Role::kAdmin);
  EXPECT_EQ(user.code(), absl::StatusCode::kPermissionDenied) << user;
  EXPECT_THAT(user.message(), HasSubstr("admin token"));
}

TEST(AuthorizerTest, MissingOrWrongTokenIsUnauthenticated) {
  const Authorizer auth(kUser, kAdmin);
  for (const Role role : {Role::kUser, Role::kAdmin}) {
    const absl::Status missing = CheckWith(auth, std::nullopt, role);
    EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated) << missing;
    EXPECT_THAT(missing.message(), HasSubstr("authorization"));
    for (const std::string header :
         {"Bearer wrong", "Bearer user-secret-", "Bearer user-secret-11", "Bearer USER-SECRET-1",
          "Bearer ", "Bearer", "", "user-secret-1", "Basic user-secret-1",
          "Bearer user-secret-1 admin-secret-2", "Bearerx user-secret-1"}) {
      const absl::Status s = CheckWith(auth, header, role);
      EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << "'" << header << "': " << s;
      // A rejection never echoes a configured token.
      EXPECT_THAT(s.message(), AllOf(Not(HasSubstr(kUser)), Not(HasSubstr(kAdmin))));
    }
  }
}

TEST(AuthorizerTest, BearerSchemeIsCaseInsensitiveAndSpacesAroundTokenAreIgnored) {
  // RFC 7235 section 2.1: the auth-scheme is case-insensitive; 1*SP separates it from the token.
  const Authorizer auth(kUser, kAdmin);
  for (const std::string header : {"bearer user-secret-1", "BEARER user-secret-1",
                                   "Bearer   user-secret-1", "Bearer user-secret-1  "}) {
    EXPECT_TRUE(CheckWith(auth, header, Role::kUser).ok()) << "'" << header << "'";
  }
}

TEST(AuthorizerTest, OnlyUserTokenDisablesAdminRpcs) {
  const Authorizer auth(kUser, "");
  EXPECT_TRUE(CheckWith(auth, "Bearer user-secret-1", Role::kUser).ok());
  const absl::Status admin = CheckWith(auth, "Bearer user-secret-1", Role::kAdmin);
  EXPECT_EQ(admin.code(), absl::StatusCode::kPermissionDenied) << admin;
  EXPECT_THAT(admin.message(), HasSubstr("--admin-token-file"));
  // Unauthenticated callers still learn nothing beyond UNAUTHENTICATED.
  EXPECT_EQ(CheckWith(auth, "Bearer nope", Role::kAdmin).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckWith(auth, std::nullopt, Role::kAdmin).code(), absl::StatusCode::kUnauthenticated);
}

TEST(AuthorizerTest, OnlyAdminTokenProtectsEveryRpc) {
  // A configured token means the server is not open: user RPCs need a token too (the admin one).
  const Authorizer auth("", kAdmin);
  EXPECT_EQ(CheckWith(auth, std::nullopt, Role::kUser).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(CheckWith(auth, "Bearer admin-secret-2", Role::kUser).ok());
  EXPECT_TRUE(CheckWith(auth, "Bearer admin-secret-2", Role::kAdmin).ok());
}

TEST(AuthorizerTest, CheckHeaderMatchesCheck) {
  const Authorizer auth(kUser, kAdmin);
  EXPECT_EQ(auth.CheckHeader(false, "", Role::kUser).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(auth.CheckHeader(true, "Bearer user-secret-1", Role::kUser).ok());
  EXPECT_EQ(auth.CheckHeader(true, "Bearer user-secret-1", Role::kAdmin).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "xbc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

class TokenFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::string& contents) {
    const std::string path =
        ::testing::TempDir() + "/auth_test_" + std::to_string(getpid()) + "_" + name;
    std::ofstream(path, std::ios::binary) << contents;
    written_.push_back(path);
    return path;
  }
  ~TokenFileTest() override {
    for (const std::string& p : written_) std::remove(p.c_str());
  }
  std::vector<std::string> written_;
};

TEST_F(TokenFileTest, TrimsSurroundingWhitespace) {
  absl::StatusOr<std::unique_ptr<Authorizer>> auth = Authorizer::FromFiles(
      Write("user", "  user-secret-1\n"), Write("admin", "\tadmin-secret-2\r\n\n"));
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE(CheckWith(**auth, "Bearer user-secret-1", Role::kUser).ok());
  EXPECT_TRUE(CheckWith(**auth, "Bearer admin-secret-2", Role::kAdmin).ok());
  EXPECT_EQ(CheckWith(**auth, "Bearer user-secret-1", Role::kAdmin).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(TokenFileTest, EmptyPathsMeanNoToken) {
  absl::StatusOr<std::unique_ptr<Authorizer>> auth = Authorizer::FromFiles("", "");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_FALSE((*auth)->enabled());

  absl::StatusOr<std::unique_ptr<Authorizer>> user_only =
      Authorizer::FromFiles(Write("u", "tok"), "");
  ASSERT_TRUE(user_only.ok()) << user_only.status();
  EXPECT_EQ(CheckWith(**user_only, "Bearer tok", Role::kAdmin).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(TokenFileTest, ErrorsNameTheFlagAndFile) {
  const std::string missing = ::testing::TempDir() + "/auth_test_no_such_file";
  absl::StatusOr<std::unique_ptr<Authorizer>> a = Authorizer::FromFiles(missing, "");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), AllOf(HasSubstr("--auth-token-file"), HasSubstr(missing)));

  a = Authorizer::FromFiles("", missing);
  EXPECT_THAT(a.status().message(), AllOf(HasSubstr("--admin-token-file"), HasSubstr(missing)));

  const std::string blank = Write("blank", " \n\t\n");
  a = Authorizer::FromFiles(blank, "");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(),
              AllOf(HasSubstr("--auth-token-file"), HasSubstr(blank), HasSubstr("no token")));

  const std::string two = Write("two", "tok1\ntok2\n");
  a = Authorizer::FromFiles("", two);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(),
              AllOf(HasSubstr("--admin-token-file"), HasSubstr(two), HasSubstr("one token")));

  a = Authorizer::FromFiles(Write("same1", "same\n"), Write("same2", "same"));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("same token"));
  EXPECT_THAT(a.status().message(), Not(HasSubstr("same\n")));
}

}  // namespace
}  // namespace logitserve
