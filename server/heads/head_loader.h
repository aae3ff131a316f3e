// Head loading: builds HeadWeights from the server's head flags.
//
//   --synthetic-head NAME:vocab=V,hidden=H,seed=S[,dtype=bf16|fp16|fp32]
//       A deterministic random head for demos, benchmarks and tests. The same spec gives the same
//       weight bits on every machine and build (integer PRNG, no libm transcendental functions).
//   --head NAME=FILE.safetensors:TENSOR
//       A 2-D [vocab, hidden] BF16 / F16 / F32 tensor of one safetensors file, copied as is.
//   --head NAME=DIR
//       A Hugging Face model folder (config.json + model.safetensors or a sharded
//       model.safetensors.index.json); see server/heads/hf_checkpoint.h.
//
// Every function validates fully and returns InvalidArgument with a message naming the head and
// the problem; nothing here aborts or throws. The functions are thread-compatible (no shared
// state): any thread may call them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/safetensors/safetensors.h"
#include "logitserve/kernels/dtype.h"
#include "server/heads/head_weights.h"

namespace logitserve {

// Limits on what a head may be. Generous for real models (Gemma: V = 262144; hidden sizes up to
// 16384) while keeping V within int32 target ids and refusing sizes that could only be mistakes.
inline constexpr size_t kMaxHeadNameLength = 128;
inline constexpr int64_t kMaxHeadVocab = int64_t{1} << 24;
inline constexpr int64_t kMaxHeadHidden = int64_t{1} << 17;
inline constexpr int64_t kMaxHeadWeightBytes = int64_t{1} << 36;  // 64 GiB

// Standard deviation, in nats, of a synthetic head's logits for hidden states with i.i.d.
// unit-normal components: each weight has variance (kSyntheticLogitStd^2 / H), so h.w has variance
// kSyntheticLogitStd^2. Real LM heads give logits with a spread of a few nats.
inline constexpr double kSyntheticLogitStd = 3.0;

// OK when `name` is a valid head name: 1..kMaxHeadNameLength characters from [A-Za-z0-9._-].
absl::Status ValidateHeadName(absl::string_view name);

// OK when a [vocab, hidden] head of `dtype` is within the limits above: vocab in
// [1, kMaxHeadVocab], hidden in [1, kMaxHeadHidden], weight bytes <= kMaxHeadWeightBytes.
// InvalidArgument naming head `name`, the size and the limit otherwise.
absl::Status ValidateHeadShape(absl::string_view name, int64_t vocab, int64_t hidden,
                               kernels::FloatType dtype);

// OK when the transform is one the backends apply exactly as the fp64 reference does: logit_scale
// and logits_scaling finite and > 0, at most one of them != 1 (the backends apply a single scale:
// no Hugging Face model has both), softcap finite and >= 0 (0 = none). InvalidArgument naming the
// offending field by its Hugging Face name (logit_scale, logits_scaling, final_logit_softcapping).
absl::Status ValidateHeadTransform(const HeadTransform& transform);

// OK when every weight and every bias value of `head` is finite; InvalidArgument naming head
// `name` and the first bad element ("weight [row, col] is nan", "bias [j] is inf") otherwise.
// NaN or +-inf weights would make every request on the head fail, so the head is rejected when
// loaded. Expects weight.size() == vocab * hidden * SizeOf(dtype) and bias empty or [vocab].
absl::Status CheckHeadFinite(absl::string_view name, const HeadWeights& head);

struct SyntheticHeadSpec {
  std::string name;
  int64_t vocab = 0;
  int64_t hidden = 0;
  uint64_t seed = 0;
  kernels::FloatType dtype = kernels::FloatType::kBFloat16;
};

// Parses "NAME:vocab=V,hidden=H,seed=S[,dtype=bf16|fp16|fp32]". Keys in any order, each at most
// once; vocab, hidden and seed required; decimal integers only.
absl::StatusOr<SyntheticHeadSpec> ParseSyntheticHeadSpec(absl::string_view spec);

// A [vocab, hidden] head of i.i.d. weights, zero-mean with standard deviation
// kSyntheticLogitStd / sqrt(hidden) (an Irwin-Hall sum of four uniforms: nearly normal, bounded at
// +-3.46 standard deviations). Element i (row-major) depends only on (seed, i), so the bits are
// the same whatever the machine or thread count. No bias, identity transform, version 1.
absl::StatusOr<std::shared_ptr<HeadWeights>> MakeSyntheticHead(
    absl::string_view name, int64_t vocab, int64_t hidden, uint64_t seed,
    kernels::FloatType dtype = kernels::FloatType::kBFloat16);
absl::StatusOr<std::shared_ptr<HeadWeights>> MakeSyntheticHead(const SyntheticHeadSpec& spec);

// Loads tensor `tensor` of the safetensors file `path` as head `name`: rank 2 [V, H], dtype BF16,
// F16 or F32 (kept as is), V and H >= 1, every value finite. A missing tensor is InvalidArgument
// listing the names the file has.
absl::StatusOr<std::shared_ptr<HeadWeights>> LoadSafetensorsHead(absl::string_view name,
                                                                 const std::string& path,
                                                                 absl::string_view tensor);

struct HeadFileSpec {
  std::string name;
  std::string path;
  std::string tensor;
};

// Parses "NAME=FILE.safetensors:TENSOR" (the path may contain ':'; the tensor name is what follows
// the last one). Does not touch the file system.
absl::StatusOr<HeadFileSpec> ParseHeadFileSpec(absl::string_view flag);

// A --head flag: "NAME=DIR" when what follows '=' is a directory (a Hugging Face model folder,
// loaded by LoadHfHead), else "NAME=FILE.safetensors:TENSOR" (ParseHeadFileSpec, then
// LoadSafetensorsHead).
absl::StatusOr<std::shared_ptr<HeadWeights>> ParseHeadFlag(absl::string_view flag);

}  // namespace logitserve
