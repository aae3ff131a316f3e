#include "server/service/validate.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "common/base/thread_name.h"
#include "common/wire/dtype.h"
#include "server/service/client_text.h"

namespace logitserve {

namespace {

static_assert(std::endian::native == std::endian::little,
              "Tensor.data is little-endian and is read in place");

constexpr int32_t kDefaultIgnoreIndex = -100;
// The hidden-state scan (CheckHiddenFinite): a thread per this many bytes, at most
// kMaxFiniteScanThreads (and half the cores). The client's pipelined chunks (4 MiB) scan on
// their receiving thread alone.
constexpr int64_t kFiniteScanBytesPerThread = int64_t{4} << 20;
constexpr int64_t kMaxFiniteScanThreads = 8;
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();

// Client-supplied shapes are quoted with at most kMaxQuotedDims dimensions (client_text.h).
std::string ShapeString(const v1::Tensor& t) { return ShapePrefix(t.shape()); }

enum class ElementKind { kFloat, kIndex };

// A checked tensor: its dims and where its bytes are (Tensor.data or shared memory).
struct CheckedTensor {
  std::vector<int64_t> dims;
  absl::string_view bytes;
};

// Checks dtype, rank, dims and byte length of `t` (in `data`, or the range it names in shared
// memory, resolved only once dtype and shape passed); returns its dims and bytes.
absl::StatusOr<CheckedTensor> CheckTensor(const v1::Tensor& t, absl::string_view field,
                                          ElementKind kind, int min_rank, int max_rank,
                                          absl::string_view layout,
                                          SharedMemoryResolver shared_memory) {
  const bool supported = kind == ElementKind::kFloat ? wire::FloatTypeOf(t.dtype()).has_value()
                                                     : wire::IsIndexDType(t.dtype());
  if (!supported) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype ", wire::DTypeName(t.dtype()), " is not supported (expected ",
        kind == ElementKind::kFloat ? "FLOAT32, BFLOAT16 or FLOAT16" : "INT32 or INT64", ")"));
  }
  const int rank = t.shape_size();
  if (rank < min_rank || rank > max_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", ShapeString(t), " has rank ", rank, ", expected ", layout));
  }
  int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    const int64_t dim = t.shape(i);
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dimension ", i, " of shape ", ShapeString(t), " is negative"));
    }
    if (__builtin_mul_overflow(elements, dim, &elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": shape ", ShapeString(t), " has too many elements"));
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(elements, wire::DTypeSize(t.dtype()), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape ", ShapeString(t), " has too many bytes"));
  }
  CheckedTensor checked{std::vector<int64_t>(t.shape().begin(), t.shape().end()), t.data()};
  if (t.has_shared_memory()) {
    const v1::SharedMemoryRef& ref = t.shared_memory();
    if (!t.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": data (", t.data().size(), " bytes) must be empty when shared_memory is set"));
    }
    if (ref.byte_size() != 0 && ref.byte_size() != static_cast<uint64_t>(bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shared_memory.byte_size: ", ref.byte_size(), " bytes, but shape ",
                       ShapeString(t), " of ", wire::DTypeName(t.dtype()), " needs ", bytes));
    }
    LOGITSERVE_ASSIGN_OR_RETURN(checked.bytes,
                                shared_memory(field, ref, static_cast<uint64_t>(bytes)));
    return checked;
  }
  if (static_cast<uint64_t>(bytes) != t.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", t.data().size(),
                                                   " bytes, but shape ", ShapeString(t), " of ",
                                                   wire::DTypeName(t.dtype()), " needs ", bytes));
  }
  return checked;
}

// REQUIRES: CheckTensor accepted `t` as a float tensor of rank 2 (`checked`).
MatrixView ViewOf(const v1::Tensor& t, const CheckedTensor& checked) {
  return MatrixView{*wire::FloatTypeOf(t.dtype()), checked.dims[0], checked.dims[1],
                    checked.bytes.data()};
}

// Returns the index of the first NaN / +-inf among n elements, or -1. The exponent field is all
// ones exactly for NaN and +-inf in every IEEE format, so the test is one mask per element.
template <typename Bits>
int64_t FirstNonFinite(const void* data, int64_t n, Bits exponent_mask) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof(Bits));
    if ((b & exponent_mask) == exponent_mask) return i;
  }
  return -1;
}

// Whether any of the n elements is NaN / +-inf. With the sign cleared, an element is NaN or
// +-inf exactly when it is >= `exponent_mask` (all exponent bits set); a max reduction over
// non-negative signed integers has no branch and vectorises even at SSE2.
template <typename Signed>
bool AnyNonFinite(const void* data, int64_t n, Signed exponent_mask) {
  constexpr Signed kAbsMask = std::numeric_limits<Signed>::max();
  const auto* p = static_cast<const unsigned char*>(data);
  Signed max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    Signed b;
    std::memcpy(&b, p + i * sizeof(Signed), sizeof(Signed));
    const Signed abs_bits = static_cast<Signed>(b & kAbsMask);
    max_abs = abs_bits > max_abs ? abs_bits : max_abs;
  }
  return max_abs >= exponent_mask;
}

// The first non-finite element of rows [row_begin, row_end) of `m`: {row, column}, or row -1.
struct NonFinite {
  int64_t row = -1;
  int64_t col = -1;
};
NonFinite FirstNonFiniteIn(const MatrixView& m, int64_t row_begin, int64_t row_end) {
  const int64_t item = kernels::SizeOf(m.type);
  const auto* base = static_cast<const unsigned char*>(m.data);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const void* row = base + r * m.cols * item;
    int64_t col = -1;
    switch (m.type) {
      case kernels::FloatType::kFloat32:
        if (AnyNonFinite<int32_t>(row, m.cols, 0x7f800000)) {
          col = FirstNonFinite<uint32_t>(row, m.cols, 0x7f800000u);
        }
        break;
      case kernels::FloatType::kBFloat16:
        if (AnyNonFinite<int16_t>(row, m.cols, 0x7f80)) {
          col = FirstNonFinite<uint16_t>(row, m.cols, 0x7f80u);
        }
        break;
      case kernels::FloatType::kFloat16:
        if (AnyNonFinite<int16_t>(row, m.cols, 0x7c00)) {
          col = FirstNonFinite<uint16_t>(row, m.cols, 0x7c00u);
        }
        break;
    }
    if (col >= 0) return NonFinite{r, col};
  }
  return NonFinite{};
}

// Hidden states must be finite: a NaN or +-inf would poison every logit of the row. The scan is
// memory-bound: one core reads ~8 GB/s (64 MiB of an 8192-row bf16 request at H = 4096 took
// 7.7 ms on the H200 machine, a third of the request's compute_us), so large tensors are
// scanned in row ranges on several threads; the lowest bad row is reported either way.
absl::Status CheckHiddenFinite(const MatrixView& m, absl::string_view field, int max_threads) {
  const int64_t bytes = m.rows * m.cols * kernels::SizeOf(m.type);
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t most =
      max_threads > 0 ? max_threads : std::min<int64_t>(kMaxFiniteScanThreads, hardware / 2);
  const int64_t threads = std::clamp<int64_t>(bytes / kFiniteScanBytesPerThread, 1,
                                              std::max<int64_t>(1, std::min(most, m.rows)));
  NonFinite bad;
  if (threads <= 1) {
    bad = FirstNonFiniteIn(m, 0, m.rows);
  } else {
    std::vector<NonFinite> found(static_cast<size_t>(threads));
    auto scan = [&](int64_t t) {
      if (t > 0) NameThisThread("ls-finite-scan");
      found[static_cast<size_t>(t)] =
          FirstNonFiniteIn(m, m.rows * t / threads, m.rows * (t + 1) / threads);
    };
    std::vector<std::thread> helpers;
    helpers.reserve(static_cast<size_t>(threads - 1));
    int64_t t = 1;
    try {
      for (; t < threads; ++t) helpers.emplace_back(scan, t);
    } catch (const std::system_error&) {  // no thread to be had: this one scans the rest
    }
    for (int64_t rest = t; rest < threads; ++rest) scan(rest);
    scan(0);
    for (std::thread& h : helpers) h.join();
    for (const NonFinite& f : found) {  // ranges in row order: the first found is the lowest
      if (f.row >= 0) {
        bad = f;
        break;
      }
    }
  }
  if (bad.row < 0) return absl::OkStatus();
  const void* row =
      static_cast<const unsigned char*>(m.data) + bad.row * m.cols * kernels::SizeOf(m.type);
  const float v = kernels::LoadAsFloat(m.type, row, bad.col);
  const char* what = std::isnan(v) ? "NaN" : (v > 0 ? "+inf" : "-inf");
  return absl::InvalidArgumentError(absl::StrCat(field, ": row ", bad.row, " contains ", what,
                                                 " (column ", bad.col,
                                                 "); hidden states must be finite"));
}

// Field names of one side (model or reference) of a request, for error messages.
struct SideNames {
  const char* head;
  const char* hidden;
  const char* logits;
  const char* version;
};
constexpr SideNames kModelNames{"head", "hidden", "logits", "head_version"};
constexpr SideNames kReferenceNames{"reference_head", "reference_hidden", "reference_logits",
                                    "reference_head_version"};

struct SideInput {
  const std::string& head;
  bool has_hidden;
  const v1::Tensor& hidden;
  bool has_logits;
  const v1::Tensor& logits;
  std::optional<uint64_t> version_pin;
};

// Validates one distribution's input; fills `out` (views, head, field) and its version and
// returns its [rows, vocab].
absl::StatusOr<std::pair<int64_t, int64_t>> ValidateSide(
    const SideInput& in, const SideNames& names, HeadResolver heads, const RequestLimits& limits,
    SharedMemoryResolver shared_memory, DistributionInput* out, uint64_t* version) {
  if (in.has_hidden == in.has_logits) {
    return absl::InvalidArgumentError(absl::StrCat("exactly one of ", names.hidden, " or ",
                                                   names.logits, " must be set, got ",
                                                   in.has_hidden ? "both" : "neither"));
  }
  if (in.has_logits) {
    if (!in.head.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(names.head, ": '", QuoteClientText(in.head),
                                                     "' must not be set with ", names.logits,
                                                     " (logits are scored without a head)"));
    }
    if (in.version_pin.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(names.version, ": set, but ", names.logits, " use no head"));
    }
    LOGITSERVE_ASSIGN_OR_RETURN(CheckedTensor checked,
                                CheckTensor(in.logits, names.logits, ElementKind::kFloat, 2, 2,
                                            "2 ([N, V])", shared_memory));
    const int64_t rows = checked.dims[0];
    const int64_t vocab = checked.dims[1];
    if (rows > limits.max_tokens_per_request) {
      return absl::ResourceExhaustedError(
          absl::StrCat(names.logits, ": ", rows, " rows exceed the server limit of ",
                       limits.max_tokens_per_request, " (--max-tokens-per-request)"));
    }
    if (vocab < 1 || vocab > kInt32Max) {
      return absl::InvalidArgumentError(absl::StrCat(names.logits, ": vocabulary size ", vocab,
                                                     " is outside [1, ", kInt32Max, "]"));
    }
    out->logits = ViewOf(in.logits, checked);
    out->field = names.logits;
    *version = 0;
    return std::make_pair(rows, vocab);
  }

  if (in.head.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(names.head, ": required with ", names.hidden));
  }
  LOGITSERVE_ASSIGN_OR_RETURN(
      CheckedTensor checked,
      CheckTensor(in.hidden, names.hidden, ElementKind::kFloat, 2, 2, "2 ([N, H])", shared_memory));
  const std::vector<int64_t>* dims = &checked.dims;
  const int64_t rows = (*dims)[0];
  if (rows > limits.max_tokens_per_request) {
    return absl::ResourceExhaustedError(
        absl::StrCat(names.hidden, ": ", rows, " rows exceed the server limit of ",
                     limits.max_tokens_per_request, " (--max-tokens-per-request)"));
  }
  std::shared_ptr<const PreparedHead> head = heads(in.head);
  if (head == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(names.head, ": no head named '", QuoteClientText(in.head), "'"));
  }
  const HeadWeights& w = head->weights();
  if (in.version_pin.has_value() && *in.version_pin != w.version) {
    return absl::FailedPreconditionError(
        absl::StrCat(names.version, ": pinned to ", *in.version_pin, ", but head '",
                     QuoteClientText(in.head), "' is at version ", w.version));
  }
  if ((*dims)[1] != w.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(names.hidden, ": width ", (*dims)[1], " != hidden size ", w.hidden_size,
                     " of ", names.head, " '", QuoteClientText(in.head), "'"));
  }
  out->hidden = ViewOf(in.hidden, checked);
  out->head = std::move(head);
  out->field = names.hidden;
  *version = w.version;
  return std::make_pair(rows, w.vocab_size);
}

absl::Status CheckTemperature(bool has, float t, absl::string_view field) {
  if (has && !(std::isfinite(t) && t > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must be finite and > 0, got ", t));
  }
  return absl::OkStatus();
}

absl::Status ConvertTargetIds(const v1::Tensor& t, int64_t rows, int64_t vocab,
                              int32_t ignore_index, int32_t max_ids_per_row,
                              SharedMemoryResolver shared_memory, ScoreJob* job) {
  LOGITSERVE_ASSIGN_OR_RETURN(CheckedTensor checked,
                              CheckTensor(t, "target_ids", ElementKind::kIndex, 1, 2,
                                          "1 ([N]) or 2 ([N, K])", shared_memory));
  const std::vector<int64_t>* dims = &checked.dims;
  if ((*dims)[0] != rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_ids: ", (*dims)[0], " rows != N = ", rows, " rows of the model input"));
  }
  // K is bounded before anything is sized by it: with N = 0 an [0, K] tensor has no bytes at
  // all, whatever K is, yet the per-sequence sums and the backends' per-tile buffers scale with K.
  const int64_t k = dims->size() == 2 ? (*dims)[1] : 1;
  if (k > max_ids_per_row) {
    return absl::InvalidArgumentError(absl::StrCat("target_ids: ", k, " ids per row (shape ",
                                                   ShapeString(t), ") exceed the server limit of ",
                                                   max_ids_per_row, " (--max-target-ids-per-row)"));
  }
  const int64_t n = rows * k;  // == product(shape), checked by CheckTensor
  job->ids_per_row = static_cast<int32_t>(k);
  job->target_ids.resize(n);
  const char* data = checked.bytes.data();
  const bool is64 = t.dtype() == v1::DATA_TYPE_INT64;
  for (int64_t i = 0; i < n; ++i) {
    int64_t id;
    if (is64) {
      std::memcpy(&id, data + i * 8, 8);
    } else {
      int32_t id32;
      std::memcpy(&id32, data + i * 4, 4);
      id = id32;
    }
    if (id < kInt32Min || id > kInt32Max) {
      return absl::InvalidArgumentError(absl::StrCat("target_ids: row ", i / k, ", column ", i % k,
                                                     ": id ", id, " does not fit in int32"));
    }
    if (id != ignore_index && (id < 0 || id >= vocab)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target_ids: row ", i / k, ", column ", i % k, ": id ", id, " is outside [0, ", vocab,
          ") and is not ignore_index (", ignore_index, ")"));
    }
    job->target_ids[i] = static_cast<int32_t>(id);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ValidatedRequest> ValidateScoreRequest(const v1::ScoreRequest& request,
                                                      HeadResolver heads,
                                                      const RequestLimits& limits) {
  return ValidateScoreRequest(
      request, heads, limits,
      [](absl::string_view field, const v1::SharedMemoryRef&,
         uint64_t) -> absl::StatusOr<absl::string_view> {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".shared_memory: shared-memory inputs are not available here"));
      });
}

absl::StatusOr<ValidatedRequest> ValidateScoreRequest(const v1::ScoreRequest& request,
                                                      HeadResolver heads,
                                                      const RequestLimits& limits,
                                                      SharedMemoryResolver shared_memory) {
  ValidatedRequest v;
  ScoreJob& job = v.job;

  // Model side: shape, head, version, limits.
  const SideInput model_in{
      request.head(),
      request.has_hidden(),
      request.hidden(),
      request.has_logits(),
      request.logits(),
      request.has_head_version() ? std::optional<uint64_t>(request.head_version()) : std::nullopt};
  LOGITSERVE_ASSIGN_OR_RETURN(auto model_shape,
                              ValidateSide(model_in, kModelNames, heads, limits, shared_memory,
                                           &job.model, &v.head_version));
  job.rows = model_shape.first;
  job.vocab = model_shape.second;

  // Scalar options.
  if (absl::Status s =
          CheckTemperature(request.has_temperature(), request.temperature(), "temperature");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckTemperature(request.has_reference_temperature(),
                                        request.reference_temperature(), "reference_temperature");
      !s.ok()) {
    return s;
  }
  job.model.temperature = request.has_temperature() ? request.temperature() : 1.0f;
  if (request.has_jsd_beta()) {
    const float beta = request.jsd_beta();
    if (!(beta >= 0.0f && beta <= 1.0f)) {  // also rejects NaN
      return absl::InvalidArgumentError(absl::StrCat("jsd_beta: must be in [0, 1], got ", beta));
    }
    job.jsd_beta = beta;
  }
  if (request.top_k() > static_cast<uint32_t>(limits.max_top_k)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: ", request.top_k(),
                                                   " exceeds the server limit of ",
                                                   limits.max_top_k, " (--max-top-k)"));
  }
  if (request.top_k() > job.vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: ", request.top_k(), " exceeds the vocabulary size ", job.vocab));
  }
  job.top_k = static_cast<int32_t>(request.top_k());
  job.entropy = request.entropy();
  job.reference_entropy = request.reference_entropy();
  job.forward_kl = request.forward_kl();
  job.reverse_kl = request.reverse_kl();

  // Reference side, only when an output needs it.
  if (job.NeedsReference()) {
    std::vector<std::string> users;
    if (job.reference_entropy) users.push_back("reference_entropy");
    if (job.forward_kl) users.push_back("forward_kl");
    if (job.reverse_kl) users.push_back("reverse_kl");
    if (job.jsd_beta.has_value()) users.push_back("jsd_beta");
    if (!request.has_reference_hidden() && !request.has_reference_logits()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference_hidden or reference_logits: required by ",
                       absl::StrJoin(users, ", "), ", but neither is set"));
    }
    const SideInput ref_in{request.reference_head(),
                           request.has_reference_hidden(),
                           request.reference_hidden(),
                           request.has_reference_logits(),
                           request.reference_logits(),
                           request.has_reference_head_version()
                               ? std::optional<uint64_t>(request.reference_head_version())
                               : std::nullopt};
    LOGITSERVE_ASSIGN_OR_RETURN(auto ref_shape,
                                ValidateSide(ref_in, kReferenceNames, heads, limits, shared_memory,
                                             &job.reference, &v.reference_head_version));
    if (ref_shape.first != job.rows) {
      return absl::InvalidArgumentError(absl::StrCat(job.reference.field, ": ", ref_shape.first,
                                                     " rows != ", job.rows, " rows of ",
                                                     job.model.field));
    }
    if (ref_shape.second != job.vocab) {
      return absl::InvalidArgumentError(absl::StrCat(job.reference.field, ": vocabulary size ",
                                                     ref_shape.second, " != model vocabulary size ",
                                                     job.vocab, " (of ", job.model.field, ")"));
    }
    job.reference.temperature =
        request.has_reference_temperature() ? request.reference_temperature() : 1.0f;
  }

  // Target ids.
  job.ignore_index = request.has_ignore_index() ? request.ignore_index() : kDefaultIgnoreIndex;
  if (request.has_target_ids()) {
    if (absl::Status s =
            ConvertTargetIds(request.target_ids(), job.rows, job.vocab, job.ignore_index,
                             limits.max_target_ids_per_row, shared_memory, &job);
        !s.ok()) {
      return s;
    }
  }

  // Sequence lengths.
  if (request.sequence_lengths_size() > 0) {
    // Zero-length sequences are allowed, so their count is not bounded by N; it is bounded by
    // the same limit as N (the response holds [S] and [S, K] sums).
    if (request.sequence_lengths_size() > limits.max_tokens_per_request) {
      return absl::ResourceExhaustedError(
          absl::StrCat("sequence_lengths: ", request.sequence_lengths_size(),
                       " sequences exceed the server limit of ", limits.max_tokens_per_request,
                       " (--max-tokens-per-request)"));
    }
    int64_t sum = 0;
    for (int i = 0; i < request.sequence_lengths_size(); ++i) {
      const int64_t len = request.sequence_lengths(i);
      if (len < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence_lengths: entry ", i, " is negative (", len, ")"));
      }
      if (__builtin_add_overflow(sum, len, &sum)) {
        return absl::InvalidArgumentError("sequence_lengths: sum overflows int64");
      }
    }
    if (sum != job.rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_lengths: sum ", sum, " != N = ", job.rows));
    }
    v.sequence_lengths.assign(request.sequence_lengths().begin(), request.sequence_lengths().end());
  }

  // Every output is one protobuf repeated field, which holds at most INT32_MAX values. With the
  // default limits the largest is 65536 x 1024; only raised limits can reach this.
  const int64_t sequences = request.sequence_lengths_size();
  for (const auto& [field, count] :
       {std::pair<const char*, int64_t>{"target_ids", job.rows * job.ids_per_row},
        {"top_k", job.rows * job.top_k},
        {"sequence_lengths", sequences * job.ids_per_row}}) {
    if (count > kInt32Max) {
      return absl::ResourceExhaustedError(absl::StrCat(
          field, ": the response would hold ", count,
          " values in one array, more than a protobuf repeated field can (", kInt32Max, ")"));
    }
  }
  return v;
}

absl::Status CheckHiddenStatesFinite(const ScoreJob& job, int max_threads) {
  for (const DistributionInput* in : {&job.model, &job.reference}) {
    if (!in->hidden_mode()) continue;
    LOGITSERVE_RETURN_IF_ERROR(CheckHiddenFinite(in->hidden, in->field, max_threads));
  }
  return absl::OkStatus();
}

}  // namespace logitserve
