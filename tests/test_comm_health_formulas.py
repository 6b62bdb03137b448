"""nccl-tests' definitions (doc/PERFORMANCE.md, src/<op>.cu GetCollByteCount / GetBw), the slow-link rule,
--min-busbw's forms and the bandwidth table's rendering. Pure: no process group."""

from __future__ import annotations

import pytest
from rich.console import Console

from distcheck.knowledge import nccl_tests as bw
from distcheck.diagnose.health import health_findings
from distcheck.diagnose.links import slow_links
from distcheck.options import scenario_options
from distcheck.errors import UsageError
from distcheck.report.health_table import bandwidth_table, is_bandwidth_table

MiB = 1 << 20


# nccl-tests' GetBw, written out from its sources: baseBw = bytes / 1e9 / sec; busBw = baseBw * factor.
def nccl_tests_bw(op: str, count: int, typesize: int, sec: float, nranks: int) -> tuple[float, float]:
    if op == "all_reduce":
        base = count * typesize / 1e9 / sec
        return base, base * 2 * (nranks - 1) / nranks
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        base = count * typesize * nranks / 1e9 / sec
        return base, base * (nranks - 1) / nranks
    base = count * typesize / 1e9 / sec   # broadcast, reduce, sendrecv
    return base, base


# nccl-tests' GetCollByteCount (src/<op>.cu) and setupArgs (src/common.cu), written out from its sources
# with its own bit mask: (send, recv, param) element counts of one call at a swept size.
def nccl_tests_counts(op: str, size: int, elt: int, nranks: int) -> tuple[int, int, int]:
    count = size // elt                                   # setupArgs: count = size / wordSize(type)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        base = (count // nranks) & ~(16 // elt - 1)       # (count/nranks) & ~(16/eltSize - 1)
        if op == "all_gather":
            return base, base * nranks, base
        return base * nranks, (base if op == "reduce_scatter" else base * nranks), base
    return count, count, count                           # all_reduce, broadcast, reduce, sendrecv


def nccl_tests_row(op: str, size: int, nranks: int, sec: float, elt: int = 4) -> tuple[int, int, float, float]:
    """(size column, count column, algbw, busbw) as <op>_perf prints them: size = max(sendBytes,
    expectedBytes), count = nbytes / wordSize = paramcount, bandwidths from GetBw(paramcount, ...)."""
    send, recv, param = nccl_tests_counts(op, size, elt, nranks)
    return (max(send, recv) * elt, param, *nccl_tests_bw(op, param, elt, sec, nranks))


def distcheck_row(op: str, size: int, n: int, sec: float) -> tuple[int, int, float, float]:
    c = bw.counts(op, size, 4, n)
    return (bw.size_column(c, 4), c.param, bw.algbw(op, c.param, 4, sec, n), bw.busbw(op, c.param, 4, sec, n))


NCCL_SWEEP = bw.sweep(8, 1 << 30, 2)            # all_reduce_perf -b 8 -e 1G -f 2
ODD_SIZES = [4, 12, 60, 100, 1000, 4000, 4004, 12345 * 4, 3 * MiB + 4]


@pytest.mark.parametrize("op", bw.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_every_row_is_nccl_tests_at_every_size_and_rank_count(op, n):
    sec = 1.234e-5
    for size in NCCL_SWEEP + ODD_SIZES:
        mine, theirs = distcheck_row(op, size, n, sec), nccl_tests_row(op, size, n, sec)
        assert mine[:2] == theirs[:2], (op, n, size)
        assert mine[2:] == pytest.approx(theirs[2:], rel=1e-12), (op, n, size)
        c = bw.counts(op, size, 4, n)
        assert (c.send, c.recv, c.param) == nccl_tests_counts(op, size, 4, n)


@pytest.mark.parametrize("row", [
    # op, ranks, swept bytes → size column, count column: worked by hand from nccl-tests' formulas
    ("all_gather", 8, 64, 0, 0),             # 16 floats / 8 = 2, & ~3 = 0: nccl-tests prints a 0-byte row
    ("all_gather", 8, 128, 128, 4),          # 32 / 8 = 4
    ("all_gather", 8, 256, 256, 8),
    ("all_gather", 8, 1000, 896, 28),        # 250 / 8 = 31, & ~3 = 28; 28 × 8 × 4 B
    ("all_gather", 4, 4000, 3968, 248),      # 1000 floats / 4 = 250, & ~3 = 248 (not 250)
    ("all_gather", 3, 64, 48, 4),            # 16 / 3 = 5, & ~3 = 4
    ("all_gather", 3, 4096, 4080, 340),      # 1024 / 3 = 341, & ~3 = 340
    ("reduce_scatter", 6, 1 << 20, 1048512, 43688),   # 262144 / 6 = 43690, & ~3 = 43688
    ("all_to_all", 6, 4096, 4032, 168),      # 1024 / 6 = 170, & ~3 = 168
    ("all_reduce", 6, 100, 100, 25),         # not split: every element
    ("broadcast", 3, 4096, 4096, 1024),
])
def test_hand_checked_rows(row):
    op, n, swept, size, count = row
    c = bw.counts(op, swept, 4, n)
    assert (bw.size_column(c, 4), c.param) == (size, count)


def test_hand_checked_bandwidths():
    """all_gather at 3 ranks, 4096 B swept: 340 floats per rank, S = 340 × 3 × 4 = 4080 B; at 1 µs
    algbw 4.08 GB/s, busbw × 2/3 = 2.72. all_reduce of 4 MiB at 8 ranks in 1 ms: 4.194 and × 14/8."""
    assert bw.algbw("all_gather", 340, 4, 1e-6, 3) == pytest.approx(4.08)
    assert bw.busbw("all_gather", 340, 4, 1e-6, 3) == pytest.approx(2.72)
    assert bw.algbw("all_reduce", MiB, 4, 1e-3, 8) == pytest.approx(4.194304)
    assert bw.busbw("all_reduce", MiB, 4, 1e-3, 8) == pytest.approx(4.194304 * 14 / 8)


def test_bus_factors_are_performance_md():
    n = 8
    assert bw.bus_factor("all_reduce", n) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bw.bus_factor(op, n) == pytest.approx(7 / 8)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bw.bus_factor(op, n) == 1.0


def test_all_gather_measures_the_whole_gathered_buffer():
    """4 MiB per rank at 4 ranks, 61.4 ms per call → algbw 0.273, busbw 0.205 GB/s."""
    c = bw.counts("all_gather", 16 * MiB, 4, 4)
    assert (c.send, c.recv, c.param) == (MiB, 4 * MiB, MiB)
    assert bw.size_column(c, 4) == 16 * MiB
    sec = 16 * MiB / 0.273e9
    assert bw.algbw("all_gather", c.param, 4, sec, 4) == pytest.approx(0.273)
    assert bw.busbw("all_gather", c.param, 4, sec, 4) == pytest.approx(0.205, abs=5e-4)


def test_columns_redop_and_root():
    assert [bw.redop(op) for op in bw.OPS] == ["sum", "none", "sum", "none", "sum", "none", "none"]
    assert [bw.root(op) for op in bw.OPS] == [-1, -1, -1, 0, 0, -1, -1]


def test_sweep_and_sizes_as_nccl_tests_reads_them():
    assert bw.sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert bw.sweep(64, 1 << 30, 4)[-1] == 1 << 30
    assert bw.parse_size("1G") == 1 << 30 and bw.parse_size("64M") == 64 * MiB and bw.parse_size("8") == 8
    assert bw.parse_size(4096.0) == 4096 and bw.parse_size("4KB") == 4096
    with pytest.raises(ValueError, match="not a size"):
        bw.parse_size("lots")
    with pytest.raises(ValueError, match="factor > 1"):
        bw.sweep(8, 128, 1)
    assert bw.sweep(8, 128, 2.0) == [8, 16, 32, 64, 128]
    with pytest.raises(ValueError, match="whole number, as nccl-tests' -f"):
        bw.sweep(8, 128, 1.5)
    assert bw.sweep(3, 100, 3) == [3, 9, 27, 81]   # size *= factor while size <= max, as common.cu's loop


def test_min_busbw_one_number_or_per_op():
    assert bw.parse_floors("10") == {"*": 10.0}
    floors = bw.parse_floors("all_reduce=10, all_gather=8")
    assert floors == {"all_reduce": 10.0, "all_gather": 8.0}
    assert bw.floor_of(floors, "all_gather") == 8.0 and bw.floor_of(floors, "broadcast") is None
    assert bw.floor_of(bw.parse_floors("5,reduce=1"), "broadcast") == 5.0
    for bad, why in (("allreduce=3", "unknown op"), ("all_reduce=x", "not a number"), ("0", "greater than 0")):
        with pytest.raises(ValueError, match=why):
            bw.parse_floors(bad)


def test_cli_refuses_a_bad_min_busbw_in_one_line():
    assert ("min_busbw", "all_reduce=10") in scenario_options([], "all_reduce=10")
    with pytest.raises(UsageError, match="unknown op 'allreduce'"):
        scenario_options([], "allreduce=10")


def _matrix(n: int, value: float = 1.0) -> dict[tuple[int, int], float]:
    return {(s, d): value for s in range(n) for d in range(n) if s != d}


def test_a_healthy_matrix_names_nothing():
    m = _matrix(4)
    m[0, 1] = 0.75   # within the margin
    assert slow_links(m) == []
    assert slow_links(_matrix(2)) == []


def test_a_rank_slow_to_send_is_named_not_its_pairs():
    m = _matrix(4)
    for dst in (0, 2, 3):
        m[1, dst] = 0.2
    [link] = slow_links(m)
    assert (link.kind, link.ranks, link.gbps, link.reference_gbps) == ("send", (1,), 0.2, 1.0)
    assert "rank 1 sends at 0.2 GB/s" in link.describe()


def test_a_slow_rank_is_slow_both_ways_and_one_slow_pair_is_a_pair():
    m = _matrix(8)
    for (s, d) in m:
        if 5 in (s, d):
            m[s, d] = 0.3
    assert {(link.kind, link.ranks) for link in slow_links(m)} == {("send", (5,)), ("recv", (5,))}
    m = _matrix(4)
    m[2, 3] = 0.5
    [link] = slow_links(m)
    assert (link.kind, link.ranks) == ("pair", (2, 3))
    assert "send/recv 2->3 runs at 0.5 GB/s, below 0.7× the median pair (1 GB/s)" == link.describe()


def test_requirement_severity_reaches_the_finding():
    req = {"name": "slow link send 1", "ok": False, "summary": "rank 1 sends slowly", "severity": "info", "data": {}}
    [finding] = health_findings({1: {"requirements": [req]}})
    assert finding.severity == "info" and finding.odd_ranks == (1,)
    [finding] = health_findings({0: {"requirements": [{**req, "severity": "error"}]}})
    assert finding.severity == "error"


def test_the_table_renders_nccl_tests_columns():
    placement = {"time_us": 1234.5, "algbw": 12.345, "busbw": 9.2587, "wrong": 0}
    table = {"title": "Bus bandwidth", "columns": [], "rows": [], "records": [
        {"op": "all_gather", "size": 16 * MiB, "count": MiB, "type": "float", "redop": "none", "root": -1,
         "out_of_place": placement, "in_place": {**placement, "wrong": None}},
        {"op": "all_reduce", "size": 4096, "count": 1024, "type": "float", "redop": "sum", "root": -1,
         "out_of_place": None, "in_place": {**placement, "busbw": 0.0123}},
        {"op": "reduce_scatter", "size": 0, "count": 0, "type": "float", "redop": "sum", "root": -1,
         "out_of_place": None, "in_place": {"time_us": 12.0, "algbw": 0.0, "busbw": 0.0, "wrong": 0}}]}
    assert is_bandwidth_table(table) and not is_bandwidth_table({"title": "t", "columns": [], "rows": []})
    console = Console(width=200, record=True)
    console.print(bandwidth_table(table))
    text = console.export_text()
    assert "out-of-place" in text and "in-place" in text and "#wrong" in text and "redop" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("all_gather"))
    assert row.split() == ["all_gather", str(16 * MiB), str(MiB), "float", "none", "-1",
                           "1234.5", "12.35", "9.26", "0", "1234.5", "12.35", "9.26", "N/A"]
    row = next(line for line in text.splitlines() if line.strip().startswith("all_reduce"))
    assert row.split()[6:] == ["-", "-", "-", "-", "1234.5", "12.35", "0.0123", "0"]
    row = next(line for line in text.splitlines() if line.strip().startswith("reduce_scatter"))
    assert row.split() == ["reduce_scatter", "0", "0", "float", "sum", "-1", "-", "-", "-", "-",
                           "12.0", "0.00", "0.00", "0"]   # a slice rounded down to 0: nccl-tests' 0-byte row
