"""Every ending named as it is: --timeout during a slow start-up (ranks still importing) is "reached --timeout during
start-up", exit 4, no hang finding and never a pass; a rank blocked on a rendezvous endpoint nobody answers gets the
rendezvous hint, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "scripts" / "startup" / "slow_import.py"


def _only(run) -> dict:
    [s] = run.report["scenarios"]
    return s


@pytest.mark.parametrize("mode", ["import", "endpoint"])
def test_timeout_during_start_up_is_said_as_such(distcheck, mode):
    r = distcheck("run", str(SCRIPT), "--nproc-per-node", "2", "--timeout", "8", "--", mode)
    s = _only(r)
    assert r.returncode == 4 and s["end_reason"] == "timeout" and not s["ok"], r.stdout[-2000:]
    assert not [f for f in s["findings"] if f["kind"] == "hang"]
    [note] = [f for f in s["findings"] if (f.get("data") or {}).get("during_startup")]
    assert "reached --timeout (8 s) during start-up" in note["summary"] and "Nothing was checked" in note["summary"]
    rendezvous = "check that every rank can reach the rendezvous endpoint" in note["summary"]
    assert rendezvous == (mode == "endpoint")
    assert "PASS" not in r.stdout
