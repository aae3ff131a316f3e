// CudaTileGemm: the hidden-mode matrix product of the CUDA backend, through cuBLASLt.
//
//   logits[kCudaRowTile rows][kCudaVocabChunk] (+)= x[kCudaRowTile, k] . W[kCudaVocabChunk, k]^T
//
// bf16 inputs (exact parts, see LaunchSplitToBf16), fp32 accumulate and output, row-major logits
// with leading dimension kCudaVocabChunk: 512 x 8192 fp32 = 16 MiB, which stays in the 50-60 MB
// L2 while the statistics kernel reads it back.
//
// Determinism: the shape never changes (row tiles are padded to kCudaRowTile rows, the head's
// shard to whole chunks), and the algorithm is chosen once per (device, k) from cuBLASLt's
// heuristic among results that use no split-K (SPLITK_NUM == 1, no reduction scheme), then pinned:
// every call runs the same kernel with the same K order for every output element, whatever the
// batch, the row's position in it, or the shard layout. Accumulating (beta = 1) runs the same
// algorithm; adding a product that is exactly zero leaves every bit of the output as it was.
//
// Thread safety: Run() may be called concurrently on different streams with different workspaces.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace logitserve {

inline constexpr int64_t kCudaRowTile = 512;                // rows per GEMM (fixed: see above)
inline constexpr int64_t kCudaVocabChunk = 8192;            // vocabulary ids per GEMM (4 blocks)
inline constexpr size_t kCublasWorkspaceBytes = 32u << 20;  // NVIDIA's recommendation for Hopper

class CudaTileGemm {
 public:
  // Chooses and pins the algorithm for hidden size k (a multiple of 8) on the current device.
  static absl::StatusOr<std::unique_ptr<CudaTileGemm>> Create(cublasLtHandle_t handle, int64_t k);
  ~CudaTileGemm();
  CudaTileGemm(const CudaTileGemm&) = delete;
  CudaTileGemm& operator=(const CudaTileGemm&) = delete;

  int64_t k() const { return k_; }
  // out = x . w^T (accumulate: out += x . w^T). w: [kCudaVocabChunk, k] bf16 row-major, x:
  // [kCudaRowTile, k] bf16 row-major, out: [kCudaRowTile, kCudaVocabChunk] fp32 row-major.
  // `workspace` holds kCublasWorkspaceBytes on the current device.
  absl::Status Run(cublasLtHandle_t handle, const uint16_t* w, const uint16_t* x, float* out,
                   bool accumulate, void* workspace, cudaStream_t stream) const;
  // The pinned algorithm's configuration, for logs and benchmarks.
  const std::string& description() const { return description_; }

 private:
  CudaTileGemm() = default;
  int64_t k_ = 0;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  cublasLtMatrixLayout_t b_ = nullptr;
  cublasLtMatrixLayout_t c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_bytes_ = 0;
  std::string description_;
};

}  // namespace logitserve
