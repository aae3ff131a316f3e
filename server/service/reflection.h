// Server reflection, grpc.reflection.v1 and grpc.reflection.v1alpha (the same protocol under two
// package names: grpcurl, grpc-js and Postman ask for v1 first, older tools for v1alpha).
//
// Both answer from the process's generated descriptor pool, which holds every file compiled into
// the binary: logitserve.v1, grpc.health.v1 (linked in for this purpose: libgrpc++'s health
// service carries no descriptors of its own) and the reflection protocol itself. list_services
// returns the names given to the constructor. Reflection is unauthenticated, like health checks
// (auth.h): it reveals only the public API.
//
// Thread safety: gRPC calls the services concurrently; they hold no mutable state. The object must
// outlive the grpc::Server it is registered with.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

namespace logitserve {

class ReflectionServices {
 public:
  // `services`: fully qualified names of every service the server answers (their descriptors must
  // be in the generated pool); the two reflection services are added.
  explicit ReflectionServices(std::vector<std::string> services);
  ~ReflectionServices();
  ReflectionServices(const ReflectionServices&) = delete;
  ReflectionServices& operator=(const ReflectionServices&) = delete;

  // Registers both versions with `builder`.
  void RegisterWith(grpc::ServerBuilder& builder);
  // What list_services answers.
  const std::vector<std::string>& services() const { return services_; }

  static constexpr const char* kV1Name = "grpc.reflection.v1.ServerReflection";
  static constexpr const char* kV1AlphaName = "grpc.reflection.v1alpha.ServerReflection";

 private:
  std::vector<std::string> services_;
  std::unique_ptr<grpc::Service> v1_;
  std::unique_ptr<grpc::Service> v1alpha_;
};

}  // namespace logitserve
