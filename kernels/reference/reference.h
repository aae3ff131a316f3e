// The fp64 reference: the test oracle every backend is compared against.
//
// It is written independently of the fast path on purpose: no block statistics, no online
// rescaling, no fp32. Each row is a plain two-pass log-softmax in double (max, then a sum of
// exp), and every output is computed from the log-probabilities by its textbook definition
// (H = -sum p lp, KL = sum p_a (lp_a - lp_b), JSD through the mixture m). Only the semantics are
// shared with the fast path, and those come from SPEC §3, not from block_stats.h:
//   - a token is masked when its logit is -inf, or when z - max z overflows fp32 (a finite extreme
//     such as -3e38 beside +3e38, SPEC §3 edge 6); masked tokens have lp = -inf, p = 0 and
//     contribute nothing, even where a product would read 0 * inf;
//   - a row with no unmasked token has NaN log-probabilities, so entropy, KL and JSD are NaN;
//   - KL(a || b) = +inf when a supports a token that b masks, even when p_a underflows to 0
//     (the test is on lp, never on p);
//   - JSD_beta has explicit endpoints: beta = 0 is KL(teacher || student), beta = 1 is
//     KL(student || teacher).
// Inputs in bf16 / fp16 are upcast exactly (dtype.h), so the reference sees the very values the
// backend sees.
//
// It depends on nothing in server/: inputs are spans, raw rows and the plain structs below. The
// ScoreJob-level oracle the backend suites use (ScoreReference) is tests/reference/job_reference.h.
//
// Thread safety: every function is pure; call it from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "logitserve/kernels/dtype.h"

namespace logitserve::reference {

// True when token logit `z` is masked in a row whose maximum is `max_z` (see above).
bool IsMasked(double z, double max_z);

// Log-softmax of one row of logits: lp_j = (z_j - M) - log(sum_k exp(z_k - M)), M = max z,
// the sum over unmasked tokens. Masked tokens get -inf; a row without any unmasked token (or an
// empty row) gets NaN everywhere.
std::vector<double> LogSoftmax(std::span<const double> z);

// All functions below take log-probabilities as returned by LogSoftmax (-inf = masked,
// NaN = the row had no unmasked token).

// H = -sum_j p_j lp_j over unmasked j, in nats. NaN for an all-masked row.
double Entropy(std::span<const double> lp);

// KL(a || b) = sum_j p_a,j (lp_a,j - lp_b,j) over tokens a supports, in nats.
// +inf when a supports a token b masks; NaN when either row is all-masked.
double Kl(std::span<const double> lp_a, std::span<const double> lp_b);

// Generalized Jensen-Shannon divergence of student s and teacher t, in nats:
//   m = (1 - beta) p_s + beta p_t,  JSD = beta KL(t || m) + (1 - beta) KL(s || m).
// beta == 0 returns Kl(t, s) and beta == 1 returns Kl(s, t) (explicit endpoint branches).
// NaN when either row is all-masked. Finite under support mismatch for 0 < beta < 1.
double Jsd(std::span<const double> lp_s, std::span<const double> lp_t, double beta);

struct TopKItem {
  int32_t id;
  double logprob;
};

// The k largest log-probabilities, descending; ties broken by the smaller id; masked tokens
// rank after every unmasked one, among themselves by id. k is clamped to the row length.
// For an all-masked row the ids are 0..k-1 and the log-probabilities NaN.
std::vector<TopKItem> TopK(std::span<const double> lp, int k);

// lp[id], or exactly 0 when id == ignore_index. REQUIRES: id is ignore_index or in range.
double TargetLogProb(std::span<const double> lp, int32_t id, int32_t ignore_index);

// The head transform as plain numbers (the fields of HeadWeights' HeadTransform; the reference
// takes no type of the code it checks): z = softcap(scale(dot + bias)) / temperature.
struct Transform {
  double logit_scale = 1.0;     // multiplier (1 = none)
  double logits_scaling = 1.0;  // divisor (1 = none)
  double softcap = 0.0;         // c (0 = none)
};

// The head transform and temperature applied to one raw dot product h . W_j in double, in the
// order of Hugging Face's forward passes: x = dot + bias; x *= logit_scale; x /= logits_scaling;
// x = c tanh(x / c) when c = softcap > 0; x /= temperature.
double TransformLogit(const Transform& transform, double dot, double bias, double temperature);

// Logits mode: z_j = upcast(row[j]) / temperature for the `vocab` elements of `type` at `row`.
std::vector<double> LogitsRowLogits(kernels::FloatType type, const void* row, int64_t vocab,
                                    double temperature);

// One LM head as the reference reads it: row-major [vocab, hidden] elements of `type` (not
// owned), `bias` empty or `vocab` values.
struct Head {
  kernels::FloatType type = kernels::FloatType::kFloat32;
  int64_t vocab = 0;
  int64_t hidden = 0;
  const void* weight = nullptr;
  std::span<const float> bias;
  Transform transform;
};

// Hidden mode: z_j = TransformLogit(sum_i h_i W[j, i], bias_j, temperature) for one hidden row of
// `head.hidden` elements of `h_type`, the product summed in double over exactly upcast elements.
// When `dot_magnitude` is given it receives max_j sum_i |h_i W[j, i]|: the scale of an fp32 dot
// product's rounding error (|error| <= H u times it).
std::vector<double> HiddenRowLogits(const Head& head, kernels::FloatType h_type, const void* h,
                                    double temperature, double* dot_magnitude = nullptr);

}  // namespace logitserve::reference
