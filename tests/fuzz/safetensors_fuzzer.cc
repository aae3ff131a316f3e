// libFuzzer target: the safetensors reader over arbitrary bytes. A file that parses must be safe to
// index (the reader's contract): every tensor's bytes equal product(shape) x itemsize and lie
// inside the input, names are unique and sorted; each tensor's bytes are read in full so that
// AddressSanitizer catches any range outside the buffer. Broken invariants abort.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/safetensors/safetensors.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "safetensors_fuzzer: invariant broken: %s\n", what);
  std::abort();
}
#define FUZZ_CHECK(cond)      \
  do {                        \
    if (!(cond)) Fail(#cond); \
  } while (0)

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace logitserve;
  // A private copy of exactly `size` bytes: ASan flags a read one past the end.
  std::vector<uint8_t> bytes(data, data + size);
  absl::StatusOr<SafetensorsView> view =
      ParseSafetensors(absl::MakeConstSpan(bytes.data(), bytes.size()), "fuzz");
  static const bool verbose = std::getenv("LOGITSERVE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "parse: %s\n", view.status().ToString().c_str());
  if (!view.ok()) {
    FUZZ_CHECK(view.status().code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!view.status().message().empty());
    return 0;
  }
  const std::vector<std::string> names = view->tensor_names();
  FUZZ_CHECK(names.size() == view->num_tensors());
  uint64_t total = 0;
  uint32_t checksum = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) FUZZ_CHECK(names[i - 1] < names[i]);
    const SafetensorsTensor* t = view->Find(names[i]);
    FUZZ_CHECK(t != nullptr);
    int64_t elements = 1;
    for (int64_t d : t->shape) {
      FUZZ_CHECK(d >= 0);
      elements *= d;
    }
    FUZZ_CHECK(t->num_elements() == elements);
    FUZZ_CHECK(static_cast<int64_t>(t->bytes) == elements * SafetensorsDTypeSize(t->dtype));
    FUZZ_CHECK(t->bytes == 0 ||
               (t->data >= bytes.data() && t->data + t->bytes <= bytes.data() + bytes.size()));
    for (size_t b = 0; b < t->bytes; ++b) checksum += t->data[b];
    total += t->bytes;
  }
  FUZZ_CHECK(total <= bytes.size());
  for (const auto& [key, value] : view->metadata())
    checksum += static_cast<uint32_t>(key.size() + value.size());
  // Keep the reads observable.
  static volatile uint32_t sink;
  sink = checksum;
  return 0;
}
