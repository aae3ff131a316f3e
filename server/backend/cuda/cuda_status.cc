#include "server/backend/cuda/cuda_status.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace logitserve {
namespace {

constexpr char kFatalPayload[] = "logitserve.dev/fatal-device-error";

std::string Where(const char* expr, const char* file, int line) {
  return absl::StrCat(file, ":", line, ": ", expr, ": ");
}

}  // namespace

absl::Status CudaStatus(cudaError_t result, const char* expr, const char* file, int line) {
  if (result == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(Where(expr, file, line), cudaGetErrorName(result), " (",
                                       cudaGetErrorString(result), ")");
  if (IsStickyCudaError(result)) return MarkFatalDeviceError(absl::InternalError(msg));
  switch (result) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CudaStatus(cublasStatus_t result, const char* expr, const char* file, int line) {
  if (result == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg = absl::StrCat(Where(expr, file, line), cublasLtGetStatusName(result), " (",
                                       cublasLtGetStatusString(result), ")");
  switch (result) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CudaStatus(ncclResult_t result, const char* expr, const char* file, int line) {
  if (result == ncclSuccess) return absl::OkStatus();
  return MarkFatalDeviceError(absl::InternalError(
      absl::StrCat(Where(expr, file, line), "NCCL error ", static_cast<int>(result), " (",
                   ncclGetErrorString(result), ")")));
}

bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorCudartUnloading:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorExternalDevice:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

absl::Status MarkFatalDeviceError(absl::Status status) {
  if (!status.ok()) status.SetPayload(kFatalPayload, absl::Cord("1"));
  return status;
}

bool IsFatalDeviceError(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kFatalPayload).has_value();
}

}  // namespace logitserve
