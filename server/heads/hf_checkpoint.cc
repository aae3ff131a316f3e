#include "server/heads/hf_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "common/safetensors/float_type.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"
#include "server/heads/head_loader.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

using Json = nlohmann::json;
using kernels::FloatType;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// config.json and the shard index are a few KiB to a few hundred KiB; anything this large is not
// one of them, and refusing it bounds what a wrong path makes us read.
constexpr int64_t kMaxJsonFileBytes = int64_t{64} << 20;

// The head tensor names, in the order they are tried: plain causal LMs first, then the layouts of
// multimodal checkpoints (transformers >= 4.52 and older).
constexpr const char* kLmHeadNames[] = {"lm_head.weight", "language_model.lm_head.weight"};
constexpr const char* kLmBiasNames[] = {"lm_head.bias", "language_model.lm_head.bias"};
constexpr const char* kEmbeddingNames[] = {"model.embed_tokens.weight",
                                           "model.language_model.embed_tokens.weight",
                                           "language_model.model.embed_tokens.weight"};

std::string JoinPath(const std::string& dir, absl::string_view file) {
  return (std::filesystem::path(dir) / std::string(file)).string();
}

// The whole file as text. NOT_FOUND (and the other OS codes) name the path; anything but a
// regular file (a FIFO would block the start-up forever, a device never end) is INVALID_ARGUMENT.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused by the check below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::FILE* file = ::fdopen(fd, "rb");
  if (file == nullptr) {
    const int error = errno;
    ::close(fd);
    return absl::ErrnoToStatus(error, absl::StrCat("cannot open ", path));
  }
  std::string text;
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) {
    text.append(buffer, got);
    if (static_cast<int64_t>(text.size()) > kMaxJsonFileBytes) {
      std::fclose(file);
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is larger than ", kMaxJsonFileBytes, " bytes; not a JSON config"));
    }
  }
  const bool failed = std::ferror(file) != 0;
  const int error = errno;
  std::fclose(file);
  if (failed) return absl::ErrnoToStatus(error, absl::StrCat("cannot read ", path));
  return text;
}

// Parses JSON text; the parser's message (with its byte position) on failure. nlohmann reports
// errors by exception: they stop here.
absl::StatusOr<Json> ParseJson(const std::string& text, absl::string_view source) {
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
}

// The config object a field is read from: text_config when it has the key, else the top level.
const Json* FieldOf(const Json& config, const char* key) {
  const auto text = config.find("text_config");
  if (text != config.end() && text->is_object() && text->contains(key)) return &(*text)[key];
  const auto it = config.find(key);
  return it == config.end() ? nullptr : &*it;
}

absl::Status FieldError(absl::string_view source, const char* key, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": field \"", key, "\" ", problem));
}

absl::StatusOr<int64_t> RequiredSize(const Json& config, absl::string_view source, const char* key,
                                     int64_t limit) {
  const Json* value = FieldOf(config, key);
  if (value == nullptr || value->is_null()) return FieldError(source, key, "is missing");
  if (!value->is_number_integer()) {
    return FieldError(source, key, absl::StrCat("must be an integer, got ", value->dump()));
  }
  // is_number_integer covers both signed and unsigned storage; read through the signed view only
  // when it fits (an unsigned value above INT64_MAX is out of range anyway).
  if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(limit)) {
    return FieldError(source, key, absl::StrCat(value->dump(), " is outside [1, ", limit, "]"));
  }
  const int64_t size = value->get<int64_t>();
  if (size < 1 || size > limit) {
    return FieldError(source, key, absl::StrCat(size, " is outside [1, ", limit, "]"));
  }
  return size;
}

// A float field: nullopt when absent or null, else a JSON number that is finite in fp32.
absl::StatusOr<std::optional<float>> OptionalNumber(const Json& config, absl::string_view source,
                                                    const char* key) {
  const Json* value = FieldOf(config, key);
  if (value == nullptr || value->is_null()) return std::nullopt;
  if (!value->is_number()) {
    return FieldError(source, key, absl::StrCat("must be a number or null, got ", value->dump()));
  }
  const double number = value->get<double>();
  const float narrowed = static_cast<float>(number);
  if (!std::isfinite(narrowed)) {
    return FieldError(source, key, absl::StrCat(value->dump(), " is not a finite fp32 value"));
  }
  return std::optional<float>(narrowed);
}

// Where each tensor of a checkpoint lives: one file, or the shards of an index.
class Checkpoint {
 public:
  static absl::StatusOr<Checkpoint> Open(const std::string& dir) {
    Checkpoint out;
    out.dir_ = dir;
    std::error_code error;
    const std::string single = JoinPath(dir, kSingleFile);
    if (std::filesystem::exists(single, error)) {
      out.description_ = single;
      return out;
    }
    const std::string index_path = JoinPath(dir, kIndexFile);
    if (!std::filesystem::exists(index_path, error)) {
      return absl::NotFoundError(absl::StrCat(dir, " has neither ", kSingleFile, " nor ",
                                              kIndexFile, " (a Hugging Face model folder)"));
    }
    out.description_ = index_path;
    out.sharded_ = true;
    LOGITSERVE_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
    LOGITSERVE_ASSIGN_OR_RETURN(Json index, ParseJson(text, index_path));
    const auto map = index.is_object() ? index.find("weight_map") : index.end();
    if (map == index.end() || !map->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": \"weight_map\" is missing or not an object"));
    }
    for (const auto& [tensor, file] : map->items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map[\"", tensor, "\"] must be a file name, got ", file.dump()));
      }
      const std::string name = file.get<std::string>();
      // Shards sit beside the index; a path elsewhere is a broken or hostile index.
      if (name.empty() || name == "." || name == ".." ||
          name.find_first_of("/\\") != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map[\"", tensor, "\"] = \"", name,
                         "\" is not a file name in the model folder"));
      }
      out.shard_of_.emplace(tensor, name);
    }
    return out;
  }

  // The checkpoint file or index, for messages.
  const std::string& description() const { return description_; }

  // Whether the checkpoint has `tensor`: per the index when sharded (a shard that turns out to
  // lack it is an error of Get), else per the file (whose open errors Get reports).
  bool Has(const std::string& tensor) const {
    if (sharded_) return shard_of_.count(tensor) != 0;
    const absl::StatusOr<const SafetensorsFile*> file = FileNamed(kSingleFile);
    return !file.ok() || (*file)->Find(tensor) != nullptr;
  }

  // The first of `names` the checkpoint holds, or nullopt.
  template <size_t kN>
  std::optional<std::string> FirstOf(const char* const (&names)[kN]) const {
    for (const char* name : names) {
      if (Has(name)) return std::string(name);
    }
    return std::nullopt;
  }

  struct Found {
    const SafetensorsTensor* tensor;
    std::string file;  // path, for messages and HeadWeights::source
  };
  // Opens (once) the file holding `tensor` and finds it there.
  absl::StatusOr<Found> Get(const std::string& tensor) const {
    std::string file_name = kSingleFile;
    if (sharded_) {
      const auto it = shard_of_.find(tensor);
      if (it == shard_of_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(description_, " maps no shard to tensor \"", tensor, "\""));
      }
      file_name = it->second;
    }
    absl::StatusOr<const SafetensorsFile*> file = FileNamed(file_name);
    if (!file.ok()) {
      if (sharded_ && absl::IsNotFound(file.status())) {
        return absl::NotFoundError(absl::StrCat(description_, " maps tensor \"", tensor,
                                                "\" to shard ", file_name,
                                                ", which is missing: ", file.status().message()));
      }
      return file.status();
    }
    const SafetensorsTensor* found = (*file)->Find(tensor);
    if (found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat((*file)->path(), " has no tensor \"", tensor, "\"",
                       sharded_ ? absl::StrCat(" although ", description_, " maps it there") : ""));
    }
    return Found{found, (*file)->path()};
  }

 private:
  absl::StatusOr<const SafetensorsFile*> FileNamed(const std::string& file_name) const {
    auto it = open_.find(file_name);
    if (it == open_.end()) {
      LOGITSERVE_ASSIGN_OR_RETURN(SafetensorsFile file,
                                  SafetensorsFile::Open(JoinPath(dir_, file_name)));
      it = open_.emplace(file_name, std::make_unique<SafetensorsFile>(std::move(file))).first;
    }
    return it->second.get();
  }

  std::string dir_;
  std::string description_;
  bool sharded_ = false;
  std::map<std::string, std::string> shard_of_;  // tensor -> shard file name, when sharded
  // Files opened so far (memory-mapped), by name in dir_. Lazily filled by const lookups: a
  // Checkpoint is local to one LoadHfHead call, never shared between threads.
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
};

// "[a, b]" for messages.
std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<HfHeadConfig> ParseHfConfig(absl::string_view json_text, absl::string_view source) {
  LOGITSERVE_ASSIGN_OR_RETURN(Json config, ParseJson(std::string(json_text), source));
  if (!config.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": must be a JSON object, got ", config.type_name()));
  }
  HfHeadConfig out;
  LOGITSERVE_ASSIGN_OR_RETURN(int64_t vocab,
                              RequiredSize(config, source, "vocab_size", kMaxHeadVocab));
  LOGITSERVE_ASSIGN_OR_RETURN(int64_t hidden,
                              RequiredSize(config, source, "hidden_size", kMaxHeadHidden));
  out.vocab_size = vocab;
  out.hidden_size = hidden;

  const Json* tie = FieldOf(config, "tie_word_embeddings");
  if (tie != nullptr && !tie->is_null()) {
    if (!tie->is_boolean()) {
      return FieldError(source, "tie_word_embeddings",
                        absl::StrCat("must be true, false or null, got ", tie->dump()));
    }
    out.tie_word_embeddings = tie->get<bool>();
  }

  LOGITSERVE_ASSIGN_OR_RETURN(std::optional<float> softcap,
                              OptionalNumber(config, source, "final_logit_softcapping"));
  // transformers divides by the cap whenever it is not None: 0 would give NaN logits there.
  if (softcap.has_value() && !(*softcap > 0.0f)) {
    return FieldError(source, "final_logit_softcapping",
                      absl::StrCat(*softcap, " must be > 0 (or null for none)"));
  }
  LOGITSERVE_ASSIGN_OR_RETURN(std::optional<float> scale,
                              OptionalNumber(config, source, "logit_scale"));
  LOGITSERVE_ASSIGN_OR_RETURN(std::optional<float> scaling,
                              OptionalNumber(config, source, "logits_scaling"));
  // A field missing from config.json takes the default of the model's config class in
  // transformers, as from_pretrained would; for the model types whose default is not "none".
  // (save_pretrained writes every field, so this matters only for hand-written configs.)
  const Json* model_type = FieldOf(config, "model_type");
  const std::string type =
      model_type != nullptr && model_type->is_string() ? model_type->get<std::string>() : "";
  const bool softcap_absent = FieldOf(config, "final_logit_softcapping") == nullptr;
  const bool scale_absent = FieldOf(config, "logit_scale") == nullptr;
  if (type == "gemma2" && softcap_absent) softcap = 30.0f;                       // Gemma2Config
  if ((type == "cohere" || type == "cohere2") && scale_absent) scale = 0.0625f;  // CohereConfig
  // Python float scalars act on fp32 logits in fp32 in torch, so the fp32 values are HF's.
  out.transform.softcap = softcap.value_or(0.0f);
  out.transform.logit_scale = scale.value_or(1.0f);
  out.transform.logits_scaling = scaling.value_or(1.0f);
  if (absl::Status s = ValidateHeadTransform(out.transform); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHfHead(absl::string_view name,
                                                        const std::string& dir) {
  LOGITSERVE_RETURN_IF_ERROR(ValidateHeadName(name));
  const auto start = std::chrono::steady_clock::now();
  const auto with_name = [name](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("head \"", name, "\": ", s.message()));
  };

  const std::string config_path = JoinPath(dir, kConfigFile);
  absl::StatusOr<std::string> config_text = ReadSmallFile(config_path);
  if (!config_text.ok()) {
    return with_name(absl::Status(
        config_text.status().code(),
        absl::StrCat(config_text.status().message(), " (a Hugging Face model folder has one)")));
  }
  absl::StatusOr<HfHeadConfig> config = ParseHfConfig(*config_text, config_path);
  if (!config.ok()) return with_name(config.status());

  absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(dir);
  if (!checkpoint.ok()) return with_name(checkpoint.status());

  // The head tensor (see the header for the tie rule).
  const std::optional<std::string> lm_head = checkpoint->FirstOf(kLmHeadNames);
  const std::optional<std::string> embedding = checkpoint->FirstOf(kEmbeddingNames);
  std::optional<std::string> weight_name;
  if (config->tie_word_embeddings == true) {
    weight_name = embedding;
    if (!weight_name) {
      return with_name(absl::InvalidArgumentError(
          absl::StrCat(config_path, " sets tie_word_embeddings, but ", checkpoint->description(),
                       " has no input embedding (", absl::StrJoin(kEmbeddingNames, ", "), ")")));
    }
  } else if (config->tie_word_embeddings == false) {
    weight_name = lm_head;
    if (!weight_name) {
      return with_name(absl::InvalidArgumentError(absl::StrCat(
          checkpoint->description(), " has no tensor ", absl::StrJoin(kLmHeadNames, " or "), " (",
          config_path, " sets tie_word_embeddings to false)")));
    }
  } else {
    weight_name = lm_head ? lm_head : embedding;
    if (!weight_name) {
      return with_name(absl::InvalidArgumentError(absl::StrCat(
          checkpoint->description(), " has neither ", absl::StrJoin(kLmHeadNames, ", "),
          " nor a tied input embedding (", absl::StrJoin(kEmbeddingNames, ", "), ")")));
    }
  }

  absl::StatusOr<Checkpoint::Found> weight = checkpoint->Get(*weight_name);
  if (!weight.ok()) return with_name(weight.status());
  const SafetensorsTensor& w = *weight->tensor;
  const std::string where = absl::StrCat(weight->file, ":", *weight_name);
  const std::optional<FloatType> dtype = FloatTypeFromSafetensors(w.dtype);
  if (!dtype.has_value()) {
    return with_name(
        absl::InvalidArgumentError(absl::StrCat(where, ": dtype ", SafetensorsDTypeName(w.dtype),
                                                " is not a head weight type (BF16, F16 or F32)")));
  }
  if (w.shape.size() != 2 || w.shape[0] != config->vocab_size ||
      w.shape[1] != config->hidden_size) {
    return with_name(absl::InvalidArgumentError(
        absl::StrCat(where, ": shape ", ShapeText(w.shape), " is not [vocab_size, hidden_size] = [",
                     config->vocab_size, ", ", config->hidden_size, "] of ", config_path)));
  }
  if (absl::Status s = ValidateHeadShape(name, config->vocab_size, config->hidden_size, *dtype);
      !s.ok()) {
    return s;
  }

  auto head = std::make_shared<HeadWeights>();
  head->name = std::string(name);
  head->vocab_size = config->vocab_size;
  head->hidden_size = config->hidden_size;
  head->dtype = *dtype;
  head->weight.assign(w.data, w.data + w.bytes);
  head->transform = config->transform;
  head->source = where;

  if (const std::optional<std::string> bias_name = checkpoint->FirstOf(kLmBiasNames)) {
    absl::StatusOr<Checkpoint::Found> bias = checkpoint->Get(*bias_name);
    if (!bias.ok()) return with_name(bias.status());
    const SafetensorsTensor& b = *bias->tensor;
    const std::string bias_where = absl::StrCat(bias->file, ":", *bias_name);
    const std::optional<FloatType> bias_type = FloatTypeFromSafetensors(b.dtype);
    if (!bias_type.has_value()) {
      return with_name(absl::InvalidArgumentError(
          absl::StrCat(bias_where, ": dtype ", SafetensorsDTypeName(b.dtype),
                       " is not a float type (BF16, F16 or F32)")));
    }
    if (b.shape.size() != 1 || b.shape[0] != config->vocab_size) {
      return with_name(absl::InvalidArgumentError(
          absl::StrCat(bias_where, ": shape ", ShapeText(b.shape), " is not [vocab_size] = [",
                       config->vocab_size, "] of ", config_path)));
    }
    // Copied first: mapped tensor data is only byte-aligned, LoadAsFloat reads whole elements.
    const std::vector<uint8_t> raw(b.data, b.data + b.bytes);
    head->bias.resize(static_cast<size_t>(config->vocab_size));
    for (int64_t j = 0; j < config->vocab_size; ++j) {
      head->bias[static_cast<size_t>(j)] = kernels::LoadAsFloat(*bias_type, raw.data(), j);
    }
  }
  if (absl::Status s = CheckHeadFinite(name, *head); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(s.message(), " in ", where));
  }

  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  spdlog::info(
      "head {}: [{}, {}] {}{} from {} (logit_scale {}, logits_scaling {}, softcap {}) in {:.1f} "
      "ms",
      head->name, head->vocab_size, head->hidden_size, std::string(FloatTypeName(*dtype)),
      head->bias.empty() ? "" : " with bias", head->source, head->transform.logit_scale,
      head->transform.logits_scaling, head->transform.softcap, ms);
  return head;
}

}  // namespace logitserve
