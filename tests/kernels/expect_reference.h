// Comparing a backend's ScoreResult with the fp64 reference, and with another ScoreResult bit for
// bit. The tolerances live here, once, each with its derivation.
//
// Error model. The backend computes in fp32 (unit roundoff u = 2^-24) and the reference in fp64
// on the very same input values, so the difference is the fast path's own rounding:
//   E  = error of one fp32 logit before any statistics (0 for logits at temperature 1; the
//        temperature division, the GEMM and the head transform otherwise; see RowScale);
//   z_j - M rounds by u |z_j - M| <= u (|lp_j| + L); p-weighted over a row that is <= u H;
//   S  = sum exp(z - M) (and W, the KL cross terms, the JSD sum) carry a relative error of at
//        most kSumRelTol, so L = log S is off by kSumRelTol (S >= 1) plus u log V.
// Each output's tolerance is that error propagated through its formula; see the functions below.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/backend.h"

namespace logitserve::testing {

// fp32 unit roundoff.
inline constexpr double kU = 0x1p-24;

// Relative error of the backend's fp32 sums over a row (S, W, the KL cross terms, the JSD sum):
// each exp within 4 ulp, plus the longest chain of dependent adds: 2048/8 per block on one SIMD
// lane (AVX2), a lane tree of 3, and <= 80 block folds (V <= 151936), each a rescale multiply and
// add. Worst case ~ 350 u; summation errors of same-sign terms grow like a random walk, so 64 u
// (~ 3.4 x sqrt(350) u) is a bound at many sigmas, still 5x tighter than the worst case.
inline constexpr double kSumRelTol = 64 * kU;

// Rounding of the head transform and temperature (bias add, scale, tanh to 4 ulp, two
// divisions), relative to the logit magnitude.
inline constexpr double kTransformRelTol = 8 * kU;

// A centred logit more than this below the row maximum has exp() == 0 in fp32 (e^-104 is below
// the smallest subnormal), so it contributes exactly nothing to any p-weighted sum of the fast
// path, and < 1e-40 to the reference's.
inline constexpr double kFp32ExpUnderflow = 104.0;

// Scale of one distribution's row, from the reference logits z (fp64, after transform and
// temperature) and the input that produced them.
struct RowScale {
  double max_centred = 0.0;  // min(max (M - z_j), kFp32ExpUnderflow) over unmasked j
  double input_error = 0.0;  // E = bound on |fp32 logit - exact logit|
};
// `dot_magnitude` as returned by reference::RowLogits.
RowScale ScaleOf(const DistributionInput& input, std::span<const double> z, double dot_magnitude);

// lp = (z - M) - L: z and M off by E each, L by E + kSumRelTol + u log V; z - M rounds by
// u (|lp| + L), the subtraction and the fp32 result by u |lp| each.
double LogprobTol(const RowScale& s, int64_t vocab, double ref);

// H = L - W/S: L off by kSumRelTol + u log V; W/S (|W/S| <= H) by 2 kSumRelTol H; input errors
// move H by at most 2 E sum p |lp| = 2 E H; z - M rounding adds u H, output rounding u H.
double EntropyTol(const RowScale& s, int64_t vocab, double ref_h);

// KL(a || b) = C/S_a - L_a + L_b with C's terms summing in absolute value to
// S_a (2 H_a + KL + L_a + L_b): relative sum error on that, kSumRelTol on each L; input errors
// 2 E (2 H_a + KL) + 4 E; the centrings round by u (2 H_a + KL), the logs and result by
// u (2 log V + KL).
double KlTol(const RowScale& a, const RowScale& b, int64_t vocab, double h_a, double ref_kl);

// JSD_beta, 0 < beta < 1: its derivative with respect to lp_s,j is (1-beta) p_s,j (ls_j - lm_j),
// and sum_j p_s,j |ls_j - lm_j| <= 1 - log(1-beta) (likewise for t), so every error of the
// log-probabilities (3 E + kSumRelTol + u (R + log V), R = RowScale::max_centred) enters
// multiplied by G = (1-beta)(1 - log(1-beta)) + beta(1 - log beta) <= 1.7; the fp32 sum of
// terms (sum |terms| <= G) adds kSumRelTol G; the fast log of the mixture (GPU) adds
// 2^-22 + 4 u log V.
double JsdTol(const RowScale& s, const RowScale& t, int64_t vocab, double beta, double ref_jsd);

// got (fp32) against ref (fp64): NaN must be NaN; a reference that is +-inf in fp32 must be that
// exact infinity; otherwise |got - ref| <= tol.
::testing::AssertionResult Near(float got, double ref, double tol);

// Compares every output the job requested with reference::ScoreReference: values within the
// tolerances above; top-k position by position the reference's ids, except that two ids whose
// fp64 log-probabilities are within their tolerances may come in either order unless they are a
// true tie (equal logits, or both masked): then the smaller id first, as the reference has it;
// ignored targets exactly +0.0. Reports at most a few failures per output.
void ExpectMatchesReference(const ScoreJob& job, const ScoreResult& got);

// Compares per-sequence sums over the consecutive sequences `lengths` (summing to job.rows) with
// fp64 sums of the reference's per-token values. `sums` is laid out like a ScoreResult over S
// sequences instead of N rows (logitserve.v1.SequenceSums: target_logprobs [S * K], the others
// [S], empty when not requested; no top-k); `token_count` [S] holds the rows counted. A row
// counts unless the job has target ids and every id of the row is ignore_index; an ignored id
// adds exactly 0. Tolerance: the sum of the counted rows' per-token tolerances above, plus the
// double accumulation and the final rounding to fp32 of the service's sum. With `means`, the
// values are the per-sequence means (sum / token_count, NaN when no row counts): the same
// tolerance divided by the count, plus one more fp32 rounding.
void ExpectSequenceSumsMatchReference(const ScoreJob& job, std::span<const int64_t> lengths,
                                      const ScoreResult& sums, std::span<const int64_t> token_count,
                                      bool means = false);

// `x` with its bit pattern, e.g. "0.5 (0x3f000000)", for failure messages.
std::string Bits(float x);

// Every output of a and b identical bit for bit (sizes included).
void ExpectBitwiseEqual(const ScoreResult& a, const ScoreResult& b);

// Row row_a of a and row row_b of b identical bit for bit in every output.
void ExpectRowBitwiseEqual(const ScoreResult& a, int64_t row_a, const ScoreResult& b, int64_t row_b,
                           int32_t ids_per_row, int32_t top_k);

// The largest err / tol seen so far for each output kind (a measure of how tight the
// tolerances are); printed at the end of every test program that links this file.
void RecordErrorRatio(const std::string& output, double ratio);

}  // namespace logitserve::testing
