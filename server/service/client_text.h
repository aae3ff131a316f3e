// Bounded quoting of client-supplied text in error messages and logs.
//
// A status message travels back in the grpc-message trailer; a client's metadata limit (8 KiB by
// default) applies to the whole trailer, and a trailer over it fails the call, and with it every
// call in flight on that HTTP/2 connection, with RESOURCE_EXHAUSTED. So no message may grow with
// the request: client text (head names, request ids, shapes) is quoted through QuoteClientText /
// ShapePrefix, and ToGrpcStatus caps every message at kMaxStatusMessageBytes as a last guard.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/repeated_field.h"

namespace logitserve {

// Longest client text quoted verbatim; longer text is cut and its length given.
inline constexpr size_t kMaxQuotedClientBytes = 64;
// Most dimensions of a client's shape written out; more are elided and counted.
inline constexpr int kMaxQuotedDims = 8;
// Longest status message sent to a client (well under any client's 8 KiB metadata limit).
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// `text` when it is at most kMaxQuotedClientBytes long, else its first kMaxQuotedClientBytes
// bytes followed by "...(N bytes)". Never cuts a UTF-8 sequence in two.
std::string QuoteClientText(absl::string_view text);

// "[d0, d1, ...]" with at most kMaxQuotedDims dimensions, then ", ...(R dims)".
std::string ShapePrefix(const google::protobuf::RepeatedField<int64_t>& shape);

// `message` cut to at most `max_bytes` bytes (ending "...(truncated)" when cut, UTF-8 safe).
std::string CapMessage(absl::string_view message, size_t max_bytes = kMaxStatusMessageBytes);

}  // namespace logitserve
