// A raw-transfer peer for the RPC benchmarks: a generic callback-API service that receives one
// message of an expected size (without parsing it) and answers with fixed reply bytes, so a
// benchmark can time moving a request's serialized bytes over gRPC apart from everything the
// Score path does with them.
//
// Thread safety: Expect() must not race with calls in flight; the reactors only read.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <utility>

namespace logitserve::bench {

inline constexpr const char* kEchoMethod = "/logitserve.bench.Echo/Transfer";

// Receives one message, checks its size, answers with `reply`.
class EchoService final : public grpc::CallbackGenericService {
 public:
  void Expect(size_t request_bytes, grpc::ByteBuffer reply) {
    expected_bytes_ = request_bytes;
    reply_ = std::move(reply);
  }
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Reactor(this);
  }

 private:
  class Reactor final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Reactor(EchoService* service) : service_(service) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
        return;
      }
      if (in_.Length() != service_->expected_bytes_) {
        Finish(grpc::Status(grpc::StatusCode::DATA_LOSS, "request size mismatch"));
        return;
      }
      StartWriteAndFinish(&service_->reply_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    EchoService* service_;
    grpc::ByteBuffer in_;
  };

  size_t expected_bytes_ = 0;
  grpc::ByteBuffer reply_;  // read-only while calls run
};

// One slice holding a copy of `bytes`.
inline grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// `echo` served on an ephemeral loopback port without message size limits; *port is that port.
// Null when the server cannot start.
inline std::unique_ptr<grpc::Server> StartEchoServer(EchoService* echo, int* port) {
  *port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterCallbackGenericService(echo);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (*port == 0) server.reset();
  return server;
}

}  // namespace logitserve::bench
