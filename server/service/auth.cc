#include "server/service/auth.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/read_file.h"
#include "common/base/status_macros.h"
#include "grpcpp/security/server_credentials.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

// Reads the token in `path` for `flag`; "" for an empty path.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view flag) {
  if (path.empty()) return std::string();
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  const std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' holds no token"));
  }
  for (const char c : token) {
    // A bearer token is one header word (RFC 6750 b64token); whitespace inside means the file
    // holds something else (two tokens, a config file) and would never match a client's header.
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || absl::ascii_iscntrl(c)) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": '", path, "' must hold one token (whitespace or control characters inside)"));
    }
  }
  return token;
}

constexpr absl::string_view kMetadataKey = "authorization";

// The whole of `path` for `flag`.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view flag) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  return contents;
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM text, or nullptr. Clears OpenSSL's error queue either way (the
// queue is per thread; leftovers would confuse later TLS calls on this thread).
X509Ptr FirstCertificate(const std::string& pem) {
  BioPtr bio = MemoryBio(pem);
  X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  ERR_clear_error();
  return cert;
}

// An ASN.1 time as OpenSSL prints it ("Jan  1 00:00:00 2026 GMT").
std::string TimeText(const ASN1_TIME* t) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// An expired (or not yet valid) server certificate still starts the server: the operator may be
// rotating it, and a renewed file only takes effect on restart. But every TLS client will refuse
// the handshake, so say so loudly at start-up rather than leave it to the clients' errors.
void WarnIfNotValidNow(const X509& cert, const std::string& cert_file) {
  const ASN1_TIME* not_after = X509_get0_notAfter(&cert);
  const ASN1_TIME* not_before = X509_get0_notBefore(&cert);
  if (X509_cmp_current_time(not_after) < 0) {
    spdlog::warn("--tls-cert: '{}' expired on {}; TLS clients will refuse to connect", cert_file,
                 TimeText(not_after));
  } else if (X509_cmp_current_time(not_before) > 0) {
    spdlog::warn("--tls-cert: '{}' is not valid before {}; TLS clients will refuse to connect",
                 cert_file, TimeText(not_before));
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file) {
  if (cert_file.empty() && key_file.empty()) {
    if (!client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS plus client "
          "certificates)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key must be given together (or neither, for plaintext)");
  }
  LOGITSERVE_ASSIGN_OR_RETURN(std::string cert, ReadPemFile(cert_file, "--tls-cert"));
  LOGITSERVE_ASSIGN_OR_RETURN(std::string key, ReadPemFile(key_file, "--tls-key"));

  X509Ptr x509 = FirstCertificate(cert);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: '", cert_file, "' holds no PEM certificate"));
  }
  PkeyPtr pkey;
  {
    BioPtr bio = MemoryBio(key);
    pkey.reset(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr);
    ERR_clear_error();
  }
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: '", key_file, "' holds no (unencrypted) PEM private key"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key: '", key_file,
                                                   "' does not match the certificate in '",
                                                   cert_file, "' (--tls-cert)"));
  }

  WarnIfNotValidNow(*x509, cert_file);

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (!client_ca_file.empty()) {
    LOGITSERVE_ASSIGN_OR_RETURN(std::string ca, ReadPemFile(client_ca_file, "--tls-client-ca"));
    if (FirstCertificate(ca) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-client-ca: '", client_ca_file, "' holds no PEM certificate"));
    }
    options.pem_root_certs = std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  options.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  return grpc::SslServerCredentials(options);
}

namespace {

class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenAuthProcessor(const Authorizer* authorizer) : authorizer_(authorizer) {}

  // A few string compares: cheap enough for gRPC's own thread.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* /*context*/,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    constexpr absl::string_view kScorer = "/logitserve.v1.Scorer/";
    const auto path = metadata.find(":path");
    const absl::string_view method =
        path == metadata.end() ? absl::string_view()
                               : absl::string_view(path->second.data(), path->second.size());
    if (!absl::StartsWith(method, kScorer)) return grpc::Status::OK;  // health, reflection
    const Role role = method == "/logitserve.v1.Scorer/LoadHead" ? Role::kAdmin : Role::kUser;
    const auto it = metadata.find(grpc::string_ref(kMetadataKey.data(), kMetadataKey.size()));
    const absl::Status s =
        it == metadata.end()
            ? authorizer_->CheckHeader(false, {}, role)
            : authorizer_->CheckHeader(
                  true, absl::string_view(it->second.data(), it->second.size()), role);
    return ToGrpcStatus(s);
  }

 private:
  const Authorizer* const authorizer_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> MakeTokenAuthProcessor(const Authorizer* authorizer) {
  return std::make_shared<TokenAuthProcessor>(authorizer);
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Length is not secret (and cannot be hidden cheaply); the loop visits every byte of `a`
  // whatever the contents, accumulating differences without branching.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  // volatile read keeps the compiler from turning the loop into an early-exit memcmp.
  volatile unsigned char result = diff;
  return result == 0;
}

absl::StatusOr<std::unique_ptr<Authorizer>> Authorizer::FromFiles(
    const std::string& user_token_file, const std::string& admin_token_file) {
  LOGITSERVE_ASSIGN_OR_RETURN(std::string user,
                              ReadTokenFile(user_token_file, "--auth-token-file"));
  LOGITSERVE_ASSIGN_OR_RETURN(std::string admin,
                              ReadTokenFile(admin_token_file, "--admin-token-file"));
  if (!user.empty() && ConstantTimeEquals(user, admin)) {
    // Equal tokens would make every user an admin without the operator noticing.
    return absl::InvalidArgumentError(
        "--auth-token-file and --admin-token-file hold the same token; use different tokens");
  }
  return std::make_unique<Authorizer>(std::move(user), std::move(admin));
}

Authorizer::Authorizer(std::string user_token, std::string admin_token)
    : user_token_(std::move(user_token)), admin_token_(std::move(admin_token)) {}

absl::Status Authorizer::Check(const grpc::ServerContextBase& context, Role role) const {
  if (!enabled()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(grpc::string_ref(kMetadataKey.data(), kMetadataKey.size()));
  if (it == metadata.end()) return CheckHeader(false, {}, role);
  return CheckHeader(true, absl::string_view(it->second.data(), it->second.size()), role);
}

absl::Status Authorizer::CheckHeader(bool present, absl::string_view header, Role role) const {
  if (!enabled()) return absl::OkStatus();
  if (!present) {
    return absl::UnauthenticatedError(
        "missing 'authorization' metadata; send 'authorization: Bearer <token>'");
  }
  // RFC 6750 / RFC 7235: the scheme is case-insensitive and followed by one or more spaces.
  constexpr absl::string_view kScheme = "bearer";
  if (header.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(header.substr(0, kScheme.size()), kScheme) ||
      header[kScheme.size()] != ' ') {
    return absl::UnauthenticatedError("'authorization' metadata must be 'Bearer <token>'");
  }
  const absl::string_view token = absl::StripAsciiWhitespace(header.substr(kScheme.size()));
  // Compare against both tokens every time, so timing does not tell which one (if any) matched.
  const bool is_user = !user_token_.empty() && ConstantTimeEquals(token, user_token_);
  const bool is_admin = !admin_token_.empty() && ConstantTimeEquals(token, admin_token_);
  if (!is_user && !is_admin) return absl::UnauthenticatedError("invalid bearer token");
  if (role == Role::kUser) return absl::OkStatus();
  if (is_admin) return absl::OkStatus();
  if (admin_token_.empty()) {
    return absl::PermissionDeniedError(
        "administrative RPCs are disabled: the server has no --admin-token-file");
  }
  return absl::PermissionDeniedError("this RPC needs the admin token");
}

}  // namespace logitserve
