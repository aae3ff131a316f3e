#!/usr/bin/env python3
"""Summarises Nsight Compute's SASS source view: where a kernel's instructions and stalls are.

On the GPU machine (nsys does not run there; this view does):

  ncu --clock-control none --section SourceCounters --section WarpStateStats \\
      --page source --print-source sass --csv -k regex:KERNEL -c 1 BINARY ARGS > prof.csv

Then, anywhere:

  python3 bench/cuda/ncu_sass.py prof.csv [--lines A:B] [--per N] [--top 25] [--hot 15]

prints the executed warp instructions and stall samples by opcode (over SASS lines A..B when
given, each count divided by N: e.g. the number of warp x subtile units, to read instructions per
unit), the stall reasons of that range, and its lines with the most stall samples. Lines are
numbered from 0 in the order ncu prints them (the `n` column). docs/PERFORMANCE.md shows what it
found in the fused hidden-mode kernel (2026-12-03, midday).
"""
import argparse
import collections
import csv
import re
import sys

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)?)")


class Line:
    """One SASS line: its source text, executed warp instructions, stall samples by reason."""

    def __init__(self, n, source, executed, samples, stalls):
        self.n = n
        self.source = source
        self.executed = executed
        self.samples = samples
        self.stalls = stalls

    @property
    def opcode(self):
        """The opcode with its first modifier (FMNMX.NAN, SYNCS.PHASECHK), predicate dropped."""
        m = _OPCODE.match(self.source)
        return m.group(1) if m else self.source.split(" ")[0]


def _int(text):
    text = text.replace(",", "").strip()
    return int(float(text)) if text not in ("", "-") else 0


def load(lines):
    """Parses ncu's CSV (the program's own output may precede the table) into Lines."""
    rows = iter(csv.reader(lines))
    for header in rows:
        if header and header[0] == "Address":
            break
    else:
        raise ValueError("no SASS table (a row starting with \"Address\"): was --page source "
                         "--print-source sass --csv given?")
    col = {name: i for i, name in enumerate(header)}
    for need in ("Source", EXECUTED, SAMPLES):
        if need not in col:
            raise ValueError("the SASS table has no column %r (add --section SourceCounters)" % need)
    stall_cols = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    out = []
    for row in rows:
        if len(row) < len(header):
            continue
        out.append(Line(len(out), row[col["Source"]].strip(), _int(row[col[EXECUTED]]),
                        _int(row[col[SAMPLES]]), {h: _int(row[col[h]]) for h in stall_cols}))
    return out


def summarise(lines, per=1.0, top=25, hot=15, out=None):
    out = out or sys.stdout
    executed = sum(x.executed for x in lines)
    samples = sum(x.samples for x in lines)
    out.write("lines %d-%d: %d warp instructions (%.1f per unit), %d stall samples\n"
              % (lines[0].n, lines[-1].n, executed, executed / per, samples))
    by_op = collections.Counter()
    samples_by_op = collections.Counter()
    for x in lines:
        by_op[x.opcode] += x.executed
        samples_by_op[x.opcode] += x.samples
    out.write("\n%-24s %12s %7s %9s\n" % ("opcode", "per unit", "share", "samples"))
    for op, count in by_op.most_common(top):
        out.write("%-24s %12.1f %6.1f%% %9d\n" % (op, count / per, 100.0 * count / max(executed, 1),
                                                  samples_by_op[op]))
    reasons = collections.Counter()
    for x in lines:
        reasons.update(x.stalls)
    out.write("\nstall reasons: %s\n" % ", ".join(
        "%s %d" % (r[len("stall_"):], c) for r, c in reasons.most_common() if c))
    out.write("\n%6s %12s %8s  %s\n" % ("line", "executed", "samples", "source"))
    for x in sorted(lines, key=lambda x: -x.samples)[:hot]:
        out.write("%6d %12d %8d  %s\n" % (x.n, x.executed, x.samples, x.source))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--lines", help="A:B, the SASS lines to summarise (inclusive; default all)")
    p.add_argument("--per", type=float, default=1.0, help="divide instruction counts by this")
    p.add_argument("--top", type=int, default=25, help="opcodes to list")
    p.add_argument("--hot", type=int, default=15, help="lines with the most stall samples to list")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        lines = load(f)
    if args.lines:
        a, b = (int(v) for v in args.lines.split(":"))
        lines = [x for x in lines if a <= x.n <= b]
    if not lines:
        p.error("no SASS lines in that range")
    summarise(lines, args.per, args.top, args.hot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
