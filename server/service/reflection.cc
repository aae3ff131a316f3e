#include "server/service/reflection.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace logitserve {
namespace {

using ::google::protobuf::Descriptor;
using ::google::protobuf::DescriptorPool;
using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::FileDescriptor;

// The generated types of one protocol version; the two versions have the same members.
struct V1 {
  using Service = grpc::reflection::v1::ServerReflection::CallbackService;
  using Request = grpc::reflection::v1::ServerReflectionRequest;
  using Response = grpc::reflection::v1::ServerReflectionResponse;
};
struct V1Alpha {
  using Service = grpc::reflection::v1alpha::ServerReflection::CallbackService;
  using Request = grpc::reflection::v1alpha::ServerReflectionRequest;
  using Response = grpc::reflection::v1alpha::ServerReflectionResponse;
};

template <typename Response>
void SetError(grpc::StatusCode code, std::string message, Response* response) {
  response->mutable_error_response()->set_error_code(static_cast<int32_t>(code));
  response->mutable_error_response()->set_error_message(std::move(message));
}

// `file` first, then its dependencies, transitively, each once (clients build their pool from
// the whole set).
template <typename FileResponse>
void AddFileWithDependencies(const FileDescriptor* file, FileResponse* out) {
  std::set<std::string> seen = {file->name()};
  std::vector<const FileDescriptor*> pending = {file};
  for (size_t i = 0; i < pending.size(); ++i) {
    google::protobuf::FileDescriptorProto proto;
    pending[i]->CopyTo(&proto);
    proto.SerializeToString(out->add_file_descriptor_proto());
    for (int d = 0; d < pending[i]->dependency_count(); ++d) {
      const FileDescriptor* dep = pending[i]->dependency(d);
      if (seen.insert(dep->name()).second) pending.push_back(dep);
    }
  }
}

template <typename P>
void Answer(const std::vector<std::string>& services, const typename P::Request& request,
            typename P::Response* response) {
  using Request = typename P::Request;
  response->set_valid_host(request.host());
  *response->mutable_original_request() = request;
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  const FileDescriptor* file = nullptr;
  switch (request.message_request_case()) {
    case Request::kListServices:
      for (const std::string& name : services) {
        response->mutable_list_services_response()->add_service()->set_name(name);
      }
      return;
    case Request::kFileByFilename:
      file = pool->FindFileByName(request.file_by_filename());
      if (file == nullptr) {
        return SetError(grpc::StatusCode::NOT_FOUND,
                        "file not found: " + request.file_by_filename(), response);
      }
      break;
    case Request::kFileContainingSymbol:
      file = pool->FindFileContainingSymbol(request.file_containing_symbol());
      if (file == nullptr) {
        return SetError(grpc::StatusCode::NOT_FOUND,
                        "symbol not found: " + request.file_containing_symbol(), response);
      }
      break;
    case Request::kFileContainingExtension: {
      const auto& ext = request.file_containing_extension();
      const Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
      const FieldDescriptor* field =
          type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
      if (field == nullptr) {
        return SetError(grpc::StatusCode::NOT_FOUND,
                        "extension not found: " + ext.containing_type() + " " +
                            std::to_string(ext.extension_number()),
                        response);
      }
      file = field->file();
      break;
    }
    case Request::kAllExtensionNumbersOfType: {
      const Descriptor* type = pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        return SetError(grpc::StatusCode::NOT_FOUND,
                        "type not found: " + request.all_extension_numbers_of_type(), response);
      }
      std::vector<const FieldDescriptor*> extensions;
      pool->FindAllExtensions(type, &extensions);
      auto* numbers = response->mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const FieldDescriptor* e : extensions) numbers->add_extension_number(e->number());
      return;
    }
    default:
      return SetError(grpc::StatusCode::UNIMPLEMENTED, "unknown reflection request", response);
  }
  AddFileWithDependencies(file, response->mutable_file_descriptor_response());
}

// One ServerReflectionInfo stream: read a request, write its answer, repeat until the client
// half-closes.
template <typename P>
class Reactor final : public grpc::ServerBidiReactor<typename P::Request, typename P::Response> {
 public:
  explicit Reactor(const std::vector<std::string>* services) : services_(services) {
    this->StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) return this->Finish(grpc::Status::OK);  // half-close (or a broken stream)
    response_.Clear();
    Answer<P>(*services_, request_, &response_);
    this->StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return this->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream broken"));
    this->StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const std::vector<std::string>* const services_;
  typename P::Request request_;
  typename P::Response response_;
};

template <typename P>
class Service final : public P::Service {
 public:
  explicit Service(const std::vector<std::string>* services) : services_(services) {}
  grpc::ServerBidiReactor<typename P::Request, typename P::Response>* ServerReflectionInfo(
      grpc::CallbackServerContext*) override {
    return new Reactor<P>(services_);
  }

 private:
  const std::vector<std::string>* const services_;
};

}  // namespace

ReflectionServices::ReflectionServices(std::vector<std::string> services)
    : services_(std::move(services)) {
  // Pulls grpc/health/v1/health.proto's descriptors into the binary (and so into the generated
  // pool): nothing else references them, and the linker drops unreferenced archive members.
  grpc::health::v1::HealthCheckRequest::descriptor();
  services_.push_back(kV1Name);
  services_.push_back(kV1AlphaName);
  v1_ = std::make_unique<Service<V1>>(&services_);
  v1alpha_ = std::make_unique<Service<V1Alpha>>(&services_);
}

ReflectionServices::~ReflectionServices() = default;

void ReflectionServices::RegisterWith(grpc::ServerBuilder& builder) {
  builder.RegisterService(v1_.get());
  builder.RegisterService(v1alpha_.get());
}

}  // namespace logitserve
