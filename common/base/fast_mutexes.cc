#include "common/base/fast_mutexes.h"

#include "absl/synchronization/mutex.h"

namespace logitserve {

void UseFastMutexes() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace logitserve
