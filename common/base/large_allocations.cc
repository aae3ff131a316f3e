#include "common/base/large_allocations.h"

#include <malloc.h>

namespace logitserve {

void KeepLargeAllocations() {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace logitserve
