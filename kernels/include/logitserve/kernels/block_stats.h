// The shared math of logitserve: per-block statistics of a logits row, the rule that combines
// blocks, and the final formulas. Used by the CPU kernels, the CUDA kernels and the tests, so the
// backends cannot drift apart. Everything here is plain arithmetic on floats, callable from host
// and device code; no allocation, no service types.
//
// Notation for one token row: z = logits over the vocabulary (after head transform and
// temperature), M = max z, S = sum exp(z - M), L = log S, lp_j = (z_j - M) - L.
// M and L are kept separate (never folded into one log-sum-exp): with a large common offset
// (+1e8) M + L would round away the information that (z_j - M) keeps exactly.
//
// Determinism: the vocabulary is cut into fixed blocks of kVocabBlock ids, independent of the
// shard count. Each block yields statistics computed in a fixed in-block order; blocks are folded
// in global block order with CombineInto. The same row therefore gives the same bits however the
// vocabulary is sharded and whatever else is in the batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define LOGITSERVE_HD __host__ __device__ __forceinline__
#else
#define LOGITSERVE_HD inline
#endif

namespace logitserve::kernels {

// Vocabulary block width. Shards always begin at a multiple of it.
inline constexpr int64_t kVocabBlock = 2048;

inline constexpr int64_t NumBlocks(int64_t vocab) {
  return (vocab + kVocabBlock - 1) / kVocabBlock;
}

// Flags raised while reading a block.
enum BlockFlag : uint32_t {
  kFlagNaN = 1u << 0,     // a NaN logit (input error)
  kFlagPosInf = 1u << 1,  // a +inf logit (input error)
  // For a pair (a, b): a token that a supports (finite a - m_a) while b masks it
  // (b == -inf or b - m_b overflows to -inf). Makes KL(a || b) = +inf.
  kFlagASupportsBMasked = 1u << 2,
  kFlagBSupportsAMasked = 1u << 3,
};

// Statistics of one distribution over one vocabulary block.
//   m = block max (-inf when every logit is masked),
//   s = sum exp(z - m), w = sum exp(z - m) (z - m)  (both over unmasked z).
// A logit is masked when z - m == -inf: z == -inf, or z - m overflows (z = -3e38, m = +3e38).
struct BlockStats {
  float m;
  float s;
  float w;
  uint32_t flags;
};

// Statistics of a pair of distributions a, b over the same block, for KL in both directions:
//   c_ab = sum exp(a - m_a) ((a - m_a) - (b - m_b)) over tokens a supports and b supports,
//   c_ba likewise with the roles swapped.
struct PairBlockStats {
  BlockStats a;
  BlockStats b;
  float c_ab;
  float c_ba;
};

LOGITSERVE_HD float NegInf() { return -std::numeric_limits<float>::infinity(); }
LOGITSERVE_HD float QuietNaN() { return std::numeric_limits<float>::quiet_NaN(); }

LOGITSERVE_HD BlockStats EmptyBlockStats() { return BlockStats{NegInf(), 0.0f, 0.0f, 0u}; }

// Global statistics of one distribution after all blocks are folded.
struct RowStats {
  float m;  // global max M
  float s;  // S = sum exp(z - M)
  float w;  // W = sum exp(z - M) (z - M)
  uint32_t flags;
};

// Running fold of blocks in global block order for one distribution.
// Rescales the accumulated sums once per block with a scalar exp (never per element).
// Guards every 0 * inf: a block whose max is -inf, or whose shift m_b - M overflows to -inf,
// contributes nothing, even though s_b * (m_b - M) would be 0 * -inf = NaN.
LOGITSERVE_HD void FoldBlock(RowStats& acc, const BlockStats& b) {
  acc.flags |= b.flags;
  if (!(b.s > 0.0f)) return;  // empty or fully masked block
  if (!(acc.s > 0.0f)) {      // first non-empty block
    acc.m = b.m;
    acc.s = b.s;
    acc.w = b.w;
    return;
  }
  if (b.m > acc.m) {
    // Re-centre the accumulator on the new max b.m.
    const float d = acc.m - b.m;  // < 0, may overflow to -inf
    const float e = std::exp(d);
    if (e > 0.0f) {
      acc.w = (acc.w + acc.s * d) * e + b.w;
      acc.s = acc.s * e + b.s;
    } else {  // the old part underflows (or its shift overflows): it acts as masked
      acc.w = b.w;
      acc.s = b.s;
    }
    acc.m = b.m;
  } else {
    const float d = b.m - acc.m;  // <= 0
    const float e = std::exp(d);
    if (e > 0.0f) {
      acc.w += (b.w + b.s * d) * e;
      acc.s += b.s * e;
    }
  }
}

LOGITSERVE_HD RowStats EmptyRowStats() { return RowStats{NegInf(), 0.0f, 0.0f, 0u}; }

// Running fold for KL between a and b. c_ab is re-centred on the global maxima of both a and b:
// (a - M_a) - (b - M_b) = (a - m_a) - (b - m_b) + (m_a - M_a) - (m_b - M_b), so a block adds
// exp(m_a - M_a) (c_ab + s_a ((m_a - M_a) - (m_b - M_b))) and earlier blocks are rescaled when
// either maximum grows. To keep that exact and simple, the fold keeps c relative to the block
// maxima it has seen and recentres by scalars only.
struct PairRowStats {
  RowStats a;
  RowStats b;
  float c_ab;  // sum exp(a - M_a) ((a - M_a) - (b - M_b)) over tokens both support
  float c_ba;
};

LOGITSERVE_HD PairRowStats EmptyPairRowStats() {
  return PairRowStats{EmptyRowStats(), EmptyRowStats(), 0.0f, 0.0f};
}

namespace detail {
// Folds one direction's cross term. acc_c is relative to (acc_ma, acc_mb) with mass acc_sa;
// block term c relative to (ma, mb) with mass sa. New maxima are (new_ma, new_mb).
// Returns the combined cross term relative to (new_ma, new_mb).
LOGITSERVE_HD float FoldCross(float acc_c, float acc_sa, float acc_ma, float acc_mb, float c,
                              float sa, float ma, float mb, float new_ma, float new_mb) {
  float out = 0.0f;
  if (acc_sa > 0.0f) {
    const float da = acc_ma - new_ma;  // <= 0
    const float e = std::exp(da);
    if (e > 0.0f) out += (acc_c + acc_sa * (da - (acc_mb - new_mb))) * e;
  }
  if (sa > 0.0f) {
    const float da = ma - new_ma;
    const float e = std::exp(da);
    if (e > 0.0f) out += (c + sa * (da - (mb - new_mb))) * e;
  }
  return out;
}
}  // namespace detail

// Folds a pair block. Order of operations is fixed, so folding blocks in global order gives the
// same bits on every rank.
LOGITSERVE_HD void FoldPairBlock(PairRowStats& acc, const PairBlockStats& b) {
  // New global maxima (a fully masked side keeps its accumulator's max).
  const float new_ma = (b.a.s > 0.0f && (!(acc.a.s > 0.0f) || b.a.m > acc.a.m)) ? b.a.m : acc.a.m;
  const float new_mb = (b.b.s > 0.0f && (!(acc.b.s > 0.0f) || b.b.m > acc.b.m)) ? b.b.m : acc.b.m;
  // Cross terms only count tokens both sides support, so a masked b-block never meets a live
  // a-token here (those raised kFlagASupportsBMasked instead). If b's side of the block is empty,
  // c_ab is 0 and mb - new_mb would be -inf - x: substitute new_mb to keep 0 * inf out.
  const float bm_b = (b.b.s > 0.0f) ? b.b.m : new_mb;
  const float bm_a = (b.a.s > 0.0f) ? b.a.m : new_ma;
  const float am_b = (acc.b.s > 0.0f) ? acc.b.m : new_mb;
  const float am_a = (acc.a.s > 0.0f) ? acc.a.m : new_ma;
  acc.c_ab =
      detail::FoldCross(acc.c_ab, acc.a.s, am_a, am_b, b.c_ab, b.a.s, bm_a, bm_b, new_ma, new_mb);
  acc.c_ba =
      detail::FoldCross(acc.c_ba, acc.b.s, am_b, am_a, b.c_ba, b.b.s, bm_b, bm_a, new_mb, new_ma);
  FoldBlock(acc.a, b.a);
  FoldBlock(acc.b, b.b);
}

// ---- Final formulas -----------------------------------------------------------------------

// True when the row has no unmasked token: every output that needs a distribution is NaN.
LOGITSERVE_HD bool AllMasked(const RowStats& r) { return !(r.s > 0.0f); }

// log p(t) = (z_t - M) - L. A masked token (z_t - M == -inf) gives -inf.
LOGITSERVE_HD float LogProb(float z_t, const RowStats& r) {
  if (AllMasked(r)) return QuietNaN();
  return (z_t - r.m) - std::log(r.s);
}

// H = L - W / S (W centred on M keeps the sum well conditioned).
LOGITSERVE_HD float Entropy(const RowStats& r) {
  if (AllMasked(r)) return QuietNaN();
  return std::log(r.s) - r.w / r.s;
}

// KL(a || b) = C_ab / S_a - L_a + L_b; +inf when a supports a token b masks.
LOGITSERVE_HD float KlFromPair(const RowStats& a, const RowStats& b, float c_ab,
                               uint32_t a_supports_b_masked_flag) {
  if (AllMasked(a) || AllMasked(b)) return QuietNaN();
  if ((a.flags | b.flags) & a_supports_b_masked_flag) return std::numeric_limits<float>::infinity();
  return c_ab / a.s - std::log(a.s) + std::log(b.s);
}

// KL(a || b) and KL(b || a) of a folded pair.
LOGITSERVE_HD float KlAB(const PairRowStats& p) {
  return KlFromPair(p.a, p.b, p.c_ab, kFlagASupportsBMasked);
}
LOGITSERVE_HD float KlBA(const PairRowStats& p) {
  return KlFromPair(p.b, p.a, p.c_ba, kFlagBSupportsAMasked);
}

// Normalisation of one row for the second (JSD) pass: lp_j = (z_j - m) - log_s.
struct RowNorm {
  float m;
  float log_s;
};

LOGITSERVE_HD RowNorm NormOf(const RowStats& r) { return RowNorm{r.m, std::log(r.s)}; }

// Shifted logits and log-probabilities are clamped to kClampShift before exp: exp(-200) is 0 in
// fp32 and 0 * -200 is 0, so masked tokens (-inf) drop out of exp-weighted sums with no select
// and no 0 * inf. (Any shift below about -104 already gives exp = 0 in fp32, so the clamp
// changes no sum.) Cross terms that multiply by a shift difference must NOT use the clamped
// values: a deep but finite logit is underflow, not masking.
inline constexpr float kClampShift = -200.0f;

// The per-token JSD_beta contributions (0 < beta < 1), student log-prob ls, teacher log-prob lt
// (already clamped to >= kClampShift; masked tokens sit at the clamp with probability 0):
//   p = exp(ls), q = exp(lt), m = max((1-beta) p + beta q, FLT_MIN)  (the mixture, linear space)
//   teacher part  q (lt - log m),  student part  p (ls - log m)
// A block's partial is beta * sum(teacher parts) + (1-beta) * sum(student parts). The floor on m
// only acts where p and q both underflow, where both parts are 0 * finite = 0. Under support
// mismatch lt - log m <= -log(beta) and ls - log m <= -log(1-beta): finite.
// The CPU (Highway) and CUDA kernels evaluate these expressions lane by lane (they may fuse a
// multiply and an add into one FMA).
struct JsdParts {
  float teacher;
  float student;
};
LOGITSERVE_HD JsdParts JsdToken(float ls, float lt, float beta) {
  const float p = std::exp(ls);
  const float q = std::exp(lt);
  float m = beta * q + (1.0f - beta) * p;
  if (!(m >= 1.17549435e-38f)) m = 1.17549435e-38f;
  const float log_m = std::log(m);
  return JsdParts{q * (lt - log_m), p * (ls - log_m)};
}

}  // namespace logitserve::kernels
