#include "server/backend/cuda/cuda_tile_gemm.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"

namespace logitserve {
namespace {

template <typename T>
T AlgoConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

void DestroyLayouts(cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c) {
  if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
  if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
  if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
}

}  // namespace

CudaTileGemm::~CudaTileGemm() {
  for (const Layouts& l : layouts_) DestroyLayouts(l.a, l.b, l.c);
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
}

absl::StatusOr<std::unique_ptr<CudaTileGemm>> CudaTileGemm::Create(cublasLtHandle_t handle,
                                                                   int64_t k, TileGemmShape shape) {
  if (k <= 0 || k % 8 != 0)
    return absl::InvalidArgumentError("CudaTileGemm: k must be a multiple of 8");
  if (shape.rows <= 0 || shape.cols <= 0 || shape.ld < shape.cols) {
    return absl::InvalidArgumentError("CudaTileGemm: bad shape");
  }
  std::unique_ptr<CudaTileGemm> g(new CudaTileGemm());
  g->k_ = k;
  g->shape_ = shape;
  // Column-major view: D[m = cols, n = rows] = op(A) op(B) with A = W stored [cols][k] row-major
  // (= k x cols column-major, transposed), B = x stored [rows][k] (= k x rows column-major).
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cublasLtMatmulDescCreate(&g->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulDescSetAttribute(
      g->desc_, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulDescSetAttribute(
      g->desc_, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (shape.sm_count > 0) {
    const int32_t sms = shape.sm_count;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulDescSetAttribute(
        g->desc_, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  // The column counts: the shape's, then (a slot of whole chunks) each smaller whole number of
  // chunks, which a head shard's last slot may hold.
  std::vector<int64_t> col_counts = {shape.cols};
  if (shape.cols % kCudaVocabChunk == 0) {
    for (int64_t c = shape.cols - kCudaVocabChunk; c > 0; c -= kCudaVocabChunk) {
      col_counts.push_back(c);
    }
  }
  auto add = [&](int64_t rows, int64_t cols) -> absl::Status {
    Layouts& l = g->layouts_.emplace_back();
    l.rows = rows;
    l.cols = cols;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatrixLayoutCreate(&l.a, CUDA_R_16BF, k, cols, k));
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatrixLayoutCreate(&l.b, CUDA_R_16BF, k, rows, k));
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cublasLtMatrixLayoutCreate(&l.c, CUDA_R_32F, cols, rows, shape.ld));
    return absl::OkStatus();
  };
  LOGITSERVE_RETURN_IF_ERROR(add(shape.rows, shape.cols));
  cublasLtMatrixLayout_t a = g->layouts_[0].a, b = g->layouts_[0].b, c = g->layouts_[0].c;

  cublasLtMatmulPreference_t pref = nullptr;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t max_workspace = kCublasWorkspaceBytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
  constexpr int kRequested = 32;
  std::vector<cublasLtMatmulHeuristicResult_t> results(kRequested);
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle, g->desc_, a, b, c, c, pref, kRequested,
                                        results.data(), &returned);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(st);
  // The results without split-K (and within the workspace), in cuBLASLt's order.
  std::vector<int> usable;
  for (int i = 0; i < returned; ++i) {
    const auto& r = results[static_cast<size_t>(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kCublasWorkspaceBytes) continue;
    const int32_t split_k = AlgoConfig<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    const uint32_t reduction = AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
    if (split_k <= 1 && reduction == CUBLASLT_REDUCTION_SCHEME_NONE) usable.push_back(i);
  }
  int chosen = -1;
  if (shape.candidate >= 0) {
    if (static_cast<size_t>(shape.candidate) < usable.size()) {
      chosen = usable[static_cast<size_t>(shape.candidate)];
    }
  } else {
    for (const cublasLtMatmulTile_t tile : kPreferredTileShapes) {
      for (const int i : usable) {
        if (chosen < 0 && AlgoConfig<uint32_t>(results[static_cast<size_t>(i)].algo,
                                               CUBLASLT_ALGO_CONFIG_TILE_ID) == tile) {
          chosen = i;
        }
      }
    }
    if (chosen < 0 && !usable.empty()) chosen = usable[0];
  }
  if (chosen < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuBLASLt offers no algorithm without split-K for the bf16 GEMM ", shape.rows, " x ",
        shape.cols, " x ", k, " (", returned, " results, ", usable.size(), " without split-K)"));
  }
  const auto& r = results[static_cast<size_t>(chosen)];
  g->algo_ = r.algo;
  g->workspace_bytes_ = r.workspaceSize;
  // The pinned algorithm runs every other (rows, cols) as it is, within the workspace it already
  // has: the full tile's other column counts must, a short tile is kept if all of its do.
  auto accepted = [&](const Layouts& l) {
    cublasLtMatmulHeuristicResult_t check{};
    return cublasLtMatmulAlgoCheck(handle, g->desc_, l.a, l.b, l.c, l.c, &g->algo_, &check) ==
               CUBLAS_STATUS_SUCCESS &&
           check.workspaceSize <= g->workspace_bytes_;
  };
  for (size_t i = 1; i < col_counts.size(); ++i) {
    LOGITSERVE_RETURN_IF_ERROR(add(shape.rows, col_counts[i]));
    if (!accepted(g->layouts_.back())) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuBLASLt's algorithm for the bf16 GEMM ", shape.rows, " x ", shape.cols,
                       " x ", k, " does not run ", col_counts[i], " columns"));
    }
  }
  std::string short_tiles;
  for (const int64_t rows : kCudaShortRowTiles) {
    if (rows >= shape.rows) continue;
    const size_t first = g->layouts_.size();
    bool all = true;
    for (const int64_t cols : col_counts) {
      LOGITSERVE_RETURN_IF_ERROR(add(rows, cols));
      all = all && accepted(g->layouts_.back());
    }
    if (!all) {
      for (size_t i = first; i < g->layouts_.size(); ++i) {
        const Layouts& l = g->layouts_[i];
        DestroyLayouts(l.a, l.b, l.c);
      }
      g->layouts_.resize(first);
      continue;
    }
    absl::StrAppend(&short_tiles, short_tiles.empty() ? "" : ", ", rows);
  }
  g->description_ = absl::StrCat(
      "cuBLASLt bf16 GEMM m=", shape.cols, " n=", shape.rows, " k=", k, " ldc=", shape.ld,
      ": heuristic result ", chosen, " of ", returned, ", algo id ",
      AlgoConfig<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_ID), ", tile ",
      AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID), ", stages ",
      AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), ", split-k ",
      AlgoConfig<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), ", reduction ",
      AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), ", swizzle ",
      AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), ", custom ",
      AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), ", cluster ",
      AlgoConfig<uint16_t>(r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), ", waves ", r.wavesCount,
      ", workspace ", r.workspaceSize, " B, SM target ", shape.sm_count,
      " (0: all); short row tiles: ", short_tiles.empty() ? "none" : short_tiles);
  return g;
}

bool CudaTileGemm::Runs(int64_t rows) const {
  for (const Layouts& l : layouts_) {
    if (l.rows == rows) return true;
  }
  return false;
}

int64_t CudaTileGemm::RowsFor(int64_t n) const {
  for (const int64_t t : kCudaShortRowTiles) {  // ascending
    if (t >= n && t < shape_.rows && Runs(t)) return t;
  }
  return shape_.rows;
}

absl::Status CudaTileGemm::Run(cublasLtHandle_t handle, const uint16_t* w, const uint16_t* x,
                               float* out, bool accumulate, void* workspace, cudaStream_t stream,
                               int64_t rows, int64_t cols) const {
  if (rows == 0) rows = shape_.rows;
  if (cols == 0) cols = shape_.cols;
  const Layouts* l = nullptr;
  for (const Layouts& candidate : layouts_) {
    if (candidate.rows == rows && candidate.cols == cols) l = &candidate;
  }
  if (l == nullptr) {
    return absl::InternalError(absl::StrCat("CudaTileGemm: no ", rows, " x ", cols, " tile"));
  }
  const float alpha = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmul(handle, desc_, &alpha, w, l->a, x, l->b, &beta,
                                                 out, l->c, out, l->c, &algo_, workspace,
                                                 workspace_bytes_, stream));
  return absl::OkStatus();
}

}  // namespace logitserve
