#include "tests/heads/hf_test_checkpoint.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"

namespace logitserve::testing {

std::vector<uint8_t> EncodeValues(SafetensorsDType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> out;
  for (float v : values) {
    uint8_t bytes[4];
    size_t n = 4;
    switch (dtype) {
      case SafetensorsDType::kFloat32:
        std::memcpy(bytes, &v, 4);
        break;
      case SafetensorsDType::kBFloat16:
      case SafetensorsDType::kFloat16: {
        const uint16_t bits = dtype == SafetensorsDType::kBFloat16 ? kernels::FloatToBFloat16(v)
                                                                   : kernels::FloatToFloat16(v);
        std::memcpy(bytes, &bits, 2);
        n = 2;
        break;
      }
      case SafetensorsDType::kInt32: {
        const int32_t i = static_cast<int32_t>(v);
        std::memcpy(bytes, &i, 4);
        break;
      }
      default:
        ADD_FAILURE() << "EncodeValues: unsupported dtype " << SafetensorsDTypeName(dtype);
        return out;
    }
    out.insert(out.end(), bytes, bytes + n);
  }
  return out;
}

std::string MakeTempFolder(const std::string& tag) {
  static std::atomic<int> counter{0};
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/hf_", ::getpid(), "_", tag, "_", counter.fetch_add(1));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void RemoveFolder(const std::string& dir) {
  std::error_code error;
  std::filesystem::remove_all(dir, error);
}

bool WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  return static_cast<bool>(out);
}

bool WriteHfFolder(const std::string& dir, const std::string& config_json,
                   const std::vector<HfTensor>& tensors,
                   const std::map<std::string, std::string>& shards) {
  if (!WriteTextFile(dir + "/config.json", config_json)) {
    ADD_FAILURE() << "cannot write " << dir << "/config.json";
    return false;
  }
  // Encoded bytes must outlive the write.
  std::vector<std::vector<uint8_t>> encoded;
  encoded.reserve(tensors.size());
  std::map<std::string, std::vector<SafetensorsTensorToWrite>> by_file;
  for (const HfTensor& t : tensors) {
    encoded.push_back(EncodeValues(t.dtype, t.values));
    std::string file = "model.safetensors";
    if (!shards.empty()) {
      const auto it = shards.find(t.name);
      if (it == shards.end()) {
        ADD_FAILURE() << "no shard named for tensor " << t.name;
        return false;
      }
      file = it->second;
    }
    by_file[file].push_back({t.name, t.dtype, t.shape, absl::MakeConstSpan(encoded.back())});
  }
  for (const auto& [file, list] : by_file) {
    const absl::Status s = WriteSafetensors(dir + "/" + file, list, {{"format", "pt"}});
    if (!s.ok()) {
      ADD_FAILURE() << "cannot write " << file << ": " << s;
      return false;
    }
  }
  if (shards.empty()) return true;
  // The index as save_pretrained writes it: metadata.total_size and a sorted weight_map.
  size_t total = 0;
  for (const auto& bytes : encoded) total += bytes.size();
  std::string index = absl::StrCat("{\n  \"metadata\": {\n    \"total_size\": ", total,
                                   "\n  },\n  \"weight_map\": {");
  bool first = true;
  for (const auto& [tensor, file] : shards) {  // std::map: sorted by tensor name
    absl::StrAppend(&index, first ? "\n" : ",\n", "    \"", tensor, "\": \"", file, "\"");
    first = false;
  }
  absl::StrAppend(&index, "\n  }\n}\n");
  return WriteTextFile(dir + "/model.safetensors.index.json", index);
}

}  // namespace logitserve::testing
