#!/usr/bin/env python3
"""Per-thread CPU of a running process over an interval, grouped by thread name.

Issue 12's question is which of the server's threads bound the wire: its own are named ls-*
(ls-sched-worker, ls-copy, ls-finite-scan, ls-shm-channel, ls-metrics-http, ls-cpu-rank);
gRPC's carry gRPC's names or the process name. Run it beside a wire benchmark's end-to-end
phase; a thread near 100 % of one core while the rest idle is a serial bound.

  thread_cpu.py PID [SECONDS]   per name: CPU % of one core over the interval, the busiest
                                thread of that name, and how many threads have it
"""
import collections
import os
import sys
import time


def sample(pid):
    """{tid: (name, utime + stime in clock ticks)} of every thread of `pid` (read from /proc)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended between listdir and open
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]  # a name may hold spaces and ')'
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def summarize(before, after, seconds, tick):
    """[(name, total %, busiest %, threads)] by total, from two samples `seconds` apart.

    A thread absent from `before` started during the interval (all its ticks count); one absent
    from `after` ended (its last ticks are lost, as /proc no longer has them)."""
    by_name = collections.defaultdict(list)
    for tid, (name, ticks) in after.items():
        start = before.get(tid, (name, 0))[1]
        by_name[name].append(100.0 * (ticks - start) / tick / seconds)
    rows = [(name, sum(v), max(v), len(v)) for name, v in by_name.items()]
    return sorted(rows, key=lambda r: -r[1])


def main():
    pid = int(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    before = sample(pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = sample(pid)
    rows = summarize(before, after, time.monotonic() - t0, os.sysconf("SC_CLK_TCK"))
    print(f"pid {pid}: {sum(r[1] for r in rows):.0f} % of one core over {seconds:.1f} s")
    for name, total, busiest, count in rows:
        if total >= 1:
            print(f"  {name:<16} {total:6.0f} %  busiest {busiest:5.0f} %  threads {count}")


if __name__ == "__main__":
    main()
