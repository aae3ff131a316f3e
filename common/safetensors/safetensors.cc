#include "common/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "nlohmann/json.hpp"

namespace logitserve {
namespace {

using Json = nlohmann::json;

constexpr absl::string_view kMetadataKey = "__metadata__";

struct DTypeInfo {
  SafetensorsDType dtype;
  absl::string_view name;
  int64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {SafetensorsDType::kBool, "BOOL", 1},
    {SafetensorsDType::kUInt8, "U8", 1},
    {SafetensorsDType::kInt8, "I8", 1},
    {SafetensorsDType::kFloat8E5M2, "F8_E5M2", 1},
    {SafetensorsDType::kFloat8E4M3, "F8_E4M3", 1},
    {SafetensorsDType::kFloat8E8M0, "F8_E8M0", 1},
    {SafetensorsDType::kInt16, "I16", 2},
    {SafetensorsDType::kUInt16, "U16", 2},
    {SafetensorsDType::kFloat16, "F16", 2},
    {SafetensorsDType::kBFloat16, "BF16", 2},
    {SafetensorsDType::kInt32, "I32", 4},
    {SafetensorsDType::kUInt32, "U32", 4},
    {SafetensorsDType::kFloat32, "F32", 4},
    {SafetensorsDType::kFloat64, "F64", 8},
    {SafetensorsDType::kInt64, "I64", 8},
    {SafetensorsDType::kUInt64, "U64", 8},
    {SafetensorsDType::kComplex64, "C64", 8},
};

// Format dtypes whose elements are not whole bytes: recognised so the error can say so.
constexpr absl::string_view kSubByteDTypes[] = {"F4", "F6_E2M3", "F6_E3M2"};

// Names in messages: escaped (they come from untrusted files) and bounded in length.
std::string Quote(absl::string_view name) {
  constexpr size_t kMaxShown = 80;
  std::string shown = absl::CHexEscape(name.substr(0, kMaxShown));
  if (name.size() > kMaxShown) absl::StrAppend(&shown, "...");
  return absl::StrCat("\"", shown, "\"");
}

absl::Status Invalid(absl::string_view source, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("invalid safetensors ", source, ": ", problem));
}

absl::string_view JsonTypeName(const Json& j) {
  if (j.is_number_float()) return "a non-integer number";
  if (j.is_number_unsigned()) return "an unsigned integer";
  if (j.is_number_integer()) return "a negative integer";
  return j.type_name();
}

// Thrown from the parser callback to stop parsing a header that nests deeper than any valid
// safetensors header (top object > tensor object > shape array): bounds parser work and memory
// on hostile input. Caught in ParseHeaderJson; never escapes this file.
struct TooDeep {};

struct ParsedHeader {
  Json json;
  std::string duplicate_key;  // first duplicated top-level key, if any
};

absl::StatusOr<ParsedHeader> ParseHeaderJson(absl::string_view text, absl::string_view source) {
  ParsedHeader out;
  absl::flat_hash_set<std::string> keys;
  bool duplicate = false;
  // Depth as nlohmann reports it: 0 for the top object's start, 1 for its keys and for a tensor
  // object's start, 2 for the start of a shape / data_offsets array.
  Json::parser_callback_t callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= 3) {
      throw TooDeep{};
    }
    if (event == Json::parse_event_t::key && depth == 1 && !duplicate) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys.insert(key).second) {
        duplicate = true;
        out.duplicate_key = key;
      }
    }
    return true;
  };
  try {
    out.json = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                           /*ignore_comments=*/false);
  } catch (const TooDeep&) {
    return Invalid(source, "header JSON nests deeper than a safetensors header can");
  } catch (const Json::exception& e) {
    return Invalid(source, absl::StrCat("header is not valid JSON (", e.what(), ")"));
  }
  if (duplicate) {
    return Invalid(source, absl::StrCat("header names ", Quote(out.duplicate_key), " twice"));
  }
  return out;
}

// Reads a JSON integer that must be in [0, INT64_MAX].
absl::StatusOr<uint64_t> NonNegativeInt(const Json& j, absl::string_view source,
                                        absl::string_view what) {
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(source, absl::StrCat(what, " ", v, " is too large"));
    }
    return v;
  }
  if (j.is_number_integer()) {
    return Invalid(source, absl::StrCat(what, " is negative (", j.get<int64_t>(), ")"));
  }
  return Invalid(source,
                 absl::StrCat(what, " must be a non-negative integer, not ", JsonTypeName(j)));
}

struct Placed {
  absl::string_view name;
  uint64_t begin;
  uint64_t end;
};

absl::StatusOr<SafetensorsTensor> ParseTensorInfo(const std::string& name, const Json& info,
                                                  const uint8_t* buffer, uint64_t buffer_size,
                                                  absl::string_view source, Placed* placed) {
  const std::string where = absl::StrCat("tensor ", Quote(name));
  if (!info.is_object()) {
    return Invalid(source,
                   absl::StrCat(where, ": entry must be an object, not ", JsonTypeName(info)));
  }
  for (const auto& [key, value] : info.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Invalid(source, absl::StrCat(where, ": unexpected key ", Quote(key)));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) {
      return Invalid(source, absl::StrCat(where, ": missing \"", key, "\""));
    }
  }
  SafetensorsTensor tensor;

  const Json& dtype = info["dtype"];
  if (!dtype.is_string()) {
    return Invalid(source,
                   absl::StrCat(where, ": \"dtype\" must be a string, not ", JsonTypeName(dtype)));
  }
  const std::string& dtype_name = dtype.get_ref<const std::string&>();
  const std::optional<SafetensorsDType> parsed_dtype = SafetensorsDTypeFromName(dtype_name);
  if (!parsed_dtype.has_value()) {
    const bool sub_byte = std::find(std::begin(kSubByteDTypes), std::end(kSubByteDTypes),
                                    dtype_name) != std::end(kSubByteDTypes);
    return Invalid(source, absl::StrCat(where, ": ", sub_byte ? "unsupported sub-byte" : "unknown",
                                        " dtype ", Quote(dtype_name)));
  }
  tensor.dtype = *parsed_dtype;

  const Json& shape = info["shape"];
  if (!shape.is_array()) {
    return Invalid(source,
                   absl::StrCat(where, ": \"shape\" must be an array, not ", JsonTypeName(shape)));
  }
  uint64_t elements = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    LOGITSERVE_ASSIGN_OR_RETURN(
        uint64_t dim, NonNegativeInt(shape[i], source, absl::StrCat(where, ": dimension ", i)));
    tensor.shape.push_back(static_cast<int64_t>(dim));
    overflow = overflow || __builtin_mul_overflow(elements, dim, &elements);
  }
  uint64_t bytes = 0;
  overflow =
      overflow || __builtin_mul_overflow(
                      elements, static_cast<uint64_t>(SafetensorsDTypeSize(tensor.dtype)), &bytes);
  if (overflow || elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Invalid(source, absl::StrCat(where, ": shape [", absl::StrJoin(tensor.shape, ", "),
                                        "] of ", dtype_name, " overflows 64-bit sizes"));
  }

  const Json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return Invalid(source, absl::StrCat(where, ": \"data_offsets\" must be an array [begin, end]"));
  }
  LOGITSERVE_ASSIGN_OR_RETURN(
      uint64_t begin,
      NonNegativeInt(offsets[0], source, absl::StrCat(where, ": data_offsets begin")));
  LOGITSERVE_ASSIGN_OR_RETURN(
      uint64_t end, NonNegativeInt(offsets[1], source, absl::StrCat(where, ": data_offsets end")));
  if (begin > end) {
    return Invalid(source, absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                        "] end before they begin"));
  }
  if (end - begin != bytes) {
    return Invalid(
        source, absl::StrCat(where, ": size mismatch: data_offsets [", begin, ", ", end, "] span ",
                             end - begin, " bytes but shape [", absl::StrJoin(tensor.shape, ", "),
                             "] of ", dtype_name, " needs ", bytes, " bytes"));
  }
  if (end > buffer_size) {
    return Invalid(source,
                   absl::StrCat(where, ": data_offsets [", begin, ", ", end,
                                "] out of range: the data buffer is ", buffer_size, " bytes"));
  }
  tensor.data = buffer + begin;
  tensor.bytes = static_cast<size_t>(bytes);
  *placed = Placed{absl::string_view(), begin, end};
  return tensor;
}

absl::Status ParseMetadata(const Json& j, absl::string_view source,
                           std::map<std::string, std::string>* metadata) {
  if (j.is_null()) return absl::OkStatus();  // the reference implementation accepts null
  if (!j.is_object()) {
    return Invalid(source, absl::StrCat("\"__metadata__\" must be an object of strings, not ",
                                        JsonTypeName(j)));
  }
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string()) {
      return Invalid(source, absl::StrCat("\"__metadata__\" value for ", Quote(key),
                                          " must be a string, not ", JsonTypeName(value)));
    }
    metadata->emplace(key, value.get<std::string>());
  }
  return absl::OkStatus();
}

// The tensors must tile [0, buffer_size) exactly: sorted by offset, each begins where the
// previous one ended, and the last ends at the buffer's end.
absl::Status CheckTiling(std::vector<Placed> placed, uint64_t buffer_size,
                         absl::string_view source) {
  std::sort(placed.begin(), placed.end(), [](const Placed& a, const Placed& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const Placed* previous = nullptr;
  for (const Placed& p : placed) {
    if (p.begin < covered) {
      return Invalid(source, absl::StrCat("tensors ", Quote(previous->name), " [", previous->begin,
                                          ", ", previous->end, ") and ", Quote(p.name), " [",
                                          p.begin, ", ", p.end, ") overlap"));
    }
    if (p.begin > covered) {
      return Invalid(source,
                     absl::StrCat("hole of ", p.begin - covered,
                                  " unused bytes in the data buffer before tensor ", Quote(p.name),
                                  " at offset ", p.begin, " (tensors must tile the buffer)"));
    }
    covered = p.end;
    previous = &p;
  }
  if (covered != buffer_size) {
    return Invalid(
        source, absl::StrCat("data buffer is ", buffer_size, " bytes but the tensors cover only ",
                             covered, " (", buffer_size - covered, " trailing bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> BuildHeader(absl::Span<const SafetensorsTensorToWrite> tensors,
                                        const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  absl::flat_hash_set<absl::string_view> names;
  uint64_t offset = 0;
  for (const SafetensorsTensorToWrite& t : tensors) {
    const std::string where = absl::StrCat("cannot write tensor ", Quote(t.name), ": ");
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat(where, "the name is reserved"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, "duplicate name"));
    }
    uint64_t elements = 1;
    bool overflow = false;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, "negative dimension in shape [",
                                                       absl::StrJoin(t.shape, ", "), "]"));
      }
      overflow = overflow || __builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements);
    }
    uint64_t bytes = 0;
    overflow =
        overflow || __builtin_mul_overflow(
                        elements, static_cast<uint64_t>(SafetensorsDTypeSize(t.dtype)), &bytes);
    if (overflow || bytes != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "shape [", absl::StrJoin(t.shape, ", "), "] of ", SafetensorsDTypeName(t.dtype),
          " does not match the ", t.data.size(), " data bytes given"));
    }
    header[t.name] = {{"dtype", std::string(SafetensorsDTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // invalid UTF-8 in a name or in metadata
    return absl::InvalidArgumentError(absl::StrCat("cannot write safetensors header: ", e.what()));
  }
  // Pad with spaces (valid trailing JSON whitespace) so the data buffer starts 8-byte aligned.
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write safetensors header of ",
                                                   text.size(), " bytes: over the limit of ",
                                                   kSafetensorsMaxHeaderBytes));
  }
  return text;
}

void PutLittleEndian64(uint64_t v, uint8_t out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

absl::Status WriteAll(int fd, const uint8_t* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsDTypeSize(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.size;
  }
  return 0;  // unreachable for valid enum values
}

absl::string_view SafetensorsDTypeName(SafetensorsDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

std::optional<SafetensorsDType> SafetensorsDTypeFromName(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

int64_t SafetensorsTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at parse time not to overflow
  return n;
}

std::vector<std::string> SafetensorsView::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, tensor] : tensors_) names.push_back(name);
  return names;
}

const SafetensorsTensor* SafetensorsView::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsView::Get(absl::string_view name) const {
  if (const SafetensorsTensor* t = Find(name)) return t;
  constexpr size_t kMaxListed = 20;
  std::vector<std::string> shown;
  for (const auto& [n, tensor] : tensors_) {
    if (shown.size() == kMaxListed) break;
    shown.push_back(Quote(n));
  }
  std::string available = tensors_.empty() ? "none" : absl::StrJoin(shown, ", ");
  if (tensors_.size() > kMaxListed) {
    absl::StrAppend(&available, " and ", tensors_.size() - kMaxListed, " more");
  }
  return absl::NotFoundError(absl::StrCat("safetensors ", source_, " has no tensor ", Quote(name),
                                          "; available: ", available));
}

absl::StatusOr<SafetensorsView> ParseSafetensors(absl::Span<const uint8_t> bytes,
                                                 absl::string_view source) {
  if (bytes.size() < 8) {
    return Invalid(source, absl::StrCat("truncated: ", bytes.size(),
                                        " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];
  if (header_size > kSafetensorsMaxHeaderBytes) {
    return Invalid(source, absl::StrCat("header length ", header_size, " is too large (limit ",
                                        kSafetensorsMaxHeaderBytes, " bytes)"));
  }
  if (header_size > bytes.size() - 8) {
    return Invalid(source,
                   absl::StrCat("header length ", header_size, " runs past the end of the file (",
                                bytes.size(), " bytes in all)"));
  }
  const absl::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, header_size);
  if (text.empty() || text.front() != '{') {
    return Invalid(source, "header does not start with '{'");
  }
  LOGITSERVE_ASSIGN_OR_RETURN(ParsedHeader header, ParseHeaderJson(text, source));
  if (!header.json.is_object()) {
    return Invalid(source, "header is not a JSON object");
  }

  const uint8_t* buffer = bytes.data() + 8 + header_size;
  const uint64_t buffer_size = bytes.size() - 8 - header_size;
  SafetensorsView view;
  view.source_ = std::string(source);
  std::vector<Placed> placed;
  placed.reserve(header.json.size());
  for (const auto& [name, info] : header.json.items()) {
    if (name == kMetadataKey) {
      absl::Status s = ParseMetadata(info, source, &view.metadata_);
      if (!s.ok()) return s;
      continue;
    }
    Placed p;
    LOGITSERVE_ASSIGN_OR_RETURN(SafetensorsTensor tensor,
                                ParseTensorInfo(name, info, buffer, buffer_size, source, &p));
    auto [it, inserted] = view.tensors_.emplace(name, std::move(tensor));
    p.name = it->first;  // a stable key: std::map nodes do not move
    placed.push_back(p);
  }
  absl::Status tiling = CheckTiling(std::move(placed), buffer_size, source);
  if (!tiling.ok()) return tiling;
  return view;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; such files are refused
  // below. It changes nothing for regular files.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open safetensors file ", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat safetensors file ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Invalid(path, "not a regular file");
  }
  SafetensorsFile file;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ < 8) {  // checked before mapping: an empty file cannot be mapped
    ::close(fd);
    return Invalid(path, absl::StrCat("truncated: ", file.size_,
                                      " bytes, shorter than the 8-byte header length"));
  }
  void* mapping = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (mapping == MAP_FAILED) {
    return absl::ErrnoToStatus(map_errno, absl::StrCat("cannot mmap safetensors file ", path));
  }
  file.mapping_ = mapping;
  // On an error, `file` unmaps the mapping as it goes out of scope.
  LOGITSERVE_ASSIGN_OR_RETURN(
      SafetensorsView view,
      ParseSafetensors(absl::Span<const uint8_t>(static_cast<const uint8_t*>(mapping), file.size_),
                       path));
  file.view_ = std::move(view);
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : mapping_(std::exchange(other.mapping_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      view_(std::exchange(other.view_, SafetensorsView())) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    mapping_ = std::exchange(other.mapping_, nullptr);
    size_ = std::exchange(other.size_, 0);
    view_ = std::exchange(other.view_, SafetensorsView());
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
  mapping_ = nullptr;
  size_ = 0;
}

absl::StatusOr<std::vector<uint8_t>> SerializeSafetensors(
    absl::Span<const SafetensorsTensorToWrite> tensors,
    const std::map<std::string, std::string>& metadata) {
  LOGITSERVE_ASSIGN_OR_RETURN(std::string header, BuildHeader(tensors, metadata));
  size_t total = 8 + header.size();
  for (const SafetensorsTensorToWrite& t : tensors) total += t.data.size();
  std::vector<uint8_t> out(8);
  out.reserve(total);
  PutLittleEndian64(header.size(), out.data());
  out.insert(out.end(), header.begin(), header.end());
  for (const SafetensorsTensorToWrite& t : tensors) {
    out.insert(out.end(), t.data.begin(), t.data.end());
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path,
                              absl::Span<const SafetensorsTensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
  LOGITSERVE_ASSIGN_OR_RETURN(std::string header, BuildHeader(tensors, metadata));

  static std::atomic<uint64_t> counter{0};
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", temp));

  uint8_t prefix[8];
  PutLittleEndian64(header.size(), prefix);
  absl::Status status = WriteAll(fd, prefix, sizeof(prefix), temp);
  if (status.ok()) {
    status = WriteAll(fd, reinterpret_cast<const uint8_t*>(header.data()), header.size(), temp);
  }
  for (const SafetensorsTensorToWrite& t : tensors) {
    if (!status.ok()) break;
    status = WriteAll(fd, t.data.data(), t.data.size(), temp);
  }
  if (::close(fd) != 0 && status.ok()) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("cannot close ", temp));
  }
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("cannot rename ", temp, " to ", path));
  }
  if (!status.ok()) ::unlink(temp.c_str());
  return status;
}

}  // namespace logitserve
