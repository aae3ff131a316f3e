"""bench/cuda/ncu_sass.py over a small table laid out as ncu prints it (program output first,
then the SASS table); every expected number is counted by hand from the rows below."""
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ncu_sass  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed",'
          '"stall_long_sb","stall_wait","stall_wait (Not Issued)"')
ROWS = [
    '"0x10","      LDC R1, c[0x0][0x28]","1","1","1","100","0","1","1"',
    '"0x20","      FADD R2, R3, -R4","3","2","3","1,000","0","3","2"',
    '"0x30","      @!P1  BRA 0x7f00","40","30","40","500","40","0","0"',
    '"0x40","      FMNMX.NAN R3, R5, R6, !PT","2","2","2","1,000","0","2","2"',
    '"0x50","      HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], R88","7","7","7","250","0","7","7"',
    '"0x60","      FADD R7, R7, R8","5","5","5","1000","0","5","5"',
]


def table(header=HEADER, rows=ROWS):
    return io.StringIO("logitserve-kernel-bench: NVIDIA H200\n\"Kernel Name\",\"K\",\n"
                       + header + "\n" + "\n".join(rows) + "\n")


def test_reads_the_table_after_the_programs_output():
    lines = ncu_sass.load(table())
    assert [x.n for x in lines] == [0, 1, 2, 3, 4, 5]
    assert [x.executed for x in lines] == [100, 1000, 500, 1000, 250, 1000]
    assert [x.samples for x in lines] == [1, 3, 40, 2, 7, 5]
    # Only the all-samples reasons; the not-issued columns repeat a subset of them.
    assert lines[2].stalls == {"stall_long_sb": 40, "stall_wait": 0}


def test_opcodes_drop_predicates_and_keep_the_first_modifier():
    ops = [x.opcode for x in ncu_sass.load(table())]
    assert ops == ["LDC", "FADD", "BRA", "FMNMX.NAN", "HGMMA.64x128x16", "FADD"]


def test_summary_by_opcode_per_unit_over_a_range():
    lines = [x for x in ncu_sass.load(table()) if 1 <= x.n <= 5]
    out = io.StringIO()
    ncu_sass.summarise(lines, per=10.0, top=2, hot=1, out=out)
    text = out.getvalue().splitlines()
    assert text[0] == "lines 1-5: 3750 warp instructions (375.0 per unit), 57 stall samples"
    # FADD: 1,000 + 1,000 executed, 3 + 5 samples; then BRA or FMNMX.NAN (1,000) by count.
    assert text[3].split() == ["FADD", "200.0", "53.3%", "8"]
    assert text[4].split()[0] == "FMNMX.NAN" and text[4].split()[1] == "100.0"
    assert text[6] == "stall reasons: long_sb 40, wait 17"
    assert text[9].split()[:3] == ["2", "500", "40"]  # the hottest line: the branch


def test_missing_table_or_columns_are_errors():
    with pytest.raises(ValueError, match="no SASS table"):
        ncu_sass.load(io.StringIO("no profile here\n"))
    with pytest.raises(ValueError, match="SourceCounters"):
        ncu_sass.load(table(header='"Address","Source","Instructions Executed"', rows=[]))


def test_command_line(tmp_path, capsys):
    path = tmp_path / "prof.csv"
    path.write_text(table().getvalue())
    assert ncu_sass.main([str(path), "--lines", "2:3", "--top", "1", "--hot", "1"]) == 0
    assert capsys.readouterr().out.startswith("lines 2-3: 1500 warp instructions")
    with pytest.raises(SystemExit):
        ncu_sass.main([str(path), "--lines", "9:9"])
