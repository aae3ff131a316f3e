// logitserve-cli's input files: safetensors files of named request tensors.
//
//   hidden | logits                  [N, H] / [N, V]  F32, BF16 or F16 (exactly one of the two)
//   reference_hidden | reference_logits (optional)    likewise, [N, H_ref] / [N, V]
//   target_ids (optional)            [N] or [N, K]    I32 or I64
//
// Other tensors are reported by LoadScoreInput (ignored_tensors) and not sent. make-input writes
// such files from a seeded generator so the demo and the tests need no Python.
//
// Thread safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

struct ScoreInput {
  // A request holding only the file's tensors (no head names, no options).
  v1::ScoreRequest request;
  // Tensors of the file that are not request tensors, sorted.
  std::vector<std::string> ignored_tensors;
};

// Reads `path`. Errors (INVALID_ARGUMENT / NOT_FOUND, each naming the file and the tensor):
// unreadable or malformed file, neither or both of hidden/logits, both reference_hidden and
// reference_logits, a dtype the wire does not carry, a rank other than 2 (1 or 2 for target_ids),
// first dimensions that differ.
absl::StatusOr<ScoreInput> LoadScoreInput(const std::string& path);

struct MakeInputOptions {
  std::string output;          // path of the file to write
  int64_t rows = 8;            // N
  int64_t hidden_size = 1024;  // H of `hidden`
  int64_t vocab = 32000;       // V: target ids are drawn from [0, V); logits have V columns
  uint64_t seed = 0;
  v1::DataType dtype = v1::DATA_TYPE_BFLOAT16;  // FLOAT32, BFLOAT16 or FLOAT16
  int64_t targets_per_row = 1;                  // K; 0 writes no target_ids
  bool reference = false;                       // also write reference_hidden / reference_logits
  int64_t reference_hidden_size = 0;            // H_ref (0 = H)
  bool logits = false;                          // write logits [N, V] instead of hidden [N, H]
  double scale = 1.0;                           // standard deviation of the normal values
};

// Writes a file of i.i.d. normal(0, scale^2) values (rounded to `dtype`) and uniform target ids,
// all drawn from one std::mt19937_64 seeded with `seed` (the same bits for the same options).
absl::Status WriteDemoInput(const MakeInputOptions& options);

}  // namespace logitserve::client
