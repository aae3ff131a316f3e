// The logit transform, one description for every backend: the CPU kernels apply it to a row of
// fp32 logits (CpuApplyTransform), the CUDA kernels while loading (LogitsSource::transform). In
// Hugging Face's order:
//   x = acc + bias[j]; x = x * scale or x / scale; x = cap * tanh(x / cap); x = x / temperature
// Host and device: the struct is copied by value into kernel arguments.
#pragma once

namespace logitserve::kernels {

struct LogitTransform {
  // Hidden mode: x is a raw h . W^T and bias / scale / softcap apply. Logits mode (false): only
  // the temperature. (The CUDA loaders also make a GEMM's -0 +0 in hidden mode: its GEMM runs
  // over bf16 parts, see LaunchSplitToBf16; the CPU's fp32 GEMM needs no such step.)
  bool head = false;
  // Indexed from the first column of the range being transformed; null = no bias. Host memory
  // for the CPU kernels, device memory for the CUDA kernels.
  const float* bias = nullptr;
  float scale = 1.0f;  // 1 = none
  bool divide_by_scale =
      false;             // Granite's logits_scaling divides; Cohere's logit_scale multiplies
  float softcap = 0.0f;  // 0 = none
  float temperature = 1.0f;
};

}  // namespace logitserve::kernels
