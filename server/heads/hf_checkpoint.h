// Hugging Face model folders as heads: `--head NAME=DIR`.
//
// DIR holds config.json and either model.safetensors or a sharded checkpoint
// (model.safetensors.index.json, whose "weight_map" names the shard file of every tensor; shard
// files must lie in DIR itself). When both exist, model.safetensors wins, as in
// transformers' from_pretrained. Only the files holding the head's tensors are opened (mapped),
// and only those tensors are copied.
//
// config.json fields read (from "text_config" when the config has one, as multimodal models do,
// else from the top level; each field separately):
//   vocab_size, hidden_size   required integers; the head tensor must be [vocab_size, hidden_size]
//   tie_word_embeddings       bool or absent (see below)
//   final_logit_softcapping   Gemma 2/3 softcap c; absent or null = none; else finite and > 0
//   logit_scale               Cohere: logits are multiplied by it; absent or null = 1
//   logits_scaling            Granite: logits are divided by it; absent or null = 1
// A field present with the wrong JSON type is an error (never silently ignored). A transform
// field absent from the file takes transformers' class default where that is not "none":
// model_type gemma2 -> softcap 30, cohere / cohere2 -> logit_scale 0.0625 (null stays "none").
//
// Which tensor is the head (HF ties lm_head.weight to the input embedding when tied):
//   tie_word_embeddings true   the input embedding (model.embed_tokens.weight, or the
//                              multimodal model.language_model.embed_tokens.weight /
//                              language_model.model.embed_tokens.weight);
//   false                      lm_head.weight (or language_model.lm_head.weight), required;
//   absent                     lm_head.weight when the checkpoint has it, else the embedding.
//     transformers' own default is not one value (PretrainedConfig says true, LlamaConfig,
//     Qwen2Config and others say false), so rather than guess the model class we follow the
//     checkpoint: save_pretrained drops lm_head.weight exactly when it is tied, so a stored
//     lm_head.weight is an untied head and a missing one can only be the embedding.
// lm_head.bias (or language_model.lm_head.bias), when present, is the bias ([vocab_size], any
// float dtype, converted to fp32 exactly). The weight keeps its on-disk dtype: BF16, F16 or F32.
// Every value must be finite.
//
// Errors are InvalidArgument (NOT_FOUND for a missing config.json / checkpoint file, the OS code
// for unreadable files), prefixed with the head name and naming the file, the tensor or the
// config field at fault. Nothing here throws or aborts.
//
// Thread safety: free functions without shared state; call them from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/heads/head_weights.h"

namespace logitserve {

// What a config.json says about the head.
struct HfHeadConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  std::optional<bool> tie_word_embeddings;  // nullopt when absent or null
  HeadTransform transform;
};

// Parses config.json's text; `source` (the file path) prefixes error messages. Checks types and
// ranges (sizes within the head limits, transform valid per ValidateHeadTransform).
absl::StatusOr<HfHeadConfig> ParseHfConfig(absl::string_view json_text, absl::string_view source);

// Loads head `name` from the Hugging Face model folder `dir` (rules above). The head has version
// 1 and source "<shard file>:<tensor>".
absl::StatusOr<std::shared_ptr<HeadWeights>> LoadHfHead(absl::string_view name,
                                                        const std::string& dir);

}  // namespace logitserve
