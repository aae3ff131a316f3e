// Builders of Hugging Face model folders for tests: config.json plus model.safetensors, or a
// sharded checkpoint (model.safetensors.index.json + shard files), laid out exactly as
// transformers' save_pretrained writes them. The tensors' values are chosen by the test, so the
// test knows the expected head without reading it back through the loader.
//
// Thread safety: free functions and a value type; no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors/safetensors.h"
#include "logitserve/kernels/dtype.h"

namespace logitserve::testing {

// One tensor of a checkpoint: its values as fp32 (encoded to `dtype` on write; pick values the
// dtype represents exactly when a test compares bits).
struct HfTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// `values` encoded as little-endian `dtype` elements (F32, BF16, F16: round to nearest even;
// I32: truncated to integers).
std::vector<uint8_t> EncodeValues(SafetensorsDType dtype, const std::vector<float>& values);

// A fresh empty folder under the test temp dir (removed by RemoveFolder).
std::string MakeTempFolder(const std::string& tag);
void RemoveFolder(const std::string& dir);

// Writes `text` to `path` (a file in a test folder); returns false on failure.
bool WriteTextFile(const std::string& path, const std::string& text);

// Writes dir/config.json (verbatim `config_json`) and the tensors: into dir/model.safetensors
// when `shards` is empty, else into the files named by `shards` (tensor name -> file name) plus
// dir/model.safetensors.index.json mapping each tensor to its file. Returns false on failure
// (with a gtest failure recorded).
bool WriteHfFolder(const std::string& dir, const std::string& config_json,
                   const std::vector<HfTensor>& tensors,
                   const std::map<std::string, std::string>& shards = {});

}  // namespace logitserve::testing
