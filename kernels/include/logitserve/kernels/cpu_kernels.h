// CPU kernels (Google Highway SIMD, dispatched at run time to the best ISA of this CPU).
// Host launchers only: raw pointers and sizes, caller-owned memory, no allocation.
// Thread safety: every function is pure and may be called concurrently on disjoint outputs.
// Determinism: for a given CPU (ISA chosen once per process), each function's result depends only
// on its inputs, never on the caller's thread or on what else is being computed.
#pragma once

#include <cstdint>

#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/dtype.h"
#include "logitserve/kernels/logit_transform.h"

namespace logitserve::kernels {

// Converts n elements of `src` to fp32 into `dst`, then divides by `temperature` unless it is 1.
void CpuToFloat(FloatType type, const void* src, int64_t n, float temperature, float* dst);

// Splits n elements of `src` into three exact bf16 parts, x = hi + mid + lo (the bits of each
// part, truncation splits as the CUDA backend's LaunchSplitToBf16: hi keeps x's top 16 bits, mid
// the next 8 significant bits of the rest, lo what is left, exactly, for finite x outside the
// subnormal range), written to hi[i], mid[i], lo[i]. The bf16 GEMM of the CPU backend multiplies
// the parts, so equal values given as bf16, fp16 or fp32 have equal parts. Returns a bit mask of
// the parts holding a non-zero value (bit 0: hi, 1: mid, 2: lo); a part without one contributes
// exactly +0 to every product and may be skipped.
uint32_t CpuSplitToBf16(FloatType type, const void* src, int64_t n, uint16_t* hi, uint16_t* mid,
                        uint16_t* lo);

// Applies the head transform and temperature (logit_transform.h; hidden mode: every field but
// `head` is read, as if head were true) in place to a row of n raw logits (h . W^T), bias[j] for
// logit j. Logits mode needs only the temperature, which CpuToFloat divides by.
void CpuApplyTransform(const LogitTransform& t, float* z, int64_t n);

// Statistics of one distribution over one block of n <= kVocabBlock logits.
BlockStats CpuBlockStats(const float* z, int64_t n);

// Statistics of two distributions a, b over the same block, with the KL cross terms and the
// support-mismatch flags (see PairBlockStats).
PairBlockStats CpuPairBlockStats(const float* a, const float* b, int64_t n);

// Sum over one block of the JSD_beta terms (0 < beta < 1), student s and teacher t normalised by
// their global row statistics. Masked tokens contribute exactly 0.
float CpuJsdBlock(const float* s, const float* t, int64_t n, RowNorm ns, RowNorm nt, float beta);

// Keeps the k best (value, id) pairs seen so far, best first: larger value first, ties broken by
// the smaller id. A strict total order, so the final set does not depend on the order in which
// blocks are offered.
inline constexpr int kMaxTopK = 1024;
struct TopKEntry {
  float value;
  int32_t id;
};
LOGITSERVE_HD bool Better(const TopKEntry& x, const TopKEntry& y) {
  return x.value > y.value || (x.value == y.value && x.id < y.id);
}
// `list` has room for k entries, `*count` of them valid and sorted best first. Offers the n
// values z[0..n) with ids id0 + i. Masked tokens (-inf) rank last, by id, so a row with fewer
// than k unmasked tokens still yields k entries (their log-probabilities are -inf).
void CpuTopKBlock(const float* z, int64_t n, int32_t id0, int k, TopKEntry* list, int* count);
// Merges a sorted list of `other_count` entries into `list` (same contract as above).
void TopKMerge(const TopKEntry* other, int other_count, int k, TopKEntry* list, int* count);

}  // namespace logitserve::kernels
