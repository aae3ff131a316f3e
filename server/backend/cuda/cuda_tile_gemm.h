// CudaTileGemm: the hidden-mode matrix product of the CUDA backend, through cuBLASLt.
//
//   logits[kCudaRowTile rows][kCudaVocabChunk] (+)= x[kCudaRowTile, k] . W[kCudaVocabChunk, k]^T
//
// bf16 inputs (exact parts, see LaunchSplitToBf16), fp32 accumulate and output, row-major logits
// with leading dimension `ld` (a multiple of kCudaVocabChunk): the hidden-mode pipeline writes
// several chunks side by side into one slot and reads them back with one statistics launch.
//
// Determinism: within one backend the shape never changes (row tiles are padded to the backend's
// row tile or to one of the short tiles below, the head's shard to whole chunks, and `ld` is the
// backend's slot width), and the algorithm is chosen once per (device, k) from cuBLASLt's heuristic
// among results that use no split-K (SPLITK_NUM == 1, no reduction scheme), then pinned: every call
// runs the same kernel with the same K order for every output element, whatever the batch, the
// row's position in it, or the shard layout. Accumulating (beta = 1) runs the same algorithm;
// adding a product that is exactly zero leaves every bit of the output as it was. Short row tiles
// (small jobs) run the very algorithm pinned for the full tile, on layouts with fewer rows: the
// same kernel, whose K order for an output element does not depend on how many rows there are (no
// split-K), so a row gets the same bits in either (the determinism suite checks a row alone against
// it inside a 1500-row job, on the GPU).
//
// Thread safety: Run() may be called concurrently on different streams with different workspaces.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace logitserve {

// Rows per GEMM (fixed: see above). H200, the 8192 x 4096 x 151936 pair of logitserve-kernel-bench
// --tile-gemm-rows 512,1024,2048: 512-row tiles cost 1.063-1.115x one whole GEMM, 1024 0.993x,
// 2048 0.997x (cuBLASLt's same kernel, 1.9 waves of 132 SMs instead of 0.97).
inline constexpr int64_t kCudaRowTile = 1024;
inline constexpr int64_t kCudaVocabChunk = 8192;            // vocabulary ids per GEMM (4 blocks)
inline constexpr size_t kCublasWorkspaceBytes = 32u << 20;  // NVIDIA's recommendation for Hopper
// Row tiles for jobs of fewer rows than the full tile (a 64-row job would otherwise multiply 1024
// rows), where cuBLASLt accepts the pinned algorithm for them (cublasLtMatmulAlgoCheck).
inline constexpr int64_t kCudaShortRowTiles[] = {128, 256, 512};

// The shape of one tile GEMM: the backend's is always the default rows x cols (benchmarks try
// others); ld is the output's leading dimension (>= cols).
struct TileGemmShape {
  int64_t rows = kCudaRowTile;
  int64_t cols = kCudaVocabChunk;
  int64_t ld = kCudaVocabChunk;
};

class CudaTileGemm {
 public:
  // Chooses and pins the algorithm for hidden size k (a multiple of 8) on the current device.
  static absl::StatusOr<std::unique_ptr<CudaTileGemm>> Create(cublasLtHandle_t handle, int64_t k,
                                                              TileGemmShape shape = {});
  ~CudaTileGemm();
  CudaTileGemm(const CudaTileGemm&) = delete;
  CudaTileGemm& operator=(const CudaTileGemm&) = delete;

  int64_t k() const { return k_; }
  const TileGemmShape& shape() const { return shape_; }
  // Whether Run takes `rows` (shape().rows, or a short tile cuBLASLt accepted).
  bool Runs(int64_t rows) const;
  // out = x . w^T (accumulate: out += x . w^T). w: [cols, k] bf16 row-major, x: [rows, k] bf16
  // row-major, out: [rows, cols] fp32 row-major with leading dimension ld.
  // `workspace` holds kCublasWorkspaceBytes on the current device.
  // `rows` = 0 means shape().rows; otherwise one that Runs() accepts.
  absl::Status Run(cublasLtHandle_t handle, const uint16_t* w, const uint16_t* x, float* out,
                   bool accumulate, void* workspace, cudaStream_t stream, int64_t rows = 0) const;
  // The pinned algorithm's configuration, for logs and benchmarks.
  const std::string& description() const { return description_; }

 private:
  CudaTileGemm() = default;
  int64_t k_ = 0;
  TileGemmShape shape_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  // The x and output layouts per row count: [0] the full tile's, then the accepted short tiles.
  struct RowLayouts {
    int64_t rows = 0;
    cublasLtMatrixLayout_t b = nullptr;
    cublasLtMatrixLayout_t c = nullptr;
  };
  std::vector<RowLayouts> rows_;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_bytes_ = 0;
  std::string description_;
};

}  // namespace logitserve
