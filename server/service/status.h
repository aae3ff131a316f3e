// The one place where an absl::Status becomes a grpc::Status.
//
// Every layer below the service reports errors as absl::Status; the RPC handlers hand them to
// ToGrpcStatus and nothing else. Codes map one to one (both follow google.rpc.Code); the message
// is kept verbatim (so that the field and row named by validation reach the client) up to
// kMaxStatusMessageBytes (client_text.h: a longer trailer would fail the client's connection).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace logitserve {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace logitserve
