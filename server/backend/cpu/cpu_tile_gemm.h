// TileGemm: the hidden-mode matrix product of the CPU backend, through oneDNN.
//
//   logits[kGemmRows, n] = hidden[kGemmRows, K] x W[n, K]^T     (fp32 accumulate)
//
// Two precisions (SPEC §4): kBf16, bf16 operands with fp32 accumulation, on CPUs where oneDNN
// runs bf16 matmuls natively (AVX512-BF16, AMX: twice the fp32 FMA rate and half the weight
// bytes); kFp32 elsewhere. The bf16 form multiplies exact bf16 parts of the operands
// (CpuSplitToBf16), so it loses nothing to rounding: bf16 x bf16 products are exact in fp32.
//
// Shapes are fixed per head and vocabulary block (rows are always padded to kGemmRows), so the
// primitive, its blocking and its accumulation order never depend on how many rows a request has:
// a row's logits are the same bits whatever batch it arrives in. The weights of each block are
// packed once, at head load, into the layout the primitive prefers.
//
// Thread safety: Run() may be called concurrently; each caller passes its own scratchpad. It is
// meant to run inside the backend's OpenMP workers, where oneDNN's own threading is nested and
// therefore serial (one block per worker).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace logitserve {

// Rows of one GEMM. The backend's row tiles (kRowTile) hold several: a block's weights, streamed
// from memory for the tile's first GEMM, are still in the cache for the others.
inline constexpr int64_t kGemmRows = 256;
inline constexpr int64_t kRowTile = 2 * kGemmRows;

enum class GemmPrecision { kFp32, kBf16 };

// Whether oneDNN runs bf16 matmuls natively on this CPU (its effective ISA has AVX512-BF16).
bool CpuHasNativeBf16Gemm();

class TileGemm {
 public:
  // A GEMM of kGemmRows x k x n in `precision`, C (fp32) with leading dimension ldc.
  static absl::StatusOr<std::unique_ptr<TileGemm>> Create(GemmPrecision precision, int64_t k,
                                                          int64_t n, int64_t ldc);
  ~TileGemm();

  GemmPrecision precision() const { return precision_; }
  // oneDNN's name of the implementation it chose (logs, benchmarks).
  std::string implementation() const;
  // Packs W [n, k] (row-major: fp32 for kFp32, bf16 bits for kBf16) into the primitive's
  // preferred layout.
  absl::StatusOr<std::vector<uint8_t>> PackWeights(const void* w) const;
  // Bytes of scratchpad Run() needs.
  size_t scratchpad_bytes() const;
  // c[kGemmRows, n] = a[kGemmRows, k] x packed^T, a row-major (fp32 or bf16 bits as the
  // precision). `scratch` holds scratchpad_bytes().
  absl::Status Run(const void* a, const void* packed, float* c, void* scratch) const;

 private:
  struct Impl;
  TileGemm(GemmPrecision precision, std::unique_ptr<Impl> impl);
  GemmPrecision precision_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace logitserve
