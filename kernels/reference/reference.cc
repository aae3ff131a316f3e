#include "kernels/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>

#include "logitserve/kernels/dtype.h"

namespace logitserve::reference {
namespace {

using kernels::SizeOf;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool HasNaN(std::span<const double> lp) {
  return std::any_of(lp.begin(), lp.end(), [](double x) { return std::isnan(x); });
}

// A row without any unmasked token (LogSoftmax gives NaN everywhere), or an empty row.
bool RowUndefined(std::span<const double> lp) { return lp.empty() || HasNaN(lp); }

// Upcasts n elements of a row exactly.
std::vector<double> Upcast(kernels::FloatType type, const void* row, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = kernels::LoadAsFloat(type, row, i);
  return out;
}

}  // namespace

bool IsMasked(double z, double max_z) {
  if (z == -kInf) return true;
  // The fast path works in fp32, where a finite logit below -FLT_MAX after temperature, or a
  // centred value z - M below -FLT_MAX, becomes -inf: SPEC §3 edge 6 defines those as masked.
  if (static_cast<float>(z) == -std::numeric_limits<float>::infinity()) return true;
  return static_cast<float>(z - max_z) == -std::numeric_limits<float>::infinity();
}

std::vector<double> LogSoftmax(std::span<const double> z) {
  std::vector<double> lp(z.size(), kNaN);
  double m = -kInf;
  for (double x : z) {
    if (x != -kInf && !(static_cast<float>(x) == -std::numeric_limits<float>::infinity())) {
      m = std::max(m, x);
    }
  }
  if (m == -kInf) return lp;  // no unmasked token (or empty row)
  // First pass found M; second pass sums exp(z - M) over unmasked tokens. Plain sum, long
  // double accumulator: over <= 1e6 terms in [0, 1] its error is far below anything fp32 sees.
  long double s = 0.0L;
  for (double x : z) {
    if (!IsMasked(x, m)) s += std::exp(x - m);
  }
  const double log_s = static_cast<double>(std::log(s));
  for (size_t j = 0; j < z.size(); ++j) {
    lp[j] = IsMasked(z[j], m) ? -kInf : (z[j] - m) - log_s;
  }
  return lp;
}

double Entropy(std::span<const double> lp) {
  if (RowUndefined(lp)) return kNaN;
  long double h = 0.0L;
  for (double x : lp) {
    if (x == -kInf) continue;  // masked: p = 0 and no contribution (0 * -inf skipped)
    h -= std::exp(x) * x;
  }
  return static_cast<double>(h);
}

double Kl(std::span<const double> lp_a, std::span<const double> lp_b) {
  if (RowUndefined(lp_a) || RowUndefined(lp_b)) return kNaN;
  long double kl = 0.0L;
  for (size_t j = 0; j < lp_a.size(); ++j) {
    if (lp_a[j] == -kInf) continue;     // a masks it: no contribution
    if (lp_b[j] == -kInf) return kInf;  // a supports, b masks (even if p_a underflows)
    kl += std::exp(lp_a[j]) * (lp_a[j] - lp_b[j]);
  }
  return static_cast<double>(kl);
}

double Jsd(std::span<const double> lp_s, std::span<const double> lp_t, double beta) {
  if (beta == 0.0) return Kl(lp_t, lp_s);
  if (beta == 1.0) return Kl(lp_s, lp_t);
  if (RowUndefined(lp_s) || RowUndefined(lp_t)) return kNaN;
  const double b = beta;
  const double log_b = std::log(b);
  const double log_1mb = std::log1p(-b);
  long double jsd = 0.0L;
  for (size_t j = 0; j < lp_s.size(); ++j) {
    const bool s_live = lp_s[j] != -kInf;
    const bool t_live = lp_t[j] != -kInf;
    if (!s_live && !t_live) continue;
    const double ls = lp_s[j];
    const double lt = lp_t[j];
    // log m = log((1 - beta) p_s + beta p_t), in log space.
    double log_m;
    if (!t_live) {
      log_m = log_1mb + ls;
    } else if (!s_live) {
      log_m = log_b + lt;
    } else {
      const double xs = log_1mb + ls;
      const double xt = log_b + lt;
      const double hi = std::max(xs, xt);
      log_m = hi + std::log1p(std::exp(std::min(xs, xt) - hi));
    }
    if (t_live) jsd += b * std::exp(lt) * (lt - log_m);
    if (s_live) jsd += (1.0 - b) * std::exp(ls) * (ls - log_m);
  }
  return static_cast<double>(jsd);
}

std::vector<TopKItem> TopK(std::span<const double> lp, int k) {
  const size_t n = std::min(lp.size(), static_cast<size_t>(std::max(k, 0)));
  std::vector<int32_t> ids(lp.size());
  std::iota(ids.begin(), ids.end(), 0);
  // Live tokens first (larger lp first, then smaller id); masked (-inf) and undefined (NaN)
  // tokens after them, by id.
  auto live = [&](int32_t i) { return lp[i] != -kInf && !std::isnan(lp[i]); };
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(),
                    [&](int32_t x, int32_t y) {
                      const bool lx = live(x);
                      const bool ly = live(y);
                      if (lx != ly) return lx;
                      if (lx && lp[x] != lp[y]) return lp[x] > lp[y];
                      return x < y;
                    });
  std::vector<TopKItem> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = TopKItem{ids[i], lp[ids[i]]};
  return out;
}

double TargetLogProb(std::span<const double> lp, int32_t id, int32_t ignore_index) {
  if (id == ignore_index) return 0.0;
  return lp[static_cast<size_t>(id)];
}

double TransformLogit(const Transform& transform, double dot, double bias, double temperature) {
  double x = dot + bias;
  if (transform.logit_scale != 1.0) x *= transform.logit_scale;
  if (transform.logits_scaling != 1.0) x /= transform.logits_scaling;
  if (transform.softcap > 0.0) {
    const double c = transform.softcap;
    x = c * std::tanh(x / c);
  }
  if (temperature != 1.0) x /= temperature;
  return x;
}

std::vector<double> LogitsRowLogits(kernels::FloatType type, const void* row, int64_t vocab,
                                    double temperature) {
  std::vector<double> z = Upcast(type, row, vocab);
  if (temperature != 1.0) {
    for (double& x : z) x /= temperature;
  }
  return z;
}

std::vector<double> HiddenRowLogits(const Head& head, kernels::FloatType h_type, const void* h_row,
                                    double temperature, double* dot_magnitude) {
  const int64_t hidden = head.hidden;
  const int64_t vocab = head.vocab;
  const std::vector<double> h = Upcast(h_type, h_row, hidden);
  const size_t row_bytes = static_cast<size_t>(hidden) * static_cast<size_t>(SizeOf(head.type));
  const uint8_t* weight = static_cast<const uint8_t*>(head.weight);
  std::vector<double> wj(static_cast<size_t>(hidden));
  std::vector<double> z(static_cast<size_t>(vocab));
  double magnitude = 0.0;
  for (int64_t j = 0; j < vocab; ++j) {
    const uint8_t* wrow = weight + static_cast<size_t>(j) * row_bytes;
    for (int64_t i = 0; i < hidden; ++i) wj[i] = kernels::LoadAsFloat(head.type, wrow, i);
    // Each product of two upcast fp32 values is exact in double (24 + 24 < 53 bits); the sum's
    // error (<= H * 2^-53 relative to sum |h W|) is invisible next to fp32's 2^-24.
    double dot = 0.0;
    double abs_sum = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      dot += h[i] * wj[i];
      abs_sum += std::abs(h[i] * wj[i]);
    }
    magnitude = std::max(magnitude, abs_sum);
    const double bias = head.bias.empty() ? 0.0 : static_cast<double>(head.bias[j]);
    z[j] = TransformLogit(head.transform, dot, bias, temperature);
  }
  if (dot_magnitude != nullptr) *dot_magnitude = magnitude;
  return z;
}

}  // namespace logitserve::reference
