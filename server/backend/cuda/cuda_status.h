// One macro turns a CUDA runtime, cuBLAS(Lt) or NCCL result into an absl::Status carrying the
// failed expression and its file:line, and returns it from the enclosing function:
//
//   LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(...));
//   LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmul(...));
//   LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclAllGather(...));
//
// CudaStatus(result, expr, file, line) is the function behind it, for callers that collect rather
// than return. Codes: out of memory -> RESOURCE_EXHAUSTED (admission can retry smaller); no device,
// an unsupported architecture or an old driver -> FAILED_PRECONDITION; everything else (a device
// fault, a failed collective) -> INTERNAL.
//
// Fatal device errors: a sticky CUDA error (the context is unusable until the process ends: an
// illegal address, a kernel trap, an uncorrectable ECC error, ...) and every NCCL error (the
// communicator's state is unknown afterwards; NCCL's advice is to abort it) carry a payload that
// IsFatalDeviceError() recognises, so the backend can take itself out of service. Recoverable
// errors (out of memory, a bad argument) do not.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"

namespace logitserve {

absl::Status CudaStatus(cudaError_t result, const char* expr, const char* file, int line);
absl::Status CudaStatus(cublasStatus_t result, const char* expr, const char* file, int line);
absl::Status CudaStatus(ncclResult_t result, const char* expr, const char* file, int line);

// Whether `e` leaves the CUDA context unusable (every later call on the device fails with it).
bool IsStickyCudaError(cudaError_t e);
// Marks `status` (not OK) as a fatal device error; IsFatalDeviceError then recognises it.
absl::Status MarkFatalDeviceError(absl::Status status);
bool IsFatalDeviceError(const absl::Status& status);

}  // namespace logitserve

#define LOGITSERVE_RETURN_IF_CUDA_ERROR(expr)                            \
  do {                                                                   \
    if (::absl::Status logitserve_cuda_status_ =                         \
            ::logitserve::CudaStatus((expr), #expr, __FILE__, __LINE__); \
        !logitserve_cuda_status_.ok()) {                                 \
      return logitserve_cuda_status_;                                    \
    }                                                                    \
  } while (0)
