"""nccl-tests' definitions (doc/PERFORMANCE.md, src/<op>.cu GetCollByteCount / GetBw), the slow-link rule,
--min-busbw's forms and the bandwidth table's rendering. Pure: no process group."""

from __future__ import annotations

import pytest
from rich.console import Console

from distcheck import bandwidth as bw
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


@pytest.mark.parametrize("op", bw.OPS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_algbw_and_busbw_are_nccl_tests(op, n):
    c = bw.counts(op, 64 * MiB, 4, n)
    sec = 1.234e-3
    assert (bw.algbw(op, c.param, 4, sec, n), bw.busbw(op, c.param, 4, sec, n)) == pytest.approx(
        nccl_tests_bw(op, c.param, 4, sec, n))


def test_bus_factors_are_performance_md():
    n = 8
    assert bw.bus_factor("all_reduce", n) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bw.bus_factor(op, n) == pytest.approx(7 / 8)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bw.bus_factor(op, n) == 1.0


def test_all_gather_measures_the_whole_gathered_buffer():
    """The issue's numbers: 4 MiB per rank at 4 ranks, 61.4 ms per call → algbw 0.273, busbw 0.205 GB/s."""
    c = bw.counts("all_gather", 16 * MiB, 4, 4)
    assert (c.send, c.recv, c.param) == (MiB, 4 * MiB, MiB)
    assert bw.size_column(c, 4) == 16 * MiB
    sec = 16 * MiB / 0.273e9
    assert bw.algbw("all_gather", c.param, 4, sec, 4) == pytest.approx(0.273)
    assert bw.busbw("all_gather", c.param, 4, sec, 4) == pytest.approx(0.205, abs=5e-4)


def test_counts_are_get_coll_byte_count():
    n, size = 4, 1000 * 4   # 1000 floats: not a multiple of... 4 ranks: 250 each
    assert bw.counts("all_reduce", size, 4, n) == bw.Counts(1000, 1000, 1000)
    assert bw.counts("all_gather", size, 4, n) == bw.Counts(250, 1000, 250)
    assert bw.counts("reduce_scatter", size, 4, n) == bw.Counts(1000, 250, 250)
    assert bw.counts("all_to_all", size, 4, n) == bw.Counts(1000, 1000, 250)
    assert bw.counts("all_gather", 1002 * 4, 4, n) == bw.Counts(250, 1000, 250)   # rounded down, as nccl-tests
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bw.counts(op, size, 4, n) == bw.Counts(1000, 1000, 1000)


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
         "out_of_place": None, "in_place": {**placement, "busbw": 0.0123}}]}
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
