// Reading a whole (small) file: tokens, PEM certificates, request files.
//
// Not for model files (the safetensors reader maps them) or for files a hostile client may name
// (hf_checkpoint.cc bounds what it reads from a model folder).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace logitserve {

// The bytes of `path`. NOT_FOUND when the file cannot be opened, DATA_LOSS when reading it
// fails; the message names the path. Callers that report their own message (naming the flag)
// test ok() only. A directory reads as empty on Linux, as with std::ifstream.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace logitserve
