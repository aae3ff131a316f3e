// ScorerService::RegisterSharedMemory / UnregisterSharedMemory: the registration half of the
// shared-memory input path (the reading half is the resolver in ScorerService::Submit). Both need
// a user token when auth is on. Register answers at once; Unregister removes the name at once and
// answers when the region's last reader is done (SharedMemoryRegistry::Unregister), so a client
// that got OK may rewrite or unlink the object.
//
// ScorerService::OpenSharedMemoryChannel: Score calls through a shared-memory control region
// (common/wire/shm_channel.h) for the life of the call (ChannelReactor).
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "server/service/service.h"
#include "server/service/shm_channel.h"
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

// One OpenSharedMemoryChannel call: writes one OpenSharedMemoryChannelResponse once the channel
// serves, then keeps the call open while the channel's thread serves requests. The call ends
// when the client cancels it or the connection breaks (OnCancel stops the channel; the request in
// flight, if any, is cancelled), when the one write fails, or when the channel closes itself (the
// object shrank). Finish is called once both the write has completed and the channel's thread
// has exited; the reactor deletes itself in OnDone (the destructor joins that thread).
class ScorerService::ChannelReactor final
    : public grpc::ServerWriteReactor<v1::OpenSharedMemoryChannelResponse> {
 public:
  ChannelReactor(ScorerService* service, grpc::CallbackServerContext* context,
                 const v1::OpenSharedMemoryChannelRequest& request)
      : service_(service) {
    absl::Status status = Open(*context, request);
    if (!status.ok()) {
      Done(status);
      return;
    }
    opened_.set_request_capacity(channel_->request_capacity());
    opened_.set_response_capacity(channel_->response_capacity());
    {
      absl::MutexLock lock(&mu_);
      writing_ = true;
    }
    StartWrite(&opened_);
    channel_->Start(
        [service](const v1::ScoreRequest& r, std::function<absl::Status()> stop,
                  ShmChannel::Answer answer) {
          service->ServeChannelRequest(r, std::move(stop), std::move(answer));
        },
        service_->options_.shared_memory_channel_spin,
        [this](const absl::Status& exit) { ChannelExited(exit); });
  }

  ~ChannelReactor() override {
    channel_.reset();  // joins the channel's thread (which has called ChannelExited)
    if (counted_) service_->open_channels_.fetch_sub(1);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) channel_->Stop();
    absl::Status finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!exited_) return;
      finish = exit_status_;
    }
    Done(finish);
  }

  void OnCancel() override {
    if (channel_ != nullptr) channel_->Stop();
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Open(const grpc::CallbackServerContext& context,
                    const v1::OpenSharedMemoryChannelRequest& request) {
    LOGITSERVE_RETURN_IF_ERROR(service_->Authorize(context, Role::kUser));
    if (service_->draining_.load()) return absl::UnavailableError("server is shutting down");
    if (service_->options_.shared_memory == nullptr) return Unsupported();
    const int limit = service_->options_.max_shared_memory_channels;
    if (service_->open_channels_.fetch_add(1) >= limit) {
      service_->open_channels_.fetch_sub(1);
      return absl::ResourceExhaustedError(
          absl::StrCat("key: ", limit,
                       " shared-memory channels are open, the server's limit "
                       "(--max-shared-memory-channels)"));
    }
    counted_ = true;
    const int64_t max_message = service_->options_.max_receive_message_bytes;
    const uint64_t max_request =
        max_message > 0 ? static_cast<uint64_t>(max_message) : uint64_t{2147483647};
    LOGITSERVE_ASSIGN_OR_RETURN(channel_,
                                ShmChannel::Open(request.key(), max_request, uint64_t{2147483647}));
    spdlog::info("shared-memory channel on '{}' open: request area {} bytes, response area {}",
                 request.key(), channel_->request_capacity(), channel_->response_capacity());
    return absl::OkStatus();
  }

  // On the channel's thread, as its last act.
  void ChannelExited(const absl::Status& exit) {
    {
      absl::MutexLock lock(&mu_);
      exited_ = true;
      exit_status_ = exit;
      if (writing_) return;  // OnWriteDone finishes
    }
    Done(exit);
  }

  // The call's end. Counted (logitserve_requests_total{method="OpenSharedMemoryChannel"}, beside
  // the requests the channel carried) when the channel was refused or closed itself.
  void Done(const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (!status.ok()) service_->RecordRequest("OpenSharedMemoryChannel", grpc_status);
    Finish(grpc_status);
  }

  ScorerService* const service_;
  std::unique_ptr<ShmChannel> channel_;
  bool counted_ = false;  // holds one of max_shared_memory_channels
  v1::OpenSharedMemoryChannelResponse opened_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status exit_status_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerWriteReactor<v1::OpenSharedMemoryChannelResponse>*
ScorerService::OpenSharedMemoryChannel(grpc::CallbackServerContext* context,
                                       const v1::OpenSharedMemoryChannelRequest* request) {
  return new ChannelReactor(this, context, *request);
}

}  // namespace logitserve
