#include "client/cli/output.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_join.h"
#include "client/tensor.h"
#include "fmt/format.h"

namespace logitserve::client {
namespace {

nlohmann::ordered_json FloatJson(float v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

template <typename T>
void PutArray(nlohmann::ordered_json& obj, const char* name, const std::vector<T>& values) {
  if (values.empty()) return;
  nlohmann::ordered_json arr = nlohmann::ordered_json::array();
  for (const T& v : values) {
    if constexpr (std::is_same_v<T, float>) {
      arr.push_back(FloatJson(v));
    } else {
      arr.push_back(v);
    }
  }
  obj[name] = std::move(arr);
}

struct Column {
  std::string title;
  const std::vector<float>* values;
};

std::string HeadLabel(const std::string& name, uint64_t version) {
  return version == 0 ? name : fmt::format("{} (v{})", name, version);
}

// The outputs ScoreOutput and SequenceStatsOutput both hold, under the same names.
template <typename Outputs>
void PutPerTokenArrays(nlohmann::ordered_json& obj, const Outputs& x) {
  PutArray(obj, "target_logprobs", x.target_logprobs);
  PutArray(obj, "entropy", x.entropy);
  PutArray(obj, "reference_entropy", x.reference_entropy);
  PutArray(obj, "forward_kl", x.forward_kl);
  PutArray(obj, "reverse_kl", x.reverse_kl);
  PutArray(obj, "jsd", x.jsd);
}

}  // namespace

std::string FormatScoreTable(const v1::ScoreRequest& request, const ScoreOutput& out) {
  std::string s;
  const std::string model = request.head().empty()
                                ? std::string("model: raw logits")
                                : "model head " + HeadLabel(request.head(), out.head_version);
  std::string reference;
  if (!request.reference_head().empty()) {
    reference =
        " | reference head " + HeadLabel(request.reference_head(), out.reference_head_version);
  } else if (request.has_reference_logits()) {
    reference = " | reference: raw logits";
  }
  s += fmt::format("# {}{} | {} tokens | {} RPC{} | server queue {} us, compute {} us\n", model,
                   reference, out.rows, out.chunks, out.chunks == 1 ? "" : "s", out.queue_us,
                   out.compute_us);
  s += "# all values in nats (natural log); p = model distribution, q = reference distribution\n";
  if (!out.forward_kl.empty() || !out.reverse_kl.empty()) {
    s += "# fwd KL = KL(ref || model) = sum q (log q - log p); "
         "rev KL = KL(model || ref) = sum p (log p - log q)\n";
  }
  if (!out.jsd.empty()) {
    const float beta = request.jsd_beta();
    s += fmt::format(
        "# JSD = generalized Jensen-Shannon, beta = {:g}: m = {:g} p + {:g} q, "
        "JSD = {:g} KL(q || m) + {:g} KL(p || m)\n",
        beta, 1.0f - beta, beta, beta, 1.0f - beta);
  }

  std::vector<int64_t> ids;
  if (out.target_ids_per_row > 0) {
    if (absl::StatusOr<std::vector<int64_t>> v = IntsOf(request.target_ids()); v.ok()) {
      ids = *std::move(v);
    }
  }
  const int64_t big_k = out.target_ids_per_row;
  const bool single_target = big_k == 1 && ids.size() == out.target_logprobs.size();
  std::vector<Column> columns;
  if (!out.entropy.empty()) columns.push_back({"entropy", &out.entropy});
  if (!out.reference_entropy.empty()) columns.push_back({"ref entropy", &out.reference_entropy});
  if (!out.forward_kl.empty()) columns.push_back({"fwd KL", &out.forward_kl});
  if (!out.reverse_kl.empty()) columns.push_back({"rev KL", &out.reverse_kl});
  if (!out.jsd.empty()) columns.push_back({"JSD", &out.jsd});

  s += fmt::format("{:>6}", "token");
  if (single_target) s += fmt::format(" {:>9} {:>12}", "target", "logprob");
  for (const Column& c : columns) s += fmt::format(" {:>12}", c.title);
  if (!single_target && big_k > 0) s += "  targets (id:logprob)";
  if (out.top_k > 0) s += fmt::format("  top-{} (id:logprob)", out.top_k);
  s += "\n";

  for (int64_t r = 0; r < out.rows; ++r) {
    s += fmt::format("{:>6}", r);
    if (single_target) s += fmt::format(" {:>9} {:>12.6f}", ids[r], out.target_logprobs[r]);
    for (const Column& c : columns) s += fmt::format(" {:>12.6f}", (*c.values)[r]);
    if (!single_target && big_k > 0 &&
        out.target_logprobs.size() == static_cast<size_t>(out.rows * big_k)) {
      s += " ";
      for (int64_t j = 0; j < big_k; ++j) {
        const size_t i = r * big_k + j;
        s += fmt::format(" {}:{:.6f}", i < ids.size() ? fmt::format("{}", ids[i]) : "?",
                         out.target_logprobs[i]);
      }
    }
    if (out.top_k > 0 && out.top_k_ids.size() == static_cast<size_t>(out.rows * out.top_k)) {
      s += " ";
      for (uint32_t j = 0; j < out.top_k; ++j) {
        const size_t i = r * out.top_k + j;
        s += fmt::format(" {}:{:.6f}", out.top_k_ids[i], out.top_k_logprobs[i]);
      }
    }
    s += "\n";
  }

  if (out.sequence_sums.has_value()) {
    const SequenceStatsOutput& sums = *out.sequence_sums;
    s += "# per-sequence sums (rows whose targets are all ignored are not counted), nats\n";
    s += fmt::format("{:>8} {:>7}", "sequence", "tokens");
    std::vector<Column> sum_columns;
    if (big_k > 0) {
      for (int64_t j = 0; j < big_k; ++j) {
        s += fmt::format(" {:>12}",
                         big_k == 1 ? std::string("logprob") : fmt::format("logprob[{}]", j));
      }
    }
    if (!sums.entropy.empty()) sum_columns.push_back({"entropy", &sums.entropy});
    if (!sums.reference_entropy.empty()) {
      sum_columns.push_back({"ref entropy", &sums.reference_entropy});
    }
    if (!sums.forward_kl.empty()) sum_columns.push_back({"fwd KL", &sums.forward_kl});
    if (!sums.reverse_kl.empty()) sum_columns.push_back({"rev KL", &sums.reverse_kl});
    if (!sums.jsd.empty()) sum_columns.push_back({"JSD", &sums.jsd});
    for (const Column& c : sum_columns) s += fmt::format(" {:>12}", c.title);
    s += "\n";
    for (size_t q = 0; q < sums.token_count.size(); ++q) {
      s += fmt::format("{:>8} {:>7}", q, sums.token_count[q]);
      for (int64_t j = 0; j < big_k; ++j) {
        const size_t i = q * big_k + j;
        s += i < sums.target_logprobs.size() ? fmt::format(" {:>12.6f}", sums.target_logprobs[i])
                                             : fmt::format(" {:>12}", "-");
      }
      for (const Column& c : sum_columns) {
        s += q < c.values->size() ? fmt::format(" {:>12.6f}", (*c.values)[q])
                                  : fmt::format(" {:>12}", "-");
      }
      s += "\n";
    }
  }
  return s;
}

nlohmann::ordered_json ScoreToJson(const ScoreOutput& out) {
  nlohmann::ordered_json j;
  j["request_id"] = out.request_id;
  j["units"] = "nats";
  j["rows"] = out.rows;
  j["target_ids_per_row"] = out.target_ids_per_row;
  j["top_k"] = out.top_k;
  PutPerTokenArrays(j, out);
  PutArray(j, "top_k_ids", out.top_k_ids);
  PutArray(j, "top_k_logprobs", out.top_k_logprobs);
  for (const auto& [name, stats] : {std::pair{"sequence_sums", &out.sequence_sums},
                                    std::pair{"sequence_means", &out.sequence_means}}) {
    if (!stats->has_value()) continue;
    nlohmann::ordered_json obj = nlohmann::ordered_json::object();
    PutPerTokenArrays(obj, **stats);
    PutArray(obj, "token_count", (*stats)->token_count);
    j[name] = std::move(obj);
  }
  j["head_version"] = out.head_version;
  j["reference_head_version"] = out.reference_head_version;
  j["queue_us"] = out.queue_us;
  j["compute_us"] = out.compute_us;
  j["chunks"] = out.chunks;
  return j;
}

std::string FormatHeadsTable(const ListHeadsOutput& heads) {
  std::string s = fmt::format("# server logitserve {} (commit {})\n", heads.server_version,
                              heads.server_git_commit);
  s += fmt::format(
      "# backend {} | max top_k {} | max tokens per request {} | max message bytes {}\n",
      heads.backend, heads.max_top_k,
      heads.max_tokens_per_request > 0 ? fmt::format("{}", heads.max_tokens_per_request)
                                       : "unlimited",
      heads.max_receive_message_bytes > 0 ? fmt::format("{}", heads.max_receive_message_bytes)
                                          : "default");
  s += fmt::format("{:<20} {:>9} {:>7} {:>9} {:>8} {:>7}  {:<30} {}\n", "head", "vocab", "hidden",
                   "dtype", "version", "shards", "transform", "source");
  for (const HeadInfo& h : heads.heads) {
    std::vector<std::string> transform;
    if (h.has_bias) transform.push_back("bias");
    if (h.logit_scale != 1.0f) transform.push_back(fmt::format("*{:g}", h.logit_scale));
    if (h.logits_scaling != 1.0f) transform.push_back(fmt::format("/{:g}", h.logits_scaling));
    if (h.final_logit_softcapping > 0.0f) {
      transform.push_back(fmt::format("softcap {:g}", h.final_logit_softcapping));
    }
    s += fmt::format("{:<20} {:>9} {:>7} {:>9} {:>8} {:>7}  {:<30} {}\n", h.name, h.vocab_size,
                     h.hidden_size, DTypeName(h.dtype), h.version, h.shards.size(),
                     transform.empty() ? std::string("identity") : absl::StrJoin(transform, ", "),
                     h.source);
  }
  return s;
}

nlohmann::ordered_json HeadsToJson(const ListHeadsOutput& heads) {
  nlohmann::ordered_json j;
  j["server_version"] = heads.server_version;
  j["server_git_commit"] = heads.server_git_commit;
  j["backend"] = heads.backend;
  j["max_top_k"] = heads.max_top_k;
  j["max_tokens_per_request"] = heads.max_tokens_per_request;
  j["max_receive_message_bytes"] = heads.max_receive_message_bytes;
  j["heads"] = nlohmann::ordered_json::array();
  for (const HeadInfo& h : heads.heads) {
    nlohmann::ordered_json head;
    head["name"] = h.name;
    head["vocab_size"] = h.vocab_size;
    head["hidden_size"] = h.hidden_size;
    head["dtype"] = DTypeName(h.dtype);
    head["version"] = h.version;
    head["shards"] = nlohmann::ordered_json::array();
    for (const ShardRange& r : h.shards) {
      head["shards"].push_back(
          {{"shard", r.shard}, {"vocab_begin", r.vocab_begin}, {"vocab_end", r.vocab_end}});
    }
    head["has_bias"] = h.has_bias;
    head["logit_scale"] = h.logit_scale;
    head["logits_scaling"] = h.logits_scaling;
    head["final_logit_softcapping"] = h.final_logit_softcapping;
    head["source"] = h.source;
    j["heads"].push_back(std::move(head));
  }
  return j;
}

}  // namespace logitserve::client
