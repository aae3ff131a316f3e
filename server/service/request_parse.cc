#include "server/service/request_parse.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace logitserve {
namespace {

// Sequential reads over a buffer's slices (tags, varints, skips): enough of the wire format to
// find the tensors' lengths without copying a payload.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {}

  uint64_t position() const { return position_; }

  bool ReadByte(uint8_t* b) {
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
    if (slice_ == slices_.size()) return false;
    *b = slices_[slice_].begin()[offset_++];
    ++position_;
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  bool Skip(uint64_t n) {
    while (n > 0) {
      if (slice_ == slices_.size()) return false;
      const uint64_t here = std::min<uint64_t>(n, slices_[slice_].size() - offset_);
      offset_ += here;
      position_ += here;
      n -= here;
      if (offset_ == slices_[slice_].size()) {
        ++slice_;
        offset_ = 0;
      }
    }
    return true;
  }

 private:
  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
  uint64_t position_ = 0;
};

constexpr uint32_t kLengthDelimited = 2;

// Skips the value of a field of fixed-size or varint wire type `type` (its tag read; ForEachField
// handles length-delimited fields itself). False on a group or bad bytes.
bool SkipValue(SliceReader& r, uint32_t type) {
  uint64_t v = 0;
  switch (type) {
    case 0:
      return r.ReadVarint(&v);
    case 1:
      return r.Skip(8);
    case 5:
      return r.Skip(4);
    default:
      return false;
  }
}

// Calls on_field(number, length) for each length-delimited field of the message that ends at
// `end`, with the reader at the field's payload; on_field consumes exactly `length` bytes.
template <typename F>
bool ForEachField(SliceReader& r, uint64_t end, F&& on_field) {
  while (r.position() < end) {
    uint64_t tag = 0;
    if (!r.ReadVarint(&tag)) return false;
    const uint32_t type = static_cast<uint32_t>(tag & 7);
    if (type != kLengthDelimited) {
      if (!SkipValue(r, type)) return false;
      continue;
    }
    uint64_t length = 0;
    if (!r.ReadVarint(&length) || length > end - r.position()) return false;
    if (!on_field(static_cast<uint32_t>(tag >> 3), length)) return false;
  }
  return r.position() == end;
}

// The ScoreRequest field `number` if it is a tensor (a Tensor message), else null.
v1::Tensor* MutableTensor(v1::ScoreRequest* m, uint32_t number) {
  switch (number) {
    case v1::ScoreRequest::kHiddenFieldNumber:
      return m->mutable_hidden();
    case v1::ScoreRequest::kLogitsFieldNumber:
      return m->mutable_logits();
    case v1::ScoreRequest::kReferenceHiddenFieldNumber:
      return m->mutable_reference_hidden();
    case v1::ScoreRequest::kReferenceLogitsFieldNumber:
      return m->mutable_reference_logits();
    case v1::ScoreRequest::kTargetIdsFieldNumber:
      return m->mutable_target_ids();
    default:
      return nullptr;
  }
}

// Reserves, in `out`, the bytes of every tensor of the ScoreRequest that ends at `end`. Creates
// only tensors the message holds (the parse would create them anyway).
bool ReserveTensors(SliceReader& r, uint64_t end, v1::ScoreRequest* out) {
  return ForEachField(r, end, [&](uint32_t number, uint64_t length) {
    v1::Tensor* tensor = MutableTensor(out, number);
    if (tensor == nullptr) return r.Skip(length);
    return ForEachField(r, r.position() + length, [&](uint32_t field, uint64_t bytes) {
      if (field == v1::Tensor::kDataFieldNumber) {
        std::string* data = tensor->mutable_data();
        data->reserve(std::max<size_t>(data->capacity(), bytes));
      }
      return r.Skip(bytes);
    });
  });
}

// The parse proper: protobuf, told the message's size.
bool MergeBuffer(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* out) {
  if (!buffer.Valid()) return false;  // no message at all
  const size_t length = buffer.Length();
  if (length == 0) return true;  // the empty message (its checks are validation's)
  if (length > static_cast<size_t>(INT_MAX)) return false;
  grpc::ByteBuffer copy(buffer);  // shares the slices
  grpc::ProtoBufferReader reader(&copy);
  return out->MergeFromBoundedZeroCopyStream(&reader, static_cast<int>(length)) &&
         reader.status().ok();
}

std::vector<grpc::Slice> Slices(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) slices.clear();
  return slices;
}

}  // namespace

bool ParseScoreRequest(const grpc::ByteBuffer& buffer, v1::ScoreRequest* out) {
  SliceReader r(Slices(buffer));
  // A scan that fails reserves nothing more; the parse then decides (and fails the same way).
  (void)ReserveTensors(r, buffer.Length(), out);
  return MergeBuffer(buffer, out);
}

bool ParseScoreStreamRequest(const grpc::ByteBuffer& buffer, v1::ScoreStreamRequest* out) {
  SliceReader r(Slices(buffer));
  (void)ForEachField(r, buffer.Length(), [&](uint32_t number, uint64_t length) {
    if (number != v1::ScoreStreamRequest::kRequestFieldNumber) return r.Skip(length);
    return ReserveTensors(r, r.position() + length, out->mutable_request());
  });
  return MergeBuffer(buffer, out);
}

}  // namespace logitserve
