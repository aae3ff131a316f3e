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

}  // namespace

CudaTileGemm::~CudaTileGemm() {
  if (a_ != nullptr) cublasLtMatrixLayoutDestroy(a_);
  for (const RowLayouts& r : rows_) {
    if (r.b != nullptr) cublasLtMatrixLayoutDestroy(r.b);
    if (r.c != nullptr) cublasLtMatrixLayoutDestroy(r.c);
  }
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
  // Column-major view: D[m = chunk, n = rows] = op(A) op(B) with A = W stored [chunk][k] row-major
  // (= k x chunk column-major, transposed), B = x stored [rows][k] (= k x rows column-major).
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cublasLtMatmulDescCreate(&g->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulDescSetAttribute(
      g->desc_, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulDescSetAttribute(
      g->desc_, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cublasLtMatrixLayoutCreate(&g->a_, CUDA_R_16BF, k, shape.cols, k));
  auto add_rows = [&](int64_t rows) -> absl::Status {
    RowLayouts& r = g->rows_.emplace_back();
    r.rows = rows;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatrixLayoutCreate(&r.b, CUDA_R_16BF, k, rows, k));
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cublasLtMatrixLayoutCreate(&r.c, CUDA_R_32F, shape.cols, rows, shape.ld));
    return absl::OkStatus();
  };
  LOGITSERVE_RETURN_IF_ERROR(add_rows(shape.rows));
  cublasLtMatrixLayout_t b = g->rows_[0].b, c = g->rows_[0].c;

  cublasLtMatmulPreference_t pref = nullptr;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t max_workspace = kCublasWorkspaceBytes;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
  constexpr int kRequested = 32;
  std::vector<cublasLtMatmulHeuristicResult_t> results(kRequested);
  int returned = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle, g->desc_, g->a_, b, c, c, pref, kRequested,
                                        results.data(), &returned);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(st);
  int chosen = -1;
  for (int i = 0; i < returned; ++i) {
    const auto& r = results[static_cast<size_t>(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kCublasWorkspaceBytes) continue;
    const int32_t split_k = AlgoConfig<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    const uint32_t reduction = AlgoConfig<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
    if (split_k <= 1 && reduction == CUBLASLT_REDUCTION_SCHEME_NONE) {
      chosen = i;
      break;
    }
  }
  if (chosen < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuBLASLt offers no algorithm without split-K for the bf16 GEMM ", shape.rows,
                     " x ", shape.cols, " x ", k, " (", returned, " candidates)"));
  }
  const auto& r = results[static_cast<size_t>(chosen)];
  g->algo_ = r.algo;
  g->workspace_bytes_ = r.workspaceSize;
  // The short tiles the pinned algorithm runs as it is, within the workspace it already has.
  std::string short_tiles;
  for (const int64_t rows : kCudaShortRowTiles) {
    if (rows >= shape.rows) continue;
    LOGITSERVE_RETURN_IF_ERROR(add_rows(rows));
    const RowLayouts& l = g->rows_.back();
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle, g->desc_, g->a_, l.b, l.c, l.c, &g->algo_, &check) !=
            CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > g->workspace_bytes_) {
      cublasLtMatrixLayoutDestroy(l.b);
      cublasLtMatrixLayoutDestroy(l.c);
      g->rows_.pop_back();
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
      ", workspace ", r.workspaceSize,
      " B; short row tiles: ", short_tiles.empty() ? "none" : short_tiles);
  return g;
}

bool CudaTileGemm::Runs(int64_t rows) const {
  for (const RowLayouts& r : rows_) {
    if (r.rows == rows) return true;
  }
  return false;
}

absl::Status CudaTileGemm::Run(cublasLtHandle_t handle, const uint16_t* w, const uint16_t* x,
                               float* out, bool accumulate, void* workspace, cudaStream_t stream,
                               int64_t rows) const {
  const RowLayouts* l = nullptr;
  for (const RowLayouts& r : rows_) {
    if (r.rows == (rows == 0 ? shape_.rows : rows)) l = &r;
  }
  if (l == nullptr) {
    return absl::InternalError(absl::StrCat("CudaTileGemm: no ", rows, "-row tile"));
  }
  const float alpha = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtMatmul(handle, desc_, &alpha, w, a_, x, l->b, &beta, out,
                                                 l->c, out, l->c, &algo_, workspace,
                                                 workspace_bytes_, stream));
  return absl::OkStatus();
}

}  // namespace logitserve
