// fp64 expectations for the client end-to-end tests, computed from the request's own input
// values with the fp64 reference (kernels/reference), never from server output.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "client/client.h"

namespace logitserve::client::testing {

// Rows of logits in double, after the head transform and temperature (z / T).
using Rows = std::vector<std::vector<double>>;

struct Fp64Options {
  std::vector<int64_t> target_ids;  // [N * K], K = ids_per_row
  int ids_per_row = 0;
  int32_t ignore_index = -100;
  int top_k = 0;
  bool entropy = false;
  bool reference_entropy = false;
  bool forward_kl = false;
  bool reverse_kl = false;
  std::optional<double> jsd_beta;
  std::vector<int64_t> sequence_lengths;
};

// fp32 unit roundoff.
inline constexpr double kFp32Eps = 0x1.0p-24;
// Tolerance of one fp32 output against fp64, for a row of V logits spanning `range` nats
// (max |z - M| over unmasked tokens): every fp32 sum of V terms is within V u of its value
// (recursive summation bound), each exp/log/subtraction adds a few u of the magnitudes involved
// (<= 1 + |value| + range), and an output combines at most four such quantities (KL: lp of
// both sides and the weighted sum; JSD: the mixture as well), hence 4 (V + 16) u (1 + |v| + range).
double Fp32Tol(int64_t vocab, double range, double value);

// Checks every requested output of `out` against the fp64 reference on `model` (and
// `reference` when given) rows; `range` as for Fp32Tol. ADD_FAILUREs name the output and row.
void ExpectMatchesFp64(const ScoreOutput& out, const Rows& model, const Rows* reference,
                       const Fp64Options& options, double range);

// max |z - M| over unmasked tokens of any row.
double LogitRange(const Rows& rows);

// The same floats as bit patterns (NaN-safe exact comparison).
std::vector<uint32_t> Bits(const std::vector<float>& v);

}  // namespace logitserve::client::testing
