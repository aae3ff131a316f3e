// In-process Communicator: `size` ranks in one process exchange bytes through a shared buffer and
// meet at a generation-counting barrier (twice per collective: after depositing, after reading).
#include <cstring>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/backend/communicator.h"
#include "server/backend/host_barrier.h"

namespace logitserve {
namespace {

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<HostExchange> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  absl::Status AllGather(const void* send, void* recv, size_t bytes) override {
    if (group_->size() == 1) {
      if (bytes > 0) std::memcpy(recv, send, bytes);
      return absl::OkStatus();
    }
    group_->Deposit(rank_, send, bytes);
    group_->Wait();  // every rank's send buffer is published
    absl::Status status = absl::OkStatus();
    for (int r = 0; r < group_->size(); ++r) {
      const auto [data, n] = group_->Slot(r);
      if (n != bytes) {
        status = absl::InternalError("AllGather: ranks disagree on the message size");
        continue;
      }
      if (bytes > 0)
        std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(r) * bytes, data, bytes);
    }
    group_->Wait();  // nobody reuses its send buffer before every rank has read it
    return status;
  }

 private:
  std::shared_ptr<HostExchange> group_;
  int rank_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateInProcessCommunicators(int size) {
  if (size < 1) return absl::InvalidArgumentError("communicator size must be >= 1");
  auto group = std::make_shared<HostExchange>(size);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<InProcessCommunicator>(group, r));
  return comms;
}

}  // namespace logitserve
