// Vocabulary layout over shards: contiguous, ordered, block-aligned ranges (the last shard may be
// uneven; a shard may be empty). Shared by the CPU and CUDA backends.
#pragma once

#include <cstdint>
#include <vector>

#include "server/backend/backend.h"

namespace logitserve {

// `weights` (one per shard, >= 0, not all 0) sets each shard's share of the blocks; empty means
// equal shares. Shard s gets blocks [floor(nb * W_<s / W), floor(nb * W_<=s / W)).
std::vector<ShardRange> MakeShardLayout(int64_t vocab, int shards,
                                        const std::vector<int64_t>& weights);

// The shard that owns each global vocabulary block (empty shards own none).
std::vector<int> BlockOwners(const std::vector<ShardRange>& layout, int64_t vocab);

}  // namespace logitserve
