#include "client/request_split.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <limits>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/tensor.h"
#include "common/base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/field_mask.pb.h"
#include "google/protobuf/util/field_mask_util.h"

namespace logitserve::client {
namespace {

struct RowTensor {
  absl::string_view field;
  const v1::Tensor* tensor;
};

// The row tensors the request actually sets (a default Tensor message means "absent").
std::vector<RowTensor> PresentRowTensors(const v1::ScoreRequest& r) {
  const std::array<RowTensor, 5> all = {{{"hidden", &r.hidden()},
                                         {"logits", &r.logits()},
                                         {"reference_hidden", &r.reference_hidden()},
                                         {"reference_logits", &r.reference_logits()},
                                         {"target_ids", &r.target_ids()}}};
  std::vector<RowTensor> present;
  for (const RowTensor& t : all) {
    if (t.tensor->shape_size() > 0 || t.tensor->dtype() != v1::DATA_TYPE_UNSPECIFIED ||
        !t.tensor->data().empty()) {
      present.push_back(t);
    }
  }
  return present;
}

// Bytes of one row of every present row tensor together; the tensors must be consistent.
absl::StatusOr<int64_t> BytesPerRow(const std::vector<RowTensor>& tensors, int64_t rows) {
  int64_t total = 0;
  for (const RowTensor& t : tensors) {
    LOGITSERVE_RETURN_IF_ERROR(CheckTensor(*t.tensor, t.field));
    if (t.tensor->shape_size() < 1 || t.tensor->shape(0) != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          t.field, ": first dimension ",
          t.tensor->shape_size() < 1 ? std::string("(none)") : absl::StrCat(t.tensor->shape(0)),
          " differs from the request's ", rows, " rows; cannot split the request"));
    }
    if (rows > 0) total += static_cast<int64_t>(t.tensor->data().size()) / rows;
  }
  return total;
}

template <typename Field>
void Append(std::vector<typename Field::value_type>& dst, const Field& src) {
  dst.insert(dst.end(), src.begin(), src.end());
}

// Chunks split at sequence boundaries, so a chunk's per-sequence values follow the previous ones.
void AppendStats(const v1::SequenceStats& in, std::optional<SequenceStatsOutput>& out) {
  if (!out.has_value()) out.emplace();
  Append(out->target_logprobs, in.target_logprobs());
  Append(out->entropy, in.entropy());
  Append(out->reference_entropy, in.reference_entropy());
  Append(out->forward_kl, in.forward_kl());
  Append(out->reverse_kl, in.reverse_kl());
  Append(out->jsd, in.jsd());
  Append(out->token_count, in.token_count());
}

// An array of `actual` elements is either absent (0) or `per_row` per row of the chunk.
absl::Status CheckSize(absl::string_view field, int64_t actual, int64_t rows, int64_t per_row) {
  if (actual == 0 || actual == rows * per_row) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("server response field ", field, " has ", actual,
                                          " values, expected ", rows * per_row));
}

}  // namespace

int64_t RequestRows(const v1::ScoreRequest& request) {
  if (request.hidden().shape_size() > 0) return request.hidden().shape(0);
  if (request.logits().shape_size() > 0) return request.logits().shape(0);
  return -1;
}

int64_t RowBytes(const v1::ScoreRequest& request) {
  const int64_t rows = RequestRows(request);
  if (rows <= 0) return 0;
  absl::StatusOr<int64_t> bytes = BytesPerRow(PresentRowTensors(request), rows);
  return bytes.ok() ? *bytes : 0;
}

std::string RebaseRowNumbers(absl::string_view message, int64_t first_row) {
  constexpr absl::string_view kRow = "row ";
  std::string out;
  size_t at = 0;
  while (at < message.size()) {
    const size_t hit = message.find(kRow, at);
    if (hit == absl::string_view::npos) break;
    size_t digits = hit + kRow.size();
    while (digits < message.size() && message[digits] >= '0' && message[digits] <= '9') ++digits;
    const bool word_start = hit == 0 || !std::isalnum(static_cast<unsigned char>(message[hit - 1]));
    int64_t row = 0;
    if (word_start && digits > hit + kRow.size() &&
        absl::SimpleAtoi(message.substr(hit + kRow.size(), digits - hit - kRow.size()), &row)) {
      absl::StrAppend(&out, message.substr(at, hit - at), kRow, row + first_row);
    } else {
      absl::StrAppend(&out, message.substr(at, digits - at));
    }
    at = digits;
  }
  absl::StrAppend(&out, message.substr(std::min(at, message.size())));
  return out;
}

absl::StatusOr<std::vector<RowChunk>> PlanChunks(const v1::ScoreRequest& request, int64_t max_rows,
                                                 int64_t max_bytes) {
  const int64_t rows = RequestRows(request);
  const RowChunk whole{0, std::max<int64_t>(rows, 0), 0, request.sequence_lengths_size()};
  const std::vector<RowTensor> tensors = PresentRowTensors(request);
  if (rows <= 0) return std::vector<RowChunk>{whole};

  int64_t limit = max_rows > 0 ? max_rows : std::numeric_limits<int64_t>::max();
  if (max_bytes > 0) {
    // Without consistent tensors the byte count is unknown; the server judges the request.
    absl::StatusOr<int64_t> row_bytes = BytesPerRow(tensors, rows);
    if (row_bytes.ok() && *row_bytes > 0) {
      const int64_t room = std::max<int64_t>(max_bytes - kMessageHeadroomBytes, *row_bytes);
      limit = std::min(limit, room / *row_bytes);
    }
  }
  if (rows <= limit) return std::vector<RowChunk>{whole};

  if (absl::StatusOr<int64_t> row_bytes = BytesPerRow(tensors, rows); !row_bytes.ok()) {
    return row_bytes.status();
  }
  std::vector<RowChunk> chunks;
  if (request.sequence_lengths_size() == 0) {
    for (int64_t begin = 0; begin < rows; begin += limit) {
      chunks.push_back({begin, std::min(rows, begin + limit), 0, 0});
    }
    return chunks;
  }

  // Whole sequences per chunk, packed greedily in order.
  int64_t sum = 0;
  for (int i = 0; i < request.sequence_lengths_size(); ++i) {
    const int64_t len = request.sequence_lengths(i);
    if (len < 0 || len > rows - sum) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_lengths: invalid length ", len, " at sequence ", i,
                       " (lengths must be >= 0 and sum to the ", rows, " rows)"));
    }
    if (len > limit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence_lengths: sequence ", i, " has ", len, " rows, more than the ", limit,
          " rows the server accepts per request (max_tokens_per_request or message size); "
          "split the sequence or raise the server limit"));
    }
    sum += len;
  }
  if (sum != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_lengths: lengths sum to ", sum, ", not to the ", rows, " rows"));
  }
  RowChunk current{0, 0, 0, 0};
  for (int i = 0; i < request.sequence_lengths_size(); ++i) {
    const int64_t len = request.sequence_lengths(i);
    if (current.rows() + len > limit) {
      chunks.push_back(current);
      current = {current.row_end, current.row_end, i, i};
    }
    current.row_end += len;
    current.seq_end = i + 1;
  }
  chunks.push_back(current);
  return chunks;
}

v1::ScoreRequest RequestWithoutRows(const v1::ScoreRequest& request) {
  // The mask names every top-level field but the row ones, so no row byte is read or copied.
  static const google::protobuf::FieldMask* const kMask = [] {
    auto* mask = new google::protobuf::FieldMask();
    const google::protobuf::Descriptor* d = v1::ScoreRequest::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      const int number = d->field(i)->number();
      if (number == v1::ScoreRequest::kHiddenFieldNumber ||
          number == v1::ScoreRequest::kLogitsFieldNumber ||
          number == v1::ScoreRequest::kReferenceHiddenFieldNumber ||
          number == v1::ScoreRequest::kReferenceLogitsFieldNumber ||
          number == v1::ScoreRequest::kTargetIdsFieldNumber ||
          number == v1::ScoreRequest::kSequenceLengthsFieldNumber) {
        continue;
      }
      mask->add_paths(d->field(i)->name());
    }
    return mask;
  }();
  v1::ScoreRequest out;
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(
      request, *kMask, google::protobuf::util::FieldMaskUtil::MergeOptions(), &out);
  out.GetReflection()->MutableUnknownFields(&out)->MergeFrom(
      request.GetReflection()->GetUnknownFields(request));
  return out;
}

v1::ScoreRequest MakeChunkRequest(const v1::ScoreRequest& request,
                                  const v1::ScoreRequest& request_without_rows,
                                  const RowChunk& chunk) {
  v1::ScoreRequest out = request_without_rows;
  for (const RowTensor& t : PresentRowTensors(request)) {
    v1::Tensor slice = SliceRows(*t.tensor, chunk.row_begin, chunk.row_end);
    if (t.field == "hidden") {
      *out.mutable_hidden() = std::move(slice);
    } else if (t.field == "logits") {
      *out.mutable_logits() = std::move(slice);
    } else if (t.field == "reference_hidden") {
      *out.mutable_reference_hidden() = std::move(slice);
    } else if (t.field == "reference_logits") {
      *out.mutable_reference_logits() = std::move(slice);
    } else {
      *out.mutable_target_ids() = std::move(slice);
    }
  }
  for (int64_t s = chunk.seq_begin; s < chunk.seq_end; ++s) {
    out.add_sequence_lengths(request.sequence_lengths(static_cast<int>(s)));
  }
  return out;
}

absl::Status AppendChunkResponse(const v1::ScoreResponse& response, const RowChunk& chunk,
                                 ScoreOutput& out) {
  if (out.chunks == 0) {
    out.request_id = response.request_id();
    out.target_ids_per_row = response.target_ids_per_row();
    out.top_k = response.top_k();
    out.head_version = response.head_version();
    out.reference_head_version = response.reference_head_version();
  } else if (response.target_ids_per_row() != out.target_ids_per_row ||
             response.top_k() != out.top_k) {
    return absl::InternalError(
        absl::StrCat("chunk at row ", chunk.row_begin,
                     " came back with K=", response.target_ids_per_row(), ", k=", response.top_k(),
                     " but earlier chunks had K=", out.target_ids_per_row, ", k=", out.top_k));
  }
  const int64_t n = chunk.rows();
  const int64_t big_k = response.target_ids_per_row();
  const int64_t k = response.top_k();
  for (absl::Status s : {CheckSize("target_logprobs", response.target_logprobs_size(), n, big_k),
                         CheckSize("top_k_ids", response.top_k_ids_size(), n, k),
                         CheckSize("top_k_logprobs", response.top_k_logprobs_size(), n, k),
                         CheckSize("entropy", response.entropy_size(), n, 1),
                         CheckSize("reference_entropy", response.reference_entropy_size(), n, 1),
                         CheckSize("forward_kl", response.forward_kl_size(), n, 1),
                         CheckSize("reverse_kl", response.reverse_kl_size(), n, 1),
                         CheckSize("jsd", response.jsd_size(), n, 1)}) {
    LOGITSERVE_RETURN_IF_ERROR(s);
  }
  out.rows += n;
  Append(out.target_logprobs, response.target_logprobs());
  Append(out.top_k_ids, response.top_k_ids());
  Append(out.top_k_logprobs, response.top_k_logprobs());
  Append(out.entropy, response.entropy());
  Append(out.reference_entropy, response.reference_entropy());
  Append(out.forward_kl, response.forward_kl());
  Append(out.reverse_kl, response.reverse_kl());
  Append(out.jsd, response.jsd());
  if (response.has_sequence_sums()) AppendStats(response.sequence_sums(), out.sequence_sums);
  if (response.has_sequence_means()) AppendStats(response.sequence_means(), out.sequence_means);
  out.queue_us += response.queue_us();
  out.compute_us += response.compute_us();
  ++out.chunks;
  return absl::OkStatus();
}

}  // namespace logitserve::client
