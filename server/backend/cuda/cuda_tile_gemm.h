// CudaTileGemm: the hidden-mode matrix product of the CUDA backend, through cuBLASLt.
//
//   logits[rows][cols] (+)= x[rows, k] . W[cols, k]^T
//
// bf16 inputs (exact parts, see LaunchSplitToBf16), fp32 accumulate and output, row-major logits
// with leading dimension `ld` (a multiple of kCudaVocabChunk): the hidden-mode pipeline writes
// several chunks side by side into one slot and reads them back with one statistics launch. The
// columns of one GEMM are kCudaVocabChunk, or the whole slot (CudaBackendOptions::
// hidden_slot_gemms): then the last slot of a head shard, which may hold fewer chunks, runs the
// same pinned algorithm on fewer columns.
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
// it inside a 1500-row job, on the GPU). Fewer columns likewise: an output element's K order does
// not depend on how many columns the GEMM has.
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

// Rows per GEMM (fixed: see above). H200, N 8192, V 151936 pair, with the preferred 168 x 128 tile
// (logitserve-kernel-bench --tile-gemm-rows 1024,2048 --tile-gemm-candidates 6): 2048 x 8192 GEMMs
// alone 7.17 / 12.40 / 24.87 ms at H 1024 / 2048 / 4096 (0.98-1.07x one whole GEMM), 1024 x 8192
// 8.26 / 13.70 / 25.63, 1024 x 16384 7.63 / 13.37 / 26.15. Whole Score, same call: 2048-row
// tiles of one chunk H 2048 16.86 / 16.95 ms against 16.98 / 17.34 for 1024 rows x two chunks,
// H 4096 29.55 / 29.66 against 29.89 / 32.14 (the same workspace a slot).
inline constexpr int64_t kCudaRowTile = 2048;
inline constexpr int64_t kCudaVocabChunk = 8192;            // vocabulary ids per GEMM (4 blocks)
inline constexpr size_t kCublasWorkspaceBytes = 32u << 20;  // NVIDIA's recommendation for Hopper
// Row tiles for jobs of fewer rows than the full tile (a 64-row job would otherwise multiply 2048
// rows) and for a job's last, partial row tile, where cuBLASLt accepts the pinned algorithm for
// them (cublasLtMatmulAlgoCheck). 768 and 1536: a pipelined client's 511-row chunks merge into
// batches of 1533 rows (and tails of 1529 after two full tiles), which multiplied 2048 rows.
inline constexpr int64_t kCudaShortRowTiles[] = {128, 256, 512, 768, 1024, 1536};

// The shape of one tile GEMM: rows x cols, ld the output's leading dimension (>= cols). When cols
// is a multiple of kCudaVocabChunk, every multiple of kCudaVocabChunk below it also runs (the
// columns of a head shard's last slot).
struct TileGemmShape {
  int64_t rows = kCudaRowTile;
  int64_t cols = kCudaVocabChunk;
  int64_t ld = kCudaVocabChunk;
  // Which of cuBLASLt's heuristic results without split-K to pin: -1 = the first whose tile is
  // the first of kPreferredTileShapes offered, else the first; N >= 0 = the N-th (benchmarks try
  // them; Create fails when there are not that many).
  int candidate = -1;
  // cuBLASLt's SM count target (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET): the SMs the GEMM is
  // planned for, so that kernels on another stream keep the rest; 0 = every SM of the device.
  // Part of the pinned configuration: fixed per backend and hidden size, never per job.
  int sm_count = 0;
};

// TileGemmShape::sm_count for a GPU of `device_sms` SMs that leaves `free_sms` of them to other
// streams (CudaBackendOptions::hidden_stats_sms): 0 (every SM) when none is left free or when that
// would take half of the GPU or more.
inline int TileGemmSmCount(int device_sms, int free_sms) {
  return free_sms > 0 && device_sms / 2 > free_sms ? device_sms - free_sms : 0;
}

// The SMs the tile GEMMs of a head of hidden size `k` leave to the statistics:
// CudaBackendOptions::hidden_stats_sms when >= 0, else (-1, the default) by hidden size. A
// smaller H gives the statistics the same fp32 logits per row in less GEMM time, so they need
// more SMs to keep up. H100, N 8192, V 151936 pair (logitserve-kernel-bench --hidden H
// --hidden-configs 2048:1:2s:slots2:freeN, alternated, docs/PERFORMANCE.md): H 2048, 24 SMs
// 17.24-17.62 ms against 17.69-18.14 with 8 (16 and 20: 17.71-17.84); H 4096, 8 and 20 even
// (medians 31.35 / 31.21 ms), 12 and 24 slower; the H200 not yet measured. Sizes between the
// two measured ones keep 8. Fixed per head: a row's bits never depend on the batch.
inline int HiddenStatsSms(int option, int64_t k) {
  if (option >= 0) return option;
  return k <= 2048 ? 24 : 8;
}

// Tile shapes (cuBLASLt's m x n: vocabulary ids x rows) the tile GEMMs prefer among cuBLASLt's
// heuristic results, in this order. H200, CUDA 13.0, the pipeline's GEMMs alone (N 8192, V 151936
// pair, logitserve-kernel-bench --tile-gemm-candidates 6): cuBLASLt's first choice for 1024 x 16384
// is 256 x 128, 9.11 / 14.82 / 27.50 ms at H 1024 / 2048 / 4096; its third, 168 x 128, 7.63 /
// 13.37 / 26.15 (its ~6 waves fill 132 SMs better than ~3.9, and each tile's fp32 epilogue is
// smaller); 144 x 128 7.35 / 13.55 / 26.19. A fixed preference, not a timing at start-up: the
// algorithm, and so every bit, must be the same in every process on one GPU model (SPEC §4).
inline constexpr cublasLtMatmulTile_t kPreferredTileShapes[] = {CUBLASLT_MATMUL_TILE_168x128,
                                                                CUBLASLT_MATMUL_TILE_144x128};

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
  // Whether Run takes `rows` (shape().rows, or a short tile cuBLASLt accepted), with every
  // column count of the shape.
  bool Runs(int64_t rows) const;
  // The fewest rows Run takes that hold n <= shape().rows: the shortest accepted short tile of at
  // least n rows, else shape().rows (a job's last, partial row tile multiplies that many).
  int64_t RowsFor(int64_t n) const;
  // out = x . w^T (accumulate: out += x . w^T). w: [cols, k] bf16 row-major, x: [rows, k] bf16
  // row-major, out: [rows, cols] fp32 row-major with leading dimension ld.
  // `workspace` holds kCublasWorkspaceBytes on the current device.
  // `rows` = 0 means shape().rows; otherwise one that Runs() accepts. `cols` = 0 means
  // shape().cols; otherwise a multiple of kCudaVocabChunk below it.
  absl::Status Run(cublasLtHandle_t handle, const uint16_t* w, const uint16_t* x, float* out,
                   bool accumulate, void* workspace, cudaStream_t stream, int64_t rows = 0,
                   int64_t cols = 0) const;
  // The pinned algorithm's configuration, for logs and benchmarks.
  const std::string& description() const { return description_; }

 private:
  CudaTileGemm() = default;
  int64_t k_ = 0;
  TileGemmShape shape_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  // The layouts of every (rows, cols) the pinned algorithm runs: [0] the full shape's, then the
  // other column counts of the full tile, then those of each accepted short tile.
  struct Layouts {
    int64_t rows = 0;
    int64_t cols = 0;
    cublasLtMatrixLayout_t a = nullptr;  // w
    cublasLtMatrixLayout_t b = nullptr;  // x
    cublasLtMatrixLayout_t c = nullptr;  // out
  };
  std::vector<Layouts> layouts_;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_bytes_ = 0;
  std::string description_;
};

}  // namespace logitserve
