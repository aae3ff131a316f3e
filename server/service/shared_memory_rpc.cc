// ScorerService::RegisterSharedMemory / UnregisterSharedMemory: the registration half of the
// shared-memory input path (the reading half is the resolver in ScorerService::Submit). Both need
// a user token when auth is on. Register answers at once; Unregister removes the name at once and
// answers when the region's last reader is done (SharedMemoryRegistry::Unregister), so a client
// that got OK may rewrite or unlink the object.
#include <string>

#include "absl/status/status.h"
#include "server/service/service.h"
#include "server/service/shm_registry.h"
#include "server/service/status.h"
#include "spdlog/spdlog.h"

namespace logitserve {

namespace {

absl::Status Unsupported() {
  return absl::FailedPreconditionError("this server takes no shared-memory inputs");
}

}  // namespace

grpc::ServerUnaryReactor* ScorerService::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = Authorize(*context, Role::kUser);
  if (status.ok() && draining_.load()) status = absl::UnavailableError("server is shutting down");
  if (status.ok() && options_.shared_memory == nullptr) status = Unsupported();
  if (status.ok()) {
    status = options_.shared_memory->Register(request->name(), request->key(), request->offset(),
                                              request->byte_size());
    if (status.ok()) {
      spdlog::info("shared-memory region '{}' registered: {} bytes at offset {} of '{}'",
                   request->name(), request->byte_size(), request->offset(), request->key());
    }
  }
  const grpc::Status grpc_status = ToGrpcStatus(status);
  RecordRequest("RegisterSharedMemory", grpc_status);
  reactor->Finish(grpc_status);
  return reactor;
}

grpc::ServerUnaryReactor* ScorerService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status status = Authorize(*context, Role::kUser);
  if (status.ok() && options_.shared_memory == nullptr) status = Unsupported();
  if (status.ok()) {
    status = options_.shared_memory->Unregister(
        request->name(), [this, reactor, name = request->name()] {
          spdlog::info("shared-memory region '{}' unregistered and unmapped", name);
          RecordRequest("UnregisterSharedMemory", grpc::Status::OK);
          reactor->Finish(grpc::Status::OK);
        });
    if (status.ok()) return reactor;  // finished by the callback
  }
  const grpc::Status grpc_status = ToGrpcStatus(status);
  RecordRequest("UnregisterSharedMemory", grpc_status);
  reactor->Finish(grpc_status);
  return reactor;
}

}  // namespace logitserve
