// NameThisThread: names the calling thread, so that per-thread views (top -H,
// /proc/PID/task/*/comm, perf, gdb, bench/rpc/thread_cpu.py) tell the server's own threads apart
// from gRPC's. Linux allows 15 characters; longer names are cut. Threads a named thread starts
// inherit its name unless they name themselves (a library's pool started from a scheduler
// worker shows as ls-sched-worker). Best effort: a failure is ignored (the name is for people).
#pragma once

#include <pthread.h>

#include <cstdio>

namespace logitserve {

inline void NameThisThread(const char* name) {
  char cut[16];
  std::snprintf(cut, sizeof cut, "%s", name);
  (void)pthread_setname_np(pthread_self(), cut);
}

}  // namespace logitserve
