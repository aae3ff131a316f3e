// Process-wide absl::Mutex policy for release builds: no deadlock detection.
//
// Why: Debian's abseil (the library the server links) is built without NDEBUG, so every
// absl::Mutex Lock / Unlock in the process runs the debug-only lock-order check, which updates a
// global lock graph under a global spin lock. Measured on the 2-core build machine (one thread,
// uncontended, 1 M Lock + Unlock): 91-98 ns with the check, 17-22 ns without; under contention the
// global lock serializes every thread's Lock. The scheduler, the shared-memory registry, the
// metrics and the streams take several locks per request. The check finds lock-order bugs, so
// debug builds of this project (no NDEBUG) keep it.
//
// Libraries must not call this (it changes the whole process); programs call it first in main.
#pragma once

namespace logitserve {

// In a build with NDEBUG: absl::SetMutexDeadlockDetectionMode(kIgnore). Otherwise nothing.
void UseFastMutexes();

}  // namespace logitserve
