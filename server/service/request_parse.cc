#include "server/service/request_parse.h"

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>

namespace logitserve {
namespace {

using google::protobuf::io::CodedInputStream;

// Skips the value of a field of wire type `type` other than length-delimited (its tag read).
// False on a group or bad bytes (the parse then decides).
bool SkipValue(CodedInputStream& in, uint32_t type) {
  uint64_t v = 0;
  switch (type) {
    case 0:  // varint
      return in.ReadVarint64(&v);
    case 1:  // 64-bit
      return in.Skip(8);
    case 5:  // 32-bit
      return in.Skip(4);
    default:
      return false;
  }
}

// Calls on_field(number, length) for each length-delimited field of the message that ends at
// `in`'s current limit, with `in` at the field's payload; on_field consumes exactly `length`
// bytes. Other fields are skipped. Protobuf's own reader over the buffer's slices: nothing is
// copied but the tags and lengths.
template <typename F>
bool ForEachField(CodedInputStream& in, F&& on_field) {
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return in.BytesUntilLimit() == 0;  // the end (a zero tag before it is bad)
    if ((tag & 7) != 2) {                            // not length-delimited
      if (!SkipValue(in, tag & 7)) return false;
      continue;
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
      return false;
    }
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    const bool ok = on_field(tag >> 3, length) && in.BytesUntilLimit() == 0;
    in.PopLimit(limit);
    if (!ok) return false;
  }
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

// Reserves, in `out`, the bytes of every tensor of the ScoreRequest that ends at `in`'s limit.
// Creates only tensors the message holds (the parse would create them anyway).
bool ReserveTensors(CodedInputStream& in, v1::ScoreRequest* out) {
  return ForEachField(in, [&](uint32_t number, uint32_t length) {
    v1::Tensor* tensor = MutableTensor(out, number);
    if (tensor == nullptr) return in.Skip(static_cast<int>(length));
    return ForEachField(in, [&](uint32_t field, uint32_t bytes) {
      if (field == v1::Tensor::kDataFieldNumber) {
        std::string* data = tensor->mutable_data();
        data->reserve(std::max<size_t>(data->capacity(), bytes));
      }
      return in.Skip(static_cast<int>(bytes));
    });
  });
}

// `scan(in)` over the message's bytes (a reader bounded by its size), then the parse proper:
// protobuf, told the message's size. A scan that fails reserves nothing more; the parse then
// decides (and fails the same way).
template <typename Scan>
bool ScanThenMerge(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* out,
                   Scan&& scan) {
  if (!buffer.Valid()) return false;  // no message at all
  const size_t length = buffer.Length();
  if (length == 0) return true;  // the empty message (its checks are validation's)
  if (length > static_cast<size_t>(INT_MAX)) return false;
  {
    grpc::ByteBuffer copy(buffer);  // shares the slices
    grpc::ProtoBufferReader reader(&copy);
    CodedInputStream in(&reader);
    in.PushLimit(static_cast<int>(length));
    (void)scan(in);
  }
  grpc::ByteBuffer copy(buffer);
  grpc::ProtoBufferReader reader(&copy);
  return out->MergeFromBoundedZeroCopyStream(&reader, static_cast<int>(length)) &&
         reader.status().ok();
}

}  // namespace

bool ParseScoreRequest(const grpc::ByteBuffer& buffer, v1::ScoreRequest* out) {
  return ScanThenMerge(buffer, out, [&](CodedInputStream& in) { return ReserveTensors(in, out); });
}

bool ParseScoreStreamRequest(const grpc::ByteBuffer& buffer, v1::ScoreStreamRequest* out) {
  return ScanThenMerge(buffer, out, [&](CodedInputStream& in) {
    return ForEachField(in, [&](uint32_t number, uint32_t length) {
      if (number != v1::ScoreStreamRequest::kRequestFieldNumber) {
        return in.Skip(static_cast<int>(length));
      }
      return ReserveTensors(in, out->mutable_request());
    });
  });
}

}  // namespace logitserve
