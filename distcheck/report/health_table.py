"""The node check's bandwidth table in the terminal, laid out as nccl-tests prints it: size, count, type,
redop, root, then time / algbw / busbw / #wrong out of place and in place, one row per op and size."""

from __future__ import annotations

from typing import Any

from rich.table import Table

_GROUP = ("time", "algbw", "busbw", "#wrong")


def is_bandwidth_table(table: dict[str, Any]) -> bool:
    """The comm_health sweep's table: its records carry nccl-tests' two placements."""
    records = table.get("records") or []
    return bool(records) and "out_of_place" in records[0]


def bandwidth_table(table: dict[str, Any]) -> Table:
    out = Table(title=table["title"], title_justify="left", box=None, padding=(0, 1), header_style="dim")
    out.add_column("op", justify="left")
    for column in ("size", "count", "type", "redop", "root"):
        out.add_column(column, justify="right")
    for placement in ("out-of-place", "in-place"):
        for i, column in enumerate(_GROUP):
            out.add_column(f"{placement if i == 0 else ''}\n{column}", justify="right")
    for r in table["records"]:
        out.add_row(r["op"], str(r["size"]), str(r["count"]), r["type"], r["redop"], str(r["root"]),
                    *_cells(r["out_of_place"]), *_cells(r["in_place"]))
    return out


def _cells(p: dict[str, Any] | None) -> list[str]:
    if p is None:
        return ["-"] * len(_GROUP)
    wrong = "N/A" if p["wrong"] is None else str(p["wrong"])
    return [f"{p['time_us']:.1f}", _bw(p["algbw"]), _bw(p["busbw"]), wrong]


def _bw(gbps: float) -> str:
    """nccl-tests' two decimals where they say something (and for a 0-byte row's 0), three significant
    digits below 1 GB/s."""
    return f"{gbps:.2f}" if gbps >= 1 or gbps == 0 else f"{gbps:.3g}"
