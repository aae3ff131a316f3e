// HeadWeights: one language-model head (the LM-head matrix W [V, H] plus its logit transform) as
// loaded on the host, before a backend prepares it for compute. Immutable once built; shared by
// const pointer between the head store, backends and in-flight requests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "logitserve/kernels/dtype.h"

namespace logitserve {

// z = softcap(scale(h W^T + bias)), matching Hugging Face's forward passes exactly:
//   Cohere multiplies by `logit_scale`, Granite divides by `logits_scaling`,
//   Gemma 2/3 apply softcap(x) = c tanh(x / c) with c = `final_logit_softcapping`.
struct HeadTransform {
  float logit_scale = 1.0f;     // multiplier (1 = none)
  float logits_scaling = 1.0f;  // divisor (1 = none)
  float softcap = 0.0f;         // c (0 = none)
};

struct HeadWeights {
  std::string name;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  kernels::FloatType dtype = kernels::FloatType::kFloat32;
  // Row-major [vocab_size, hidden_size] elements of `dtype`, little-endian.
  std::vector<uint8_t> weight;
  // Empty, or vocab_size fp32 values.
  std::vector<float> bias;
  HeadTransform transform;
  uint64_t version = 1;
  std::string source;  // file path, or "synthetic:..."
};

}  // namespace logitserve
