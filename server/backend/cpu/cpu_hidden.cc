#include "server/backend/cpu/cpu_hidden.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "logitserve/kernels/cpu_kernels.h"

namespace logitserve {

namespace k = kernels;

absl::StatusOr<std::shared_ptr<const CpuHead>> PrepareCpuHead(
    std::shared_ptr<const HeadWeights> weights, GemmPrecision precision, int threads) {
  const HeadWeights& w = *weights;
  const int64_t vocab = w.vocab_size, hidden = w.hidden_size;
  if (vocab < 1 || hidden < 1) return absl::InvalidArgumentError("head has an empty shape");
  if (static_cast<int64_t>(w.weight.size()) != vocab * hidden * k::SizeOf(w.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("head '", w.name, "': weight bytes mismatch"));
  }
  auto head = std::make_shared<CpuHead>(weights);
  LOGITSERVE_ASSIGN_OR_RETURN(auto full,
                              TileGemm::Create(precision, hidden, k::kVocabBlock, k::kVocabBlock));
  head->full_gemm = std::move(full);
  if (vocab % k::kVocabBlock != 0) {
    LOGITSERVE_ASSIGN_OR_RETURN(
        auto last, TileGemm::Create(precision, hidden, vocab % k::kVocabBlock, k::kVocabBlock));
    head->last_gemm = std::move(last);
  }
  const int64_t nb = k::NumBlocks(vocab);
  head->packed_blocks.resize(static_cast<size_t>(nb));
  std::vector<absl::Status> status(static_cast<size_t>(nb));
  const bool bf16 = precision == GemmPrecision::kBf16;
#pragma omp parallel num_threads(threads)
  {
    const size_t block_values = static_cast<size_t>(k::kVocabBlock * hidden);
    std::vector<float> plain(bf16 ? 0 : block_values);
    std::vector<uint16_t> parts(bf16 ? 3 * block_values : 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t n = BlockWidth(vocab, b);
      const uint8_t* src = w.weight.data() + b * k::kVocabBlock * hidden * k::SizeOf(w.dtype);
      const TileGemm& gemm = head->GemmFor(b);
      auto& packed_parts = head->packed_blocks[static_cast<size_t>(b)];
      auto pack = [&](const void* part) {
        auto packed = gemm.PackWeights(part);
        if (!packed.ok()) return packed.status();
        packed_parts.push_back(*std::move(packed));
        return absl::OkStatus();
      };
      absl::Status s;
      if (bf16) {
        const size_t m = static_cast<size_t>(n * hidden);
        const uint32_t nonzero = k::CpuSplitToBf16(w.dtype, src, n * hidden, parts.data(),
                                                   parts.data() + m, parts.data() + 2 * m);
        for (int p = 0; p < 3 && s.ok(); ++p) {
          if (nonzero & (1u << p)) s = pack(parts.data() + static_cast<size_t>(p) * m);
        }
      } else {
        k::CpuToFloat(w.dtype, src, n * hidden, 1.0f, plain.data());
        s = pack(plain.data());
      }
      status[static_cast<size_t>(b)] = s;
    }
  }
  for (const auto& s : status) {
    if (!s.ok()) return s;
  }
  head->bias = w.bias;
  return std::shared_ptr<const CpuHead>(std::move(head));
}

void HiddenTile::Convert(const MatrixView& in, GemmPrecision precision, int64_t row0, int64_t rows,
                         int threads) {
  const int64_t h = in.cols;
  const int64_t es = k::SizeOf(in.type);
  const auto* base = static_cast<const uint8_t*>(in.data) + row0 * h * es;
  const size_t values = static_cast<size_t>(kRowTile * h);
  const bool is_fp32 = precision == GemmPrecision::kFp32;
  hidden = h;
  // Sized once per job; every row a GEMM reads is written below (padding rows with zeros).
  if (is_fp32) {
    fp32.resize(values);
  } else {
    parts.resize(3 * values);
  }
  const int gemms = static_cast<int>((rows + kGemmRows - 1) / kGemmRows);
#pragma omp parallel for num_threads(std::max(1, std::min(threads, gemms))) schedule(static, 1)
  for (int g = 0; g < gemms; ++g) {
    const int64_t r0 = g * kGemmRows;
    const int64_t n = std::min(kGemmRows, rows - r0) * h;  // values of real rows
    const int64_t pad = kGemmRows * h - n;
    if (is_fp32) {
      float* dst = const_cast<float*>(Fp32(g));
      k::CpuToFloat(in.type, base + r0 * h * es, n, 1.0f, dst);
      std::fill_n(dst + n, pad, 0.0f);
    } else {
      auto part = [&](int p) { return const_cast<uint16_t*>(Part(g, p)); };
      nonzero[g] = k::CpuSplitToBf16(in.type, base + r0 * h * es, n, part(0), part(1), part(2));
      for (int p = 0; p < 3; ++p) std::fill_n(part(p) + n, pad, uint16_t{0});
    }
  }
}

absl::Status BlockGemm(const CpuHead& head, const HiddenTile& hidden_tile, int g, int64_t block,
                       int64_t vocab, float* scratch, GemmBuffers* gemm) {
  const TileGemm& tg = head.GemmFor(block);
  const auto& weight_parts = head.packed_blocks[static_cast<size_t>(block)];
  gemm->scratchpad.resize(std::max(gemm->scratchpad.size(), tg.scratchpad_bytes()));
  if (head.precision() == GemmPrecision::kFp32) {
    return tg.Run(hidden_tile.Fp32(g), weight_parts.front().data(), scratch,
                  gemm->scratchpad.data());
  }
  // bf16: sum over the (hidden part, weight part) pairs, hidden part major, in that fixed order.
  // A part left out (zero throughout the GEMM's rows or the block) would add exactly +0 to every
  // logit (a GEMM's accumulators start at +0, and no sum of them is -0), so leaving it out changes
  // no bit: a row's logits do not depend on which other rows share its GEMM.
  const int64_t n = BlockWidth(vocab, block);
  bool first = true;
  for (int i = 0; i < 3; ++i) {
    if (!(hidden_tile.nonzero[g] & (1u << i))) continue;
    for (const auto& w : weight_parts) {
      float* out = scratch;
      if (!first) {
        gemm->product.resize(static_cast<size_t>(kGemmRows * k::kVocabBlock));
        out = gemm->product.data();
      }
      LOGITSERVE_RETURN_IF_ERROR(
          tg.Run(hidden_tile.Part(g, i), w.data(), out, gemm->scratchpad.data()));
      if (!first) {
        for (int64_t r = 0; r < kGemmRows; ++r) {
          float* c = scratch + r * k::kVocabBlock;
          const float* q = out + r * k::kVocabBlock;
          for (int64_t j = 0; j < n; ++j) c[j] += q[j];
        }
      }
      first = false;
    }
  }
  if (first) {  // every part zero: so is every logit
    for (int64_t r = 0; r < kGemmRows; ++r) std::fill_n(scratch + r * k::kVocabBlock, n, 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace logitserve
