#include "server/backend/shard_layout.h"

#include <algorithm>

#include "logitserve/kernels/block_stats.h"

namespace logitserve {

std::vector<ShardRange> MakeShardLayout(int64_t vocab, int shards,
                                        const std::vector<int64_t>& weights) {
  const int64_t nb = kernels::NumBlocks(vocab);
  std::vector<int64_t> w = weights;
  int64_t total = 0;
  for (int64_t x : w) total += x;
  if (static_cast<int>(w.size()) != shards || total <= 0) {
    w.assign(static_cast<size_t>(shards), 1);
    total = shards;
  }
  std::vector<ShardRange> layout;
  int64_t cum = 0;
  for (int s = 0; s < shards; ++s) {
    const int64_t b0 = nb * cum / total;
    cum += w[static_cast<size_t>(s)];
    const int64_t b1 = nb * cum / total;
    layout.push_back(ShardRange{s, std::min(vocab, b0 * kernels::kVocabBlock),
                                std::min(vocab, b1 * kernels::kVocabBlock)});
  }
  return layout;
}

std::vector<int> BlockOwners(const std::vector<ShardRange>& layout, int64_t vocab) {
  std::vector<int> owner(static_cast<size_t>(kernels::NumBlocks(vocab)), -1);
  for (const ShardRange& s : layout) {
    if (s.begin >= s.end) continue;  // an empty shard (possibly [V, V) at the end) owns nothing
    for (int64_t b = s.begin / kernels::kVocabBlock; b * kernels::kVocabBlock < s.end; ++b) {
      owner[static_cast<size_t>(b)] = s.shard;
    }
  }
  return owner;
}

}  // namespace logitserve
