// PreparedHead: a head made ready for one backend (converted, sharded, resident), as the head
// store holds it and a ScoreJob carries it. Backends derive from it (CpuHead, CudaHead) and
// downcast their own jobs' heads; to the store and the service it is opaque. It lives beside
// HeadWeights, not in server/backend, so the head registry depends on no backend: the graph is
// heads <- backend <- scheduler <- service.
//
// Thread safety: immutable once built; shared by const pointer between the store, in-flight jobs
// and the backend that made it.
#pragma once

#include <memory>
#include <utility>

#include "server/heads/head_weights.h"

namespace logitserve {

class PreparedHead {
 public:
  explicit PreparedHead(std::shared_ptr<const HeadWeights> weights)
      : weights_(std::move(weights)) {}
  virtual ~PreparedHead() = default;
  const HeadWeights& weights() const { return *weights_; }

 private:
  std::shared_ptr<const HeadWeights> weights_;
};

}  // namespace logitserve
