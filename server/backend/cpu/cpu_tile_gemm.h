// TileGemm: the hidden-mode matrix product of the CPU backend, through oneDNN.
//
//   logits[kRowTile, n] = hidden[kRowTile, K] x W[n, K]^T     (fp32 in, fp32 accumulate)
//
// Shapes are fixed per head and vocabulary block (rows are always padded to kRowTile), so the
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
#include <vector>

#include "absl/status/statusor.h"

namespace logitserve {

inline constexpr int64_t kRowTile = 64;

class TileGemm {
 public:
  // A GEMM of kRowTile x k x n, C with leading dimension ldc.
  static absl::StatusOr<std::unique_ptr<TileGemm>> Create(int64_t k, int64_t n, int64_t ldc);
  ~TileGemm();

  // Packs W [n, k] (row-major fp32) into the primitive's preferred layout.
  absl::StatusOr<std::vector<float>> PackWeights(const float* w) const;
  // Bytes of scratchpad Run() needs.
  size_t scratchpad_bytes() const;
  // c[kRowTile, n] = a[kRowTile, k] x packed^T. `scratch` holds scratchpad_bytes().
  absl::Status Run(const float* a, const float* packed, float* c, void* scratch) const;

 private:
  struct Impl;
  explicit TileGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace logitserve
