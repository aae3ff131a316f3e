// Process-wide glibc malloc policy for processes that receive or build large messages (the
// server, and benchmarks that host a gRPC peer): keep large freed blocks for the next message
// instead of handing their pages back to the kernel.
//
// Why: by default glibc mmaps blocks of 128 KiB and more (the threshold rises only after such a
// block is freed, up to 32 MiB) and trims the heap whenever 128 KiB or more is free at its top,
// so every multi-MiB request faults all its pages in again. Measured on the 2-core build machine
// (an in-process gRPC echo of one message): 2 MiB 2.7-3.3 ms -> 0.9 ms, 8 MiB 9.6-15 ms ->
// 3.6-4.9 ms, page faults 329 K -> 36 K over the same calls (docs/performance-history.md).
//
// Cost: the heap keeps up to 1 GiB of freed memory (RSS stays near its high-water mark).
// Libraries must not call this (it changes the whole process); programs call it first in main.
#pragma once

namespace logitserve {

// Large blocks come from the heap (no mmap per block) and up to 1 GiB of free top-of-heap
// memory is kept. Call before any thread starts.
void KeepLargeAllocations();

}  // namespace logitserve
