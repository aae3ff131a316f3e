#include "server/heads/head_loader.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status_macros.h"
#include "common/safetensors/float_type.h"
#include "server/heads/hf_checkpoint.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

using kernels::FloatType;

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

// Synthetic weight i, as fp32: a pure function of (key, i): the SplitMix64 stream at position
// i, its four 16-bit lanes summed (Irwin-Hall, n = 4), centred and scaled. Only integer
// arithmetic and correctly rounded IEEE operations are involved (and no FMA contraction: the
// build passes -ffp-contract=off), so every machine produces the same bits.
inline float SyntheticWeight(uint64_t key, uint64_t i, double scale) {
  const uint64_t r = Mix64(key + (i + 1) * kGolden);
  const int64_t sum = static_cast<int64_t>(r & 0xffff) + static_cast<int64_t>((r >> 16) & 0xffff) +
                      static_cast<int64_t>((r >> 32) & 0xffff) + static_cast<int64_t>(r >> 48);
  constexpr int64_t kMean = 2 * 65535;  // of the sum of four uniforms on {0..65535}
  return static_cast<float>(static_cast<double>(sum - kMean) * scale);
}

template <FloatType kType>
void FillSyntheticRowsAs(uint64_t key, int64_t hidden, double scale, int64_t row_begin,
                         int64_t row_end, uint8_t* weight) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    uint8_t* out = weight + row * hidden * kernels::SizeOf(kType);
    for (int64_t col = 0; col < hidden; ++col) {
      const float value = SyntheticWeight(key, static_cast<uint64_t>(row * hidden + col), scale);
      if constexpr (kType == FloatType::kFloat32) {
        std::memcpy(out + col * 4, &value, 4);
      } else {
        const uint16_t bits = kType == FloatType::kBFloat16 ? kernels::FloatToBFloat16(value)
                                                            : kernels::FloatToFloat16(value);
        std::memcpy(out + col * 2, &bits, 2);
      }
    }
  }
}

// Writes rows [row_begin, row_end) of a synthetic [*, hidden] head of `dtype`.
void FillSyntheticRows(uint64_t key, int64_t hidden, double scale, FloatType dtype,
                       int64_t row_begin, int64_t row_end, uint8_t* weight) {
  switch (dtype) {
    case FloatType::kFloat32:
      return FillSyntheticRowsAs<FloatType::kFloat32>(key, hidden, scale, row_begin, row_end,
                                                      weight);
    case FloatType::kBFloat16:
      return FillSyntheticRowsAs<FloatType::kBFloat16>(key, hidden, scale, row_begin, row_end,
                                                       weight);
    case FloatType::kFloat16:
      return FillSyntheticRowsAs<FloatType::kFloat16>(key, hidden, scale, row_begin, row_end,
                                                      weight);
  }
}

// Strict decimal: digits only (no sign, no spaces, no base prefix), no overflow.
bool ParseDecimal(absl::string_view text, uint64_t* value) {
  if (text.empty() || text.size() > 20) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(text, value);
}

}  // namespace

absl::Status ValidateHeadShape(absl::string_view name, int64_t vocab, int64_t hidden,
                               FloatType dtype) {
  if (vocab < 1 || vocab > kMaxHeadVocab) {
    return absl::InvalidArgumentError(absl::StrCat("head \"", name, "\": vocab size ", vocab,
                                                   " is outside [1, ", kMaxHeadVocab, "]"));
  }
  if (hidden < 1 || hidden > kMaxHeadHidden) {
    return absl::InvalidArgumentError(absl::StrCat("head \"", name, "\": hidden size ", hidden,
                                                   " is outside [1, ", kMaxHeadHidden, "]"));
  }
  // vocab * hidden * 4 <= 2^24 * 2^17 * 4 = 2^43: no overflow in int64.
  const int64_t bytes = vocab * hidden * kernels::SizeOf(dtype);
  if (bytes > kMaxHeadWeightBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("head \"", name, "\": [", vocab, ", ", hidden, "] ", FloatTypeName(dtype),
                     " weights are ", bytes, " bytes, over the limit of ", kMaxHeadWeightBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckHeadFinite(absl::string_view name, const HeadWeights& head) {
  const int64_t hidden = head.hidden_size;
  for (int64_t row = 0; row < head.vocab_size; ++row) {
    const uint8_t* p = head.weight.data() + row * hidden * kernels::SizeOf(head.dtype);
    bool bad = false;
    if (head.dtype == FloatType::kFloat32) {
      for (int64_t c = 0; c < hidden; ++c) {
        uint32_t u;
        std::memcpy(&u, p + 4 * c, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
      }
    } else {
      const uint16_t exp_mask = head.dtype == FloatType::kBFloat16 ? 0x7f80u : 0x7c00u;
      for (int64_t c = 0; c < hidden; ++c) {
        uint16_t u;
        std::memcpy(&u, p + 2 * c, 2);
        bad |= (u & exp_mask) == exp_mask;
      }
    }
    if (!bad) continue;
    for (int64_t c = 0; c < hidden; ++c) {
      const float v = kernels::LoadAsFloat(head.dtype, p, c);
      if (!std::isfinite(v)) {
        return absl::InvalidArgumentError(absl::StrCat("head \"", name, "\": weight [", row, ", ",
                                                       c, "] is ", v, " (must be finite)"));
      }
    }
  }
  for (size_t j = 0; j < head.bias.size(); ++j) {
    if (!std::isfinite(head.bias[j])) {
      return absl::InvalidArgumentError(absl::StrCat("head \"", name, "\": bias [", j, "] is ",
                                                     head.bias[j], " (must be finite)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadTransform(const HeadTransform& transform) {
  const auto positive = [](const char* field, float value) {
    if (std::isfinite(value) && value > 0.0f) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", value, " must be finite and > 0 (1 = none)"));
  };
  LOGITSERVE_RETURN_IF_ERROR(positive("logit_scale", transform.logit_scale));
  LOGITSERVE_RETURN_IF_ERROR(positive("logits_scaling", transform.logits_scaling));
  if (transform.logit_scale != 1.0f && transform.logits_scaling != 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logit_scale ", transform.logit_scale, " and logits_scaling ", transform.logits_scaling,
        " are both set; a head has at most one of them (Cohere multiplies by logit_scale, "
        "Granite divides by logits_scaling)"));
  }
  if (!(std::isfinite(transform.softcap) && transform.softcap >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("final_logit_softcapping ", transform.softcap,
                                                   " must be finite and >= 0 (0 = none)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("head name is empty");
  if (name.size() > kMaxHeadNameLength) {
    return absl::InvalidArgumentError(absl::StrCat("head name \"", name.substr(0, 32),
                                                   "...\" is longer than ", kMaxHeadNameLength,
                                                   " characters"));
  }
  for (char c : name) {
    const bool ok =
        absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("head name \"", absl::CHexEscape(name),
                                                     "\" has character '",
                                                     absl::CHexEscape(absl::string_view(&c, 1)),
                                                     "'; allowed: letters, digits, '.', '_', '-'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SyntheticHeadSpec> ParseSyntheticHeadSpec(absl::string_view spec) {
  const auto fail = [spec](absl::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat("--synthetic-head \"", absl::CHexEscape(spec), "\": ", problem,
                     " (expected NAME:vocab=V,hidden=H,seed=S[,dtype=bf16|fp16|fp32])"));
  };
  const size_t colon = spec.find(':');
  if (colon == absl::string_view::npos) return fail("missing ':' after the head name");
  SyntheticHeadSpec out;
  out.name = std::string(spec.substr(0, colon));
  if (absl::Status s = ValidateHeadName(out.name); !s.ok()) return fail(s.message());

  bool have_vocab = false, have_hidden = false, have_seed = false, have_dtype = false;
  for (absl::string_view field : absl::StrSplit(spec.substr(colon + 1), ',')) {
    const size_t eq = field.find('=');
    if (field.empty()) return fail("empty field");
    if (eq == absl::string_view::npos) {
      return fail(absl::StrCat("field \"", field, "\" is not KEY=VALUE"));
    }
    const absl::string_view key = field.substr(0, eq);
    const absl::string_view value = field.substr(eq + 1);
    bool* seen = nullptr;
    if (key == "vocab") seen = &have_vocab;
    if (key == "hidden") seen = &have_hidden;
    if (key == "seed") seen = &have_seed;
    if (key == "dtype") seen = &have_dtype;
    if (seen == nullptr) {
      return fail(absl::StrCat("unknown key \"", key, "\" (keys: vocab, hidden, seed, dtype)"));
    }
    if (*seen) return fail(absl::StrCat("key \"", key, "\" given twice"));
    *seen = true;
    if (key == "dtype") {
      if (value == "bf16") {
        out.dtype = FloatType::kBFloat16;
      } else if (value == "fp16") {
        out.dtype = FloatType::kFloat16;
      } else if (value == "fp32") {
        out.dtype = FloatType::kFloat32;
      } else {
        return fail(absl::StrCat("dtype \"", value, "\" is not bf16, fp16 or fp32"));
      }
      continue;
    }
    uint64_t number = 0;
    if (!ParseDecimal(value, &number)) {
      return fail(absl::StrCat(key, " \"", value, "\" is not a non-negative decimal integer"));
    }
    if (key == "seed") {
      out.seed = number;
      continue;
    }
    const int64_t limit = key == "vocab" ? kMaxHeadVocab : kMaxHeadHidden;
    if (number < 1 || number > static_cast<uint64_t>(limit)) {
      return fail(absl::StrCat(key, " ", value, " is outside [1, ", limit, "]"));
    }
    (key == "vocab" ? out.vocab : out.hidden) = static_cast<int64_t>(number);
  }
  if (!have_vocab) return fail("missing vocab=");
  if (!have_hidden) return fail("missing hidden=");
  if (!have_seed) return fail("missing seed=");
  return out;
}

absl::StatusOr<std::shared_ptr<HeadWeights>> MakeSyntheticHead(absl::string_view name,
                                                               int64_t vocab, int64_t hidden,
                                                               uint64_t seed, FloatType dtype) {
  LOGITSERVE_RETURN_IF_ERROR(ValidateHeadName(name));
  LOGITSERVE_RETURN_IF_ERROR(ValidateHeadShape(name, vocab, hidden, dtype));
  const auto start = std::chrono::steady_clock::now();

  auto head = std::make_shared<HeadWeights>();
  head->name = std::string(name);
  head->vocab_size = vocab;
  head->hidden_size = hidden;
  head->dtype = dtype;
  head->weight.resize(static_cast<size_t>(vocab * hidden * kernels::SizeOf(dtype)));
  head->source = absl::StrCat("synthetic:vocab=", vocab, ",hidden=", hidden, ",seed=", seed,
                              ",dtype=", FloatTypeName(dtype));

  // A sum of four uniforms on {0..65535} has variance 4 (65536^2 - 1) / 12; scale it to the
  // per-weight standard deviation kSyntheticLogitStd / sqrt(hidden). sqrt is correctly rounded.
  const double sum_std = std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
  const double scale = kSyntheticLogitStd / std::sqrt(static_cast<double>(hidden)) / sum_std;
  const uint64_t key = Mix64(seed);

  // Rows are independent, so threads split them freely without changing a bit.
  constexpr int64_t kElementsPerThread = int64_t{1} << 22;
  const int64_t wanted = (vocab * hidden) / kElementsPerThread;
  const int64_t threads = std::clamp<int64_t>(
      std::min<int64_t>(wanted, std::max(1u, std::thread::hardware_concurrency())), 1, vocab);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = vocab * t / threads;
    const int64_t end = vocab * (t + 1) / threads;
    try {
      workers.emplace_back(FillSyntheticRows, key, hidden, scale, dtype, begin, end,
                           head->weight.data());
    } catch (const std::system_error&) {  // no thread available: do the rows here instead
      FillSyntheticRows(key, hidden, scale, dtype, begin, end, head->weight.data());
    }
  }
  FillSyntheticRows(key, hidden, scale, dtype, 0, vocab / threads, head->weight.data());
  for (std::thread& w : workers) w.join();

  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("head {}: synthetic [{}, {}] {} seed {} built in {:.1f} ms", head->name, vocab,
               hidden, std::string(FloatTypeName(dtype)), seed, ms);
  return head;
}

absl::StatusOr<std::shared_ptr<HeadWeights>> MakeSyntheticHead(const SyntheticHeadSpec& spec) {
  return MakeSyntheticHead(spec.name, spec.vocab, spec.hidden, spec.seed, spec.dtype);
}

absl::StatusOr<std::shared_ptr<HeadWeights>> LoadSafetensorsHead(absl::string_view name,
                                                                 const std::string& path,
                                                                 absl::string_view tensor_name) {
  LOGITSERVE_RETURN_IF_ERROR(ValidateHeadName(name));
  const auto start = std::chrono::steady_clock::now();
  const auto fail = [&](absl::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat("head \"", name, "\" from ", path, ":", tensor_name, ": ", problem));
  };

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("head \"", name, "\": ", file.status().message()));
  }
  absl::StatusOr<const SafetensorsTensor*> found = file->Get(tensor_name);
  if (!found.ok()) return fail(found.status().message());  // lists the available names
  const SafetensorsTensor& tensor = **found;

  const std::optional<FloatType> dtype = FloatTypeFromSafetensors(tensor.dtype);
  if (!dtype.has_value()) {
    return fail(absl::StrCat("dtype ", SafetensorsDTypeName(tensor.dtype),
                             " is not a head weight type (BF16, F16 or F32)"));
  }
  if (tensor.shape.size() != 2) {
    return fail(absl::StrCat("tensor has rank ", tensor.shape.size(), " (shape [",
                             absl::StrJoin(tensor.shape, ", "),
                             "]); a head is a 2-D [vocab, hidden] matrix"));
  }
  const int64_t vocab = tensor.shape[0];
  const int64_t hidden = tensor.shape[1];
  if (absl::Status s = ValidateHeadShape(name, vocab, hidden, *dtype); !s.ok()) {
    return fail(s.message());
  }

  auto head = std::make_shared<HeadWeights>();
  head->name = std::string(name);
  head->vocab_size = vocab;
  head->hidden_size = hidden;
  head->dtype = *dtype;
  head->weight.assign(tensor.data, tensor.data + tensor.bytes);
  head->source = absl::StrCat(path, ":", tensor_name);
  if (absl::Status s = CheckHeadFinite(name, *head); !s.ok()) return fail(s.message());

  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("head {}: [{}, {}] {} loaded from {} in {:.1f} ms", head->name, vocab, hidden,
               std::string(FloatTypeName(*dtype)), head->source, ms);
  return head;
}

absl::StatusOr<HeadFileSpec> ParseHeadFileSpec(absl::string_view flag) {
  const auto fail = [flag](absl::string_view problem) {
    return absl::InvalidArgumentError(absl::StrCat("--head \"", absl::CHexEscape(flag),
                                                   "\": ", problem,
                                                   " (expected NAME=FILE.safetensors:TENSOR or "
                                                   "NAME=DIR, a Hugging Face model folder)"));
  };
  const size_t eq = flag.find('=');
  if (eq == absl::string_view::npos) return fail("missing '=' after the head name");
  HeadFileSpec out;
  out.name = std::string(flag.substr(0, eq));
  if (absl::Status s = ValidateHeadName(out.name); !s.ok()) return fail(s.message());
  const absl::string_view rest = flag.substr(eq + 1);
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) {
    return fail("missing ':TENSOR' after the file (and it is not a model folder)");
  }
  out.path = std::string(rest.substr(0, colon));
  out.tensor = std::string(rest.substr(colon + 1));
  if (out.path.empty()) return fail("empty file path");
  if (out.tensor.empty()) return fail("empty tensor name");
  return out;
}

absl::StatusOr<std::shared_ptr<HeadWeights>> ParseHeadFlag(absl::string_view flag) {
  // A directory is a Hugging Face folder even when its path holds ':' (checked first for that
  // reason); anything else must be FILE:TENSOR.
  const size_t eq = flag.find('=');
  if (eq != absl::string_view::npos) {
    const std::string path(flag.substr(eq + 1));
    std::error_code error;
    if (!path.empty() && std::filesystem::is_directory(path, error)) {
      return LoadHfHead(flag.substr(0, eq), path);
    }
  }
  LOGITSERVE_ASSIGN_OR_RETURN(HeadFileSpec spec, ParseHeadFileSpec(flag));
  return LoadSafetensorsHead(spec.name, spec.path, spec.tensor);
}

}  // namespace logitserve
