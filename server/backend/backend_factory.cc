#include "server/backend/backend_factory.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_tile_gemm.h"
#include "spdlog/spdlog.h"
#if LOGITSERVE_HAVE_CUDA
#include "server/backend/cuda/cuda_backend.h"
#endif

namespace logitserve {
namespace {

constexpr char kUnavailablePayload[] = "logitserve/backend-unavailable";

absl::Status Unavailable(absl::string_view message) {
  absl::Status status = absl::FailedPreconditionError(message);
  status.SetPayload(kUnavailablePayload, absl::Cord("1"));
  return status;
}

}  // namespace

bool IsBackendUnavailable(const absl::Status& status) {
  return status.GetPayload(kUnavailablePayload).has_value();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendSelection& selection) {
#if LOGITSERVE_HAVE_CUDA
  if (selection.kind != "cpu") {
    const absl::Status usable = CheckCudaDevices(selection.devices);
    if (usable.ok()) {
      CudaBackendOptions options;
      options.devices = selection.devices;
      options.collective_timeout = selection.collective_timeout;
      options.test_fault = selection.cuda_test_fault;
      return CreateCudaBackend(options);
    }
    if (selection.kind == "cuda") {
      return Unavailable(absl::StrCat("--backend cuda: no usable GPU: ", usable.message()));
    }
    spdlog::warn("--backend auto: {}; using the CPU backend", std::string(usable.message()));
  }
#else
  if (selection.kind == "cuda") {
    return Unavailable("--backend cuda: this logitserve was built without CUDA; use --backend cpu");
  }
  if (selection.kind == "auto") spdlog::info("--backend auto: no CUDA in this build, using cpu");
#endif
  CpuBackendOptions options;
  options.threads = selection.threads;
  options.shards = selection.shards;
  spdlog::info("backend cpu: hidden-mode GEMMs in {}",
               CpuHasNativeBf16Gemm() ? "bf16 (exact bf16 parts; oneDNN with AVX512-BF16)"
                                      : "fp32 (no native bf16 matmul on this CPU)");
  return CreateCpuBackend(options);
}

}  // namespace logitserve
