// Safetensors: read and write the Hugging Face tensor file format.
//
// Layout: an 8-byte little-endian u64 n, then n bytes of UTF-8 JSON, then the data buffer:
//   {"NAME": {"dtype": "BF16", "shape": [V, H], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
// Offsets are relative to the start of the data buffer; tensors are row-major, little-endian.
//
// The reader is strict (as strict as the reference implementation, a little stricter where that
// costs nothing): every tensor's byte range must equal product(shape) x itemsize, the ranges must
// tile the data buffer exactly (no overlap, no hole, no trailing bytes), names are unique. Any
// violation is an InvalidArgument error naming the file (or the in-memory source) and the problem.
// A file that parses is therefore safe to index with the returned pointers and sizes.
//
// Thread safety: parsed views and open files are immutable; any number of threads may read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace logitserve {

// Element types of the format with a whole number of bytes per element. The sub-byte types
// (F4, F6_*) are recognised and rejected as unsupported.
enum class SafetensorsDType : uint8_t {
  kBool,        // "BOOL"
  kUInt8,       // "U8"
  kInt8,        // "I8"
  kFloat8E5M2,  // "F8_E5M2"
  kFloat8E4M3,  // "F8_E4M3"
  kFloat8E8M0,  // "F8_E8M0"
  kInt16,       // "I16"
  kUInt16,      // "U16"
  kFloat16,     // "F16"
  kBFloat16,    // "BF16"
  kInt32,       // "I32"
  kUInt32,      // "U32"
  kFloat32,     // "F32"
  kFloat64,     // "F64"
  kInt64,       // "I64"
  kUInt64,      // "U64"
  kComplex64,   // "C64"
};

// Every dtype above, in declaration order (for tests and tables).
inline constexpr SafetensorsDType kAllSafetensorsDTypes[] = {
    SafetensorsDType::kBool,       SafetensorsDType::kUInt8,      SafetensorsDType::kInt8,
    SafetensorsDType::kFloat8E5M2, SafetensorsDType::kFloat8E4M3, SafetensorsDType::kFloat8E8M0,
    SafetensorsDType::kInt16,      SafetensorsDType::kUInt16,     SafetensorsDType::kFloat16,
    SafetensorsDType::kBFloat16,   SafetensorsDType::kInt32,      SafetensorsDType::kUInt32,
    SafetensorsDType::kFloat32,    SafetensorsDType::kFloat64,    SafetensorsDType::kInt64,
    SafetensorsDType::kUInt64,     SafetensorsDType::kComplex64,
};

// Bytes per element.
int64_t SafetensorsDTypeSize(SafetensorsDType dtype);
// The name used in the JSON header ("BF16", ...).
absl::string_view SafetensorsDTypeName(SafetensorsDType dtype);
// Inverse of SafetensorsDTypeName; nullopt for unknown or unsupported names.
std::optional<SafetensorsDType> SafetensorsDTypeFromName(absl::string_view name);

// The header length cap, as in the reference implementation: larger headers are rejected before
// any allocation.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One tensor of a parsed file. `data` points into the file's bytes (borrowed, not owned) and has
// no alignment guarantee beyond 1: copy out with memcpy rather than casting to wider types.
struct SafetensorsTensor {
  SafetensorsDType dtype = SafetensorsDType::kFloat32;
  std::vector<int64_t> shape;  // every dim >= 0; empty for a scalar
  const uint8_t* data = nullptr;
  size_t bytes = 0;  // == num_elements() * SafetensorsDTypeSize(dtype)
  int64_t num_elements() const;
};

// A validated index over borrowed bytes. Cheap to copy; valid while the bytes live.
class SafetensorsView {
 public:
  SafetensorsView() = default;

  // The file path or caller-given name used in error messages.
  const std::string& source() const { return source_; }
  // Tensor names, sorted.
  std::vector<std::string> tensor_names() const;
  size_t num_tensors() const { return tensors_.size(); }
  // nullptr when there is no such tensor.
  const SafetensorsTensor* Find(absl::string_view name) const;
  // NOT_FOUND naming the source and listing (some of) the available tensor names.
  absl::StatusOr<const SafetensorsTensor*> Get(absl::string_view name) const;
  // The "__metadata__" map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  friend absl::StatusOr<SafetensorsView> ParseSafetensors(absl::Span<const uint8_t> bytes,
                                                          absl::string_view source);
  std::string source_;
  std::map<std::string, SafetensorsTensor, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a whole safetensors file held in memory. The view borrows `bytes`.
// Errors: InvalidArgument naming `source` and the problem.
absl::StatusOr<SafetensorsView> ParseSafetensors(absl::Span<const uint8_t> bytes,
                                                 absl::string_view source = "<memory>");

// An open safetensors file: a read-only memory mapping plus its validated index. Move-only; the
// mapping lives as long as the object, and the tensor pointers are valid for that long.
// (The file must not be truncated while mapped: that is undefined behaviour for any mmap reader.)
class SafetensorsFile {
 public:
  // Errors: NOT_FOUND / PERMISSION_DENIED / ... from the OS (with the path), InvalidArgument for a
  // malformed file or a path that is not a regular file.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const SafetensorsView& view() const { return view_; }
  const std::string& path() const { return view_.source(); }
  std::vector<std::string> tensor_names() const { return view_.tensor_names(); }
  const SafetensorsTensor* Find(absl::string_view name) const { return view_.Find(name); }
  absl::StatusOr<const SafetensorsTensor*> Get(absl::string_view name) const {
    return view_.Get(name);
  }
  const std::map<std::string, std::string>& metadata() const { return view_.metadata(); }
  // Total file size in bytes.
  size_t size() const { return size_; }

 private:
  SafetensorsFile() = default;
  void Unmap();

  void* mapping_ = nullptr;
  size_t size_ = 0;
  SafetensorsView view_;
};

// A tensor to write; `data` is borrowed and must hold exactly product(shape) x itemsize bytes.
struct SafetensorsTensorToWrite {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kFloat32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;
};

// Serialises tensors (data laid out in the given order, header padded with spaces so that the
// data buffer starts at a multiple of 8 bytes) into one byte string.
// Errors: InvalidArgument for a duplicate or reserved name, a negative dim, a size mismatch,
// names or metadata that are not valid UTF-8.
absl::StatusOr<std::vector<uint8_t>> SerializeSafetensors(
    absl::Span<const SafetensorsTensorToWrite> tensors,
    const std::map<std::string, std::string>& metadata = {});

// Writes the same bytes to `path`, streaming the tensor data (no in-memory copy of it). The file
// appears atomically: it is written under a temporary name in the same folder, then renamed.
absl::Status WriteSafetensors(const std::string& path,
                              absl::Span<const SafetensorsTensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace logitserve
