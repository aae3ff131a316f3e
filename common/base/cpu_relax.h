// One pause of a spin-wait loop: the x86 PAUSE / arm64 YIELD hint (lets the sibling hyperthread
// run and keeps the loop from flooding the memory system); a no-op elsewhere.
#pragma once

namespace logitserve {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace logitserve
