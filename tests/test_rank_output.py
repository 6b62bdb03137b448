"""launch/rank_output: the ranks' log lines followed as they are written, each line whole."""

from __future__ import annotations

from pathlib import Path

from distcheck.launch.rank_output import RankOutput


def test_lines_come_whole_per_rank_and_the_last_words_at_stop(tmp_path: Path):
    got: list[tuple[int, str]] = []
    follow = RankOutput(tmp_path, lambda rank, line: got.append((rank, line)))
    (tmp_path / "rank0.log").write_bytes(b"step 0\nstep 1 par")
    (tmp_path / "rank1.log").write_bytes(b"hello\r\n")
    (tmp_path / "launcher.log").write_bytes(b"torch's own\n")   # not a rank's
    follow.drain()
    assert got == [(0, "step 0"), (1, "hello")]
    with open(tmp_path / "rank0.log", "ab") as f:
        f.write("tial\nbye \u00e9".encode())
    follow.drain()
    assert got[2:] == [(0, "step 1 partial")]
    follow.stop()   # never started: stop still drains what is left, the unterminated line too
    assert got[3:] == [(0, "bye \u00e9")]


def test_a_long_log_is_read_to_its_end_at_stop(tmp_path: Path):
    got: list[str] = []
    lines = [f"line {i} " + "x" * 100 for i in range(2000)]   # > one 64 KiB read
    (tmp_path / "rank0.log").write_text("\n".join(lines) + "\n")
    follow = RankOutput(tmp_path, lambda rank, line: got.append(line))
    follow.start()
    follow.stop()
    assert got == lines
