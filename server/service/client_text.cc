#include "server/service/client_text.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace logitserve {

namespace {

// The largest prefix length <= `max` of `text` that does not end inside a UTF-8 sequence.
size_t Utf8Prefix(absl::string_view text, size_t max) {
  if (text.size() <= max) return text.size();
  size_t n = max;
  // Back off continuation bytes (10xxxxxx) so the cut falls before a lead byte.
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return n;
}

}  // namespace

std::string QuoteClientText(absl::string_view text) {
  if (text.size() <= kMaxQuotedClientBytes) return std::string(text);
  return absl::StrCat(text.substr(0, Utf8Prefix(text, kMaxQuotedClientBytes)), "...(", text.size(),
                      " bytes)");
}

std::string ShapePrefix(const google::protobuf::RepeatedField<int64_t>& shape) {
  const int shown = std::min(shape.size(), kMaxQuotedDims);
  std::string out = absl::StrCat("[", absl::StrJoin(shape.begin(), shape.begin() + shown, ", "));
  if (shown < shape.size()) absl::StrAppend(&out, ", ...(", shape.size(), " dims)");
  out += "]";
  return out;
}

std::string CapMessage(absl::string_view message, size_t max_bytes) {
  if (message.size() <= max_bytes) return std::string(message);
  constexpr absl::string_view kMark = "...(truncated)";
  const size_t keep = max_bytes > kMark.size() ? max_bytes - kMark.size() : 0;
  return absl::StrCat(message.substr(0, Utf8Prefix(message, keep)), kMark);
}

}  // namespace logitserve
