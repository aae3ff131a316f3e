// Hidden mode on the CPU backend: a head packed for its per-block GEMMs (CpuHead), a row tile of
// hidden states as those GEMMs take them (HiddenTile), and the logits of one GEMM's rows of one
// vocabulary block (BlockGemm): in bf16 precision the sum of the (hidden part, weight part)
// products of their exact bf16 parts (cpu_tile_gemm.h says why), in fp32 one product.
//
// Thread safety: a prepared CpuHead is immutable and shared; a HiddenTile is written by Convert
// (which runs its own OpenMP workers) and then only read; BlockGemm may run concurrently on one
// tile and head, each caller with its own GemmBuffers and output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "logitserve/kernels/block_stats.h"
#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_tile_gemm.h"
#include "server/heads/head_weights.h"

namespace logitserve {

// Columns of vocabulary block `block` (the last one may be short).
inline int64_t BlockWidth(int64_t vocab, int64_t block) {
  return std::min(kernels::kVocabBlock, vocab - block * kernels::kVocabBlock);
}

// A head resident for the CPU backend: fp32 bias and, per vocabulary block, weights packed for
// the block's TileGemm (one primitive for full blocks, one for a shorter last block). In bf16
// precision a block holds the exact bf16 parts of its weights (one for a bf16 head; fp16 / fp32
// heads up to three, parts that are zero throughout the block left out); in fp32, one fp32 part.
class CpuHead final : public PreparedHead {
 public:
  using PreparedHead::PreparedHead;
  std::unique_ptr<TileGemm> full_gemm;  // n = kVocabBlock
  std::unique_ptr<TileGemm> last_gemm;  // n = vocab % kVocabBlock, when not 0
  std::vector<std::vector<std::vector<uint8_t>>> packed_blocks;  // [block][part]
  std::vector<float> bias;                                       // empty or vocab

  // Both primitives run the precision the head was prepared for.
  GemmPrecision precision() const { return full_gemm->precision(); }
  const TileGemm& GemmFor(int64_t block) const {
    const int64_t nb = static_cast<int64_t>(packed_blocks.size());
    return (block == nb - 1 && last_gemm) ? *last_gemm : *full_gemm;
  }
};

// Packs `weights` for GEMMs in `precision`, with `threads` OpenMP workers over the blocks.
// INVALID_ARGUMENT for an empty shape or weight bytes that do not match it.
absl::StatusOr<std::shared_ptr<const CpuHead>> PrepareCpuHead(
    std::shared_ptr<const HeadWeights> weights, GemmPrecision precision, int threads);

// One distribution's hidden states of a row tile, as its GEMMs take them: fp32 [kRowTile, H], or
// the exact bf16 parts [3][kRowTile, H] with, per GEMM of kGemmRows rows, the mask of parts
// holding a non-zero value. Rows past the tile's own are zero.
struct HiddenTile {
  static constexpr int kGemms = static_cast<int>(kRowTile / kGemmRows);
  int64_t hidden = 0;
  std::vector<float> fp32;
  std::vector<uint16_t> parts;
  uint32_t nonzero[kGemms] = {};

  // Rows [row0, row0 + rows) of `in` (rows <= kRowTile) in `precision`, split over `threads`.
  void Convert(const MatrixView& in, GemmPrecision precision, int64_t row0, int64_t rows,
               int threads);
  // The operand of the GEMM of rows [g kGemmRows, (g + 1) kGemmRows): fp32, or bf16 part p.
  const float* Fp32(int g) const { return fp32.data() + g * kGemmRows * hidden; }
  const uint16_t* Part(int g, int p) const {
    return parts.data() + (static_cast<size_t>(p) * kRowTile + g * kGemmRows) * hidden;
  }
};

// A caller's buffers for BlockGemm, kept across calls.
struct GemmBuffers {
  std::vector<uint8_t> scratchpad;
  std::vector<float> product;  // one bf16 part product, when a block has several
};

// out [kGemmRows, kVocabBlock] (the block's width used) = the logits before the transform of the
// tile's rows [g kGemmRows, (g + 1) kGemmRows) in block `block` of a head of `vocab` ids.
absl::Status BlockGemm(const CpuHead& head, const HiddenTile& tile, int g, int64_t block,
                       int64_t vocab, float* out, GemmBuffers* buffers);

}  // namespace logitserve
