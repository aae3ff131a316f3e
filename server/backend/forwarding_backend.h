// ForwardingBackend: a Backend decorator base that forwards every call to the backend it wraps;
// subclasses override what they change (fault injection, test recorders).
//
// Thread safety: as the wrapped backend.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/backend/backend.h"

namespace logitserve {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  std::string name() const override { return inner_->name(); }
  std::vector<ShardRange> ShardLayout(int64_t vocab) const override {
    return inner_->ShardLayout(vocab);
  }
  absl::StatusOr<std::shared_ptr<const PreparedHead>> PrepareHead(
      std::shared_ptr<const HeadWeights> weights) override {
    return inner_->PrepareHead(std::move(weights));
  }
  absl::Status Score(const ScoreJob& job, ScoreResult* result) override {
    return inner_->Score(job, result);
  }
  absl::Status Health() const override { return inner_->Health(); }
  std::vector<MemoryInfo> MemoryUsage() const override { return inner_->MemoryUsage(); }

 protected:
  Backend& inner() const { return *inner_; }

 private:
  const std::unique_ptr<Backend> inner_;
};

}  // namespace logitserve
