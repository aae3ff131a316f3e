// The real server on the CUDA backend under injected device faults (--test-fault, CUDA kinds):
// a stalled kernel trips the watchdog, a real illegal-address error is sticky, a skipped NCCL
// collective (two GPUs) is aborted. Each time the request in flight fails cleanly (INTERNAL or
// UNAVAILABLE, never a hang or a crash) and the server exits by itself with code 3 (fatal device
// error) so the orchestrator restarts it. Label gpu: skipped without a device.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/e2e_support.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve {
namespace {

constexpr int kExitDeviceFault = 3;  // server/service/main.cc

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

void ExpectFaultEndsTheServer(const std::string& fault) {
  auto server = testing::ServerProcess::Start(
      {"--backend", "cuda", "--synthetic-head", e2e::kPolicy.Flag(), "--test-fault", fault,
       "--collective-timeout-s", "2", "--log-level", "warn"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Scorer::NewStub(e2e::Connect((*server)->address()));
  v1::ScoreRequest request;
  request.set_head(e2e::kPolicy.name);
  // Three 512-row tiles: skip-collective skips a job's gathers after its first, so the job needs
  // more than one row tile (and so more than one gather) for the fault to bite.
  const int64_t rows = 1100;
  std::vector<float> hidden(static_cast<size_t>(rows * e2e::kPolicy.hidden), 0.25f);
  *request.mutable_hidden() =
      testing::FloatTensor(v1::DATA_TYPE_BFLOAT16, hidden, {rows, e2e::kPolicy.hidden});
  request.set_entropy(true);
  v1::ScoreResponse response;
  const grpc::Status status = e2e::CallScore(*stub, request, &response);
  EXPECT_TRUE(status.error_code() == grpc::StatusCode::INTERNAL ||
              status.error_code() == grpc::StatusCode::UNAVAILABLE)
      << fault << ": " << status.error_code() << " " << status.error_message();
  // The server leaves by itself (signal 0 only waits).
  EXPECT_EQ((*server)->Stop(0, std::chrono::seconds(60)), kExitDeviceFault) << fault;
}

TEST(CudaServerFaultTest, AStalledKernelTripsTheWatchdogAndTheServerExits) {
  ExpectFaultEndsTheServer("stall:0");
}

TEST(CudaServerFaultTest, AStickyDeviceErrorTakesTheServerDown) {
  ExpectFaultEndsTheServer("sticky-error:0");
}

TEST(CudaServerFaultTest, ASkippedCollectiveIsAbortedAndTheServerExits) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two GPUs";
  ExpectFaultEndsTheServer("skip-collective:1");
}

}  // namespace
}  // namespace logitserve
