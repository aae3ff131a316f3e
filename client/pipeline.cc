#include "client/pipeline.h"

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/request_split.h"
#include "client/tensor.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"

namespace logitserve::client {
namespace {

constexpr const char* kScoreStreamMethod = "/logitserve.v1.Scorer/ScoreStream";
constexpr int kTensorDataField = 3;     // Tensor.data
constexpr int kStreamRequestField = 1;  // ScoreStreamRequest.request
constexpr int kLengthDelimited = 2;     // protobuf wire type

void AppendVarint(uint64_t v, std::string& out) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void AppendTag(int field, std::string& out) {
  AppendVarint((static_cast<uint64_t>(field) << 3) | kLengthDelimited, out);
}

// What a call's reactor and the thread waiting for it share. Held by both (shared_ptr), so the
// waiter may return as soon as it sees `done`, while OnDone is still unlocking.
struct PipelineState {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  PipelineOutcome outcome ABSL_GUARDED_BY(mu);
};

// One ScoreStream call: writes the chunks one at a time (gRPC allows one outstanding write),
// at most `depth` unanswered, and reads their responses. Deletes itself in OnDone.
class PipelineReactor final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PipelineReactor(std::shared_ptr<PipelineState> state, grpc::ClientContext& context, size_t chunks,
                  absl::FunctionRef<grpc::ByteBuffer(size_t)> make_chunk, int depth)
      : state_(std::move(state)),
        context_(context),
        make_chunk_(make_chunk),
        chunks_(chunks),
        window_(static_cast<size_t>(depth < 1 ? 1 : depth)),
        answered_(chunks, false),
        responses_(chunks) {}

  // Starts the call; OnDone fills state->outcome and sets state->done.
  void Start(grpc::GenericStub& stub) {
    stub.PrepareBidiStreamingCall(&context_, kScoreStreamMethod, grpc::StubOptions(), this);
    bool write;
    {
      absl::MutexLock lock(&mu_);
      write = PrepareNextWriteLocked();
    }
    if (write) StartWrite(&write_buffer_);
    StartRead(&read_buffer_);
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    bool write = false, writes_done = false;
    {
      absl::MutexLock lock(&mu_);
      write_pending_ = false;
      write_buffer_.Clear();
      if (!ok) {
        stop_ = true;  // the call is over; OnDone says why
        return;
      }
      write = PrepareNextWriteLocked();
      writes_done = WritesDoneDueLocked(write);
    }
    if (write) StartWrite(&write_buffer_);
    if (writes_done) StartWritesDone();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    v1::ScoreStreamResponse response;
    const grpc::Status parsed =
        grpc::SerializationTraits<v1::ScoreStreamResponse>::Deserialize(&read_buffer_, &response);
    bool write = false, writes_done = false, cancel = false, read = false;
    {
      absl::MutexLock lock(&mu_);
      size_t index = 0;
      if (!parsed.ok() || !absl::SimpleAtoi(response.request_id(), &index) || index >= chunks_ ||
          answered_[index]) {
        Fail(0, absl::InternalError(absl::StrCat("ScoreStream answered an unknown chunk '",
                                                 response.request_id(), "'")));
        cancel = true;
      } else if (response.status_code() != 0) {
        const int code = response.status_code();
        Fail(static_cast<int64_t>(index),
             absl::Status(code >= 1 && code <= 16 ? static_cast<absl::StatusCode>(code)
                                                  : absl::StatusCode::kUnknown,
                          response.status_message()));
        cancel = true;
      } else {
        answered_[index] = true;
        responses_[index] = std::move(*response.mutable_response());
        ++received_;
        read = received_ < chunks_;
        write = PrepareNextWriteLocked();
        writes_done = WritesDoneDueLocked(write);
      }
    }
    if (cancel) {
      context_.TryCancel();  // the server drops what is queued; OnDone follows
      return;
    }
    if (write) StartWrite(&write_buffer_);
    if (writes_done) StartWritesDone();
    if (read) StartRead(&read_buffer_);
  }

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock reactor_lock(&mu_);
      absl::MutexLock lock(&state_->mu);
      PipelineOutcome& out = state_->outcome;
      out.stream_status = status;
      out.failed_chunk = failed_chunk_;
      out.chunk_error = chunk_error_;
      if (failed_chunk_ < 0 && status.ok()) {
        if (received_ < chunks_) {
          out.stream_status = grpc::Status(
              grpc::StatusCode::INTERNAL,
              absl::StrCat("ScoreStream ended after ", received_, " of ", chunks_, " chunks"));
        } else {
          out.responses = std::move(responses_);
        }
      }
      state_->done = true;
    }
    delete this;
  }

 private:
  // Fills write_buffer_ with the next chunk when the window allows; returns whether it did.
  bool PrepareNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stop_ || write_pending_ || next_ >= chunks_ || next_ - received_ >= window_) return false;
    write_buffer_ = make_chunk_(next_);
    ++next_;
    write_pending_ = true;
    return true;
  }

  // Whether to half-close now: every chunk written, none pending, not yet half-closed.
  bool WritesDoneDueLocked(bool writing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing || write_pending_ || stop_ || next_ < chunks_ || writes_done_) return false;
    writes_done_ = true;
    return true;
  }

  void Fail(int64_t chunk, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stop_ = true;
    if (failed_chunk_ < 0) {
      failed_chunk_ = chunk;
      chunk_error_ = std::move(status);
    }
  }

  const std::shared_ptr<PipelineState> state_;
  grpc::ClientContext& context_;
  const absl::FunctionRef<grpc::ByteBuffer(size_t)> make_chunk_;
  const size_t chunks_;
  const size_t window_;
  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;      // chunks handed to StartWrite
  size_t received_ ABSL_GUARDED_BY(mu_) = 0;  // successful responses
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<bool> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ScoreResponse> responses_ ABSL_GUARDED_BY(mu_);
  int64_t failed_chunk_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Status chunk_error_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer write_buffer_;  // one write at a time (write_pending_)
  grpc::ByteBuffer read_buffer_;   // one read at a time
};

}  // namespace

namespace {

// Appends one more occurrence of the Tensor field `field` holding only `bytes` as its data: a
// prefix slice (tags and lengths) and a slice pointing at `bytes`. Returns the bytes appended.
size_t AppendDataOccurrence(int field, absl::string_view bytes, SliceLease& lease,
                            std::vector<grpc::Slice>& slices) {
  std::string inner;
  AppendTag(kTensorDataField, inner);
  AppendVarint(bytes.size(), inner);
  std::string prefix;
  AppendTag(field, prefix);
  AppendVarint(inner.size() + bytes.size(), prefix);
  prefix += inner;
  const size_t appended = prefix.size() + bytes.size();
  slices.emplace_back(std::move(prefix));
  if (!bytes.empty()) slices.push_back(lease.Wrap(bytes));
  return appended;
}

// The slices of the ScoreRequest carrying rows `chunk` of `request` (see ChunkBytes), after
// `reserved` empty leading slices; returns the message's byte length (reserved slices excluded).
size_t RequestSlices(const v1::ScoreRequest& request, const v1::ScoreRequest& request_without_rows,
                     const RowChunk& chunk, const std::string* request_id, size_t reserved,
                     SliceLease& lease, std::vector<grpc::Slice>& slices) {
  v1::ScoreRequest header = request_without_rows;
  if (request_id != nullptr) header.set_request_id(*request_id);
  for (int64_t s = chunk.seq_begin; s < chunk.seq_end; ++s) {
    header.add_sequence_lengths(request.sequence_lengths(static_cast<int>(s)));
  }
  // ScoreRequest field numbers of the row tensors; mutable_*() only for those present (it sets
  // the field's presence).
  auto mutable_tensor = [&header](int field) {
    switch (field) {
      case 3:
        return header.mutable_hidden();
      case 4:
        return header.mutable_logits();
      case 7:
        return header.mutable_reference_hidden();
      case 8:
        return header.mutable_reference_logits();
      default:
        return header.mutable_target_ids();
    }
  };
  struct Row {
    int field;
    const v1::Tensor& in;
  };
  const std::array<Row, 5> rows = {{{3, request.hidden()},
                                    {4, request.logits()},
                                    {7, request.reference_hidden()},
                                    {8, request.reference_logits()},
                                    {10, request.target_ids()}}};
  std::vector<std::pair<int, absl::string_view>> data;  // field, the chunk's bytes
  for (const Row& r : rows) {
    const bool present = r.in.shape_size() > 0 || r.in.dtype() != v1::DATA_TYPE_UNSPECIFIED ||
                         !r.in.data().empty() || r.in.has_shared_memory();
    if (!present) continue;
    v1::Tensor* out = mutable_tensor(r.field);
    if (r.in.has_shared_memory() || r.in.data().empty()) {
      *out = SliceRows(r.in, chunk.row_begin, chunk.row_end);  // no bytes to share
      continue;
    }
    v1::Tensor shape_only;
    shape_only.set_dtype(r.in.dtype());
    shape_only.add_shape(chunk.rows());
    for (int i = 1; i < r.in.shape_size(); ++i) shape_only.add_shape(r.in.shape(i));
    *out = std::move(shape_only);
    const int64_t row_bytes = static_cast<int64_t>(r.in.data().size()) / r.in.shape(0);
    data.emplace_back(r.field, absl::string_view(r.in.data())
                                   .substr(static_cast<size_t>(chunk.row_begin * row_bytes),
                                           static_cast<size_t>(chunk.rows() * row_bytes)));
  }
  slices.clear();
  slices.resize(reserved);
  size_t request_bytes = 0;
  slices.emplace_back(header.SerializeAsString());
  request_bytes += slices.back().size();
  for (const auto& [field, bytes] : data)
    request_bytes += AppendDataOccurrence(field, bytes, lease, slices);
  return request_bytes;
}

}  // namespace

grpc::ByteBuffer ChunkBytes(const v1::ScoreRequest& request,
                            const v1::ScoreRequest& request_without_rows, const RowChunk& chunk,
                            const std::string& request_id, SliceLease& lease) {
  // Slot 0: the ScoreStreamRequest's tag and length, once the request's size is known.
  std::vector<grpc::Slice> slices;
  const size_t request_bytes =
      RequestSlices(request, request_without_rows, chunk, &request_id, 1, lease, slices);
  std::string wrapper;
  AppendTag(kStreamRequestField, wrapper);
  AppendVarint(request_bytes, wrapper);
  slices[0] = grpc::Slice(std::move(wrapper));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer RequestBytes(const v1::ScoreRequest& request,
                              const v1::ScoreRequest& request_without_rows, SliceLease& lease) {
  v1::ScoreRequest header = request_without_rows;
  *header.mutable_sequence_lengths() = request.sequence_lengths();
  struct Row {
    const v1::Tensor& in;
    v1::Tensor* (v1::ScoreRequest::*out)();
    int field;  // ScoreRequest field number
    bool present;
  };
  const std::array<Row, 5> rows = {
      {{request.hidden(), &v1::ScoreRequest::mutable_hidden, 3, request.has_hidden()},
       {request.logits(), &v1::ScoreRequest::mutable_logits, 4, request.has_logits()},
       {request.reference_hidden(), &v1::ScoreRequest::mutable_reference_hidden, 7,
        request.has_reference_hidden()},
       {request.reference_logits(), &v1::ScoreRequest::mutable_reference_logits, 8,
        request.has_reference_logits()},
       {request.target_ids(), &v1::ScoreRequest::mutable_target_ids, 10,
        request.has_target_ids()}}};
  std::vector<std::pair<int, absl::string_view>> data;  // field, its bytes
  for (const Row& r : rows) {
    if (!r.present) continue;
    // Everything but the bytes, as given (the server validates the request, not this client).
    v1::Tensor* out = (header.*r.out)();
    out->set_dtype(r.in.dtype());
    *out->mutable_shape() = r.in.shape();
    if (r.in.has_shared_memory()) *out->mutable_shared_memory() = r.in.shared_memory();
    if (!r.in.data().empty()) data.emplace_back(r.field, r.in.data());
  }
  std::vector<grpc::Slice> slices;
  slices.emplace_back(header.SerializeAsString());
  for (const auto& [field, bytes] : data) AppendDataOccurrence(field, bytes, lease, slices);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::Slice SliceLease::Wrap(absl::string_view bytes) {
  {
    absl::MutexLock lock(&mu_);
    ++held_;
  }
  return grpc::Slice(const_cast<char*>(bytes.data()), bytes.size(), &SliceLease::Release, this);
}

void SliceLease::Release(void* lease) {
  auto* self = static_cast<SliceLease*>(lease);
  absl::MutexLock lock(&self->mu_);
  --self->held_;
}

void SliceLease::WaitReleased() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* held) { return *held == 0; }, &held_));
}

int64_t SliceLease::held() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

PipelineOutcome RunPipeline(grpc::GenericStub& stub, grpc::ClientContext& context, size_t chunks,
                            absl::FunctionRef<grpc::ByteBuffer(size_t)> make_chunk, int depth) {
  auto state = std::make_shared<PipelineState>();
  (new PipelineReactor(state, context, chunks, make_chunk, depth))->Start(stub);
  absl::MutexLock lock(&state->mu);
  state->mu.Await(absl::Condition(&state->done));
  return std::move(state->outcome);
}

}  // namespace logitserve::client
