// Transport security and authentication of logitserve.v1.Scorer RPCs: Authorizer checks bearer
// tokens; ServerCredentialsFromFiles builds the listening port's TLS / mutual-TLS credentials.
//
// Authorizer:
// Clients send the metadata entry `authorization: Bearer <token>`. Two tokens may be configured:
// a user token (--auth-token-file) for the scoring RPCs (Score, ScoreStream, ListHeads) and an
// admin token (--admin-token-file) for administrative RPCs (LoadHead). The admin token is also
// accepted on user RPCs. The rules of Check():
//   - no token configured at all            -> every call is OK (open server);
//   - missing / malformed / unknown token   -> UNAUTHENTICATED;
//   - Role::kUser                           -> the user or the admin token;
//   - Role::kAdmin                          -> the admin token; a valid user token gets
//                                              PERMISSION_DENIED, and when only a user token is
//                                              configured every admin call is PERMISSION_DENIED
//                                              (uploads disabled) once the caller authenticated.
// Tokens are compared in constant time (no early exit on the first differing byte), so response
// timing does not reveal how much of a guessed token was right.
//
// Not covered: grpc.health.v1 and server reflection stay unauthenticated on purpose, because
// Kubernetes gRPC liveness/readiness probes cannot send metadata; they reveal only the serving
// status and the (public) API schema, and do no compute. Tokens travel in clear text unless the
// server runs with TLS (--tls-cert / --tls-key).
//
// Thread safety: immutable after construction; Check() may be called from any thread at once.
#pragma once

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace logitserve {

enum class Role {
  kUser,   // Score, ScoreStream, ListHeads
  kAdmin,  // LoadHead
};

class Authorizer {
 public:
  // Reads the token files (one token per file, surrounding whitespace trimmed; an empty path means
  // no token of that kind). Errors (unreadable file, empty token, whitespace inside the token)
  // name the flag and the file.
  static absl::StatusOr<std::unique_ptr<Authorizer>> FromFiles(const std::string& user_token_file,
                                                               const std::string& admin_token_file);

  // Empty string = no token of that kind.
  Authorizer(std::string user_token, std::string admin_token);

  // Checks the `authorization` metadata of the call against `role` (rules above). The returned
  // status is UNAUTHENTICATED or PERMISSION_DENIED with a message that never echoes a token.
  absl::Status Check(const grpc::ServerContextBase& context, Role role) const;

  // The same rules on an already extracted `authorization` header value (`present`
  // false when the call carried no such header). For tests and non-gRPC callers.
  absl::Status CheckHeader(bool present, absl::string_view header, Role role) const;

  // True when at least one token is configured (the server is not open).
  bool enabled() const { return !user_token_.empty() || !admin_token_.empty(); }

 private:
  const std::string user_token_;
  const std::string admin_token_;
};

// An AuthMetadataProcessor applying `authorizer` (which must outlive it) to every call's initial
// metadata, by method (`:path`): LoadHead needs the admin role, the other logitserve.v1.Scorer
// methods the user role, everything else (health, reflection) is open as above. gRPC runs it
// before the call's messages are read, so an unauthenticated call is refused (UNAUTHENTICATED /
// PERMISSION_DENIED) before its request is buffered. gRPC supports processors only on secure
// (TLS) credentials; the handlers' own Check stays in place for every transport.
std::shared_ptr<grpc::AuthMetadataProcessor> MakeTokenAuthProcessor(const Authorizer* authorizer);

// The credentials of the gRPC listening port from the TLS flags (paths of PEM files):
//   - cert and key empty, client_ca empty -> insecure (plaintext) credentials;
//   - cert and key                        -> TLS; client certificates are not requested;
//   - cert, key and client_ca             -> mutual TLS: every client must present a certificate
//                                            that chains to client_ca, else the handshake fails.
// The files are read and parsed here (OpenSSL), so a missing file, a file without a PEM
// certificate / private key, a key that does not match the certificate, or a client CA without a
// server certificate fail at start-up with INVALID_ARGUMENT naming the flag and the file, instead
// of a bare "cannot listen" later.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file);

// Compares two strings in time that depends only on their lengths, never on where they differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace logitserve
