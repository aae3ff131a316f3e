"""thread_cpu.py's summary over synthetic /proc samples, and one real sample of this process."""
import os

import thread_cpu


def test_summarize_groups_by_name_and_counts_new_threads():
    before = {"1": ("logitserve", 100), "2": ("ls-copy", 0), "3": ("ls-copy", 50),
              "9": ("gone", 10)}
    after = {"1": ("logitserve", 150), "2": ("ls-copy", 100), "3": ("ls-copy", 60),
             "4": ("ls-finite-scan", 20)}
    rows = thread_cpu.summarize(before, after, seconds=2.0, tick=100)
    # ls-copy: (100 + 10) ticks over 2 s at 100 ticks/s = 55 %, busiest 50 %, two threads.
    assert rows[0] == ("ls-copy", 55.0, 50.0, 2)
    assert rows[1] == ("logitserve", 25.0, 25.0, 1)
    assert rows[2] == ("ls-finite-scan", 10.0, 10.0, 1)  # started during the interval
    assert [r[0] for r in rows] == ["ls-copy", "logitserve", "ls-finite-scan"]  # "gone" ended


def test_sample_reads_this_process():
    s = thread_cpu.sample(os.getpid())
    assert str(os.getpid()) in s  # the main thread's tid is the pid
    assert all(ticks >= 0 for _, ticks in s.values())
