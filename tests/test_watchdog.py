"""StallDetector rules on synthetic observations (pure, injected clock)."""

import pytest

from distcheck.launch.progress import RankProgress
from distcheck.launch.watchdog import Decision, Limits, StallDetector
from distcheck.models import EndReason


def ranks(**by_rank: RankProgress) -> dict[int, RankProgress]:
    return {int(k[1:]): v for k, v in by_rank.items()}


# Ranks whose sidecar synced after their newest record (settled), as a live rank's normally is.
RUNNING = RankProgress(records=2, phase="running", settled=True)
FINISHED = RankProgress(records=2, phase="finished", settled=True)
WAITING = RankProgress(records=3, open_collectives=1, phase="running", current="barrier #1 [group 0]", settled=True)


def detector(**limits) -> StallDetector:
    return StallDetector(world_size=2, limits=Limits(**{"stall_timeout": 5.0, **limits}), start=0.0)


def test_waiting_rank_without_progress_is_a_stall_only_after_the_timeout():
    d = detector()
    assert d.observe(0.0, ranks(r0=WAITING, r1=FINISHED)) is Decision.CONTINUE
    assert d.observe(4.9, ranks(r0=WAITING, r1=FINISHED)) is Decision.CONTINUE
    assert d.observe(5.0, ranks(r0=WAITING, r1=FINISHED)) is Decision.STALL
    assert d.last_progress == 0.0


def test_progress_resets_the_stall_clock():
    d = detector()
    d.observe(0.0, ranks(r0=WAITING, r1=RUNNING))
    later = RankProgress(records=5, open_collectives=1, phase="running", settled=True)
    assert d.observe(4.0, ranks(r0=later, r1=RUNNING)) is Decision.CONTINUE
    assert d.observe(8.9, ranks(r0=later, r1=RUNNING)) is Decision.CONTINUE
    assert d.observe(9.0, ranks(r0=later, r1=RUNNING)) is Decision.STALL


def test_no_stall_while_nobody_waits_in_a_collective():
    d = detector()
    d.observe(0.0, ranks(r0=RUNNING, r1=FINISHED))
    assert d.observe(100.0, ranks(r0=RUNNING, r1=FINISHED)) is Decision.CONTINUE


def test_slow_start_is_not_a_hang():
    d = detector(startup_timeout=60.0)
    starting = RankProgress(records=0, phase="starting")
    d.observe(0.0, ranks(r0=WAITING, r1=starting))
    assert d.observe(30.0, ranks(r0=WAITING, r1=starting)) is Decision.CONTINUE
    assert d.observe(60.0, ranks(r0=WAITING, r1=starting)) is Decision.STALL


def test_all_finished_releases_the_ranks():
    d = detector()
    assert d.observe(1.0, ranks(r0=FINISHED, r1=FINISHED)) is Decision.RELEASE


def test_missing_rank_is_not_all_finished():
    d = detector()
    assert d.observe(1.0, ranks(r0=FINISHED)) is Decision.CONTINUE


def test_timeout_and_max_duration():
    assert detector(timeout=10.0).observe(10.0, ranks(r0=RUNNING, r1=RUNNING)) is Decision.TIMEOUT
    assert detector(max_duration=3.0).observe(3.0, ranks(r0=RUNNING, r1=RUNNING)) is Decision.MAX_DURATION


def test_dead_rank_with_no_teardown_is_a_stall_backstop():
    d = detector()
    dead = RankProgress(records=2, phase="running", alive=False)
    d.observe(0.0, ranks(r0=WAITING, r1=dead))
    assert d.observe(4.9, ranks(r0=WAITING, r1=dead)) is Decision.CONTINUE
    assert d.observe(5.0, ranks(r0=WAITING, r1=dead)) is Decision.STALL


# -- certain hangs (the wait-for graph), progress evidence, records not yet synced ---------------------------

def in_call(group: str, seq: int, members: tuple, signature: str = "barrier - -", entered: dict | None = None,
            settled: bool = True) -> RankProgress:
    return RankProgress(records=seq, open_collectives=1, phase="running", settled=settled,
                        waits=((group, seq, members, signature),), entered={group: seq, **(entered or {})})


def done(entered: dict, phase: str = "finished", alive: bool = True) -> RankProgress:
    return RankProgress(records=1, phase=phase, alive=alive, settled=True, entered=entered)


def test_a_rank_waiting_for_finished_peers_is_a_certain_hang_without_the_stall_timeout():
    d = StallDetector(world_size=4, limits=Limits(stall_timeout=30.0), start=0.0)
    seen = {0: in_call("0", 5, (0, 1, 2, 3)), 1: done({"0": 4}), 2: done({"0": 4}), 3: done({"0": 4})}
    assert d.confirm_due() is None
    assert d.observe(1.0, seen) is Decision.CONTINUE          # seen once: confirmed at the next poll
    assert d.confirm_due() == pytest.approx(1.2)              # which the watchdog takes then, not a poll later
    assert d.observe(1.3, seen) is Decision.DEADLOCK
    assert d.certain.waiting == (0,) and d.certain.evidence == "certain: ranks 1, 2, 3 finished"


def test_ranks_in_one_call_are_followed_once_and_an_unsettled_one_does_not_speak_for_the_others():
    """certain_hang follows a call's absent members from one settled rank in it, not from each: with 2,048 ranks
    waiting while 2,048 others are on their way, none is certain; an unsettled rank found free says nothing of
    a settled one in the same call, whose peer finished."""
    from distcheck.diagnose.waitfor import certain_hang

    world = tuple(range(4096))
    on_the_way = RankProgress(records=4, phase="running", settled=True, entered={"0": 4})
    seen = {r: in_call("0", 5, world) if r % 2 else on_the_way for r in world}
    assert certain_hang(seen) is None
    seen = {0: in_call("0", 5, (0, 1, 2), settled=False), 1: in_call("0", 5, (0, 1, 2)), 2: done({"0": 4})}
    hang = certain_hang(seen)
    assert hang is not None and hang.waiting == (1,) and hang.evidence == "certain: rank 2 finished"


def test_a_peer_that_already_entered_the_call_is_not_awaited():
    d = detector()
    seen = {0: in_call("0", 5, (0, 1)), 1: done({"0": 5})}   # rank 1 entered #5 and finished: #5 completes
    d.observe(1.0, seen)
    assert d.observe(1.5, seen) is Decision.CONTINUE


def test_send_send_is_a_cycle():
    d = detector(stall_timeout=30.0)
    seen = {0: in_call("p2p:0>1", 1, (0, 1), "send 4 float32"), 1: in_call("p2p:1>0", 1, (1, 0), "send 4 float32")}
    d.observe(1.0, seen)
    assert d.observe(1.3, seen) is Decision.CONTINUE   # both still inside calls: confirmed over a second
    assert d.observe(2.0, seen) is Decision.DEADLOCK
    assert d.certain.reason == "cycle" and d.certain.waiting == (0, 1)


def test_a_wait_on_a_running_rank_is_not_certain():
    d = detector(stall_timeout=30.0)
    seen = {0: in_call("0", 5, (0, 1)), 1: RankProgress(records=4, phase="running", settled=True, entered={"0": 4})}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.CONTINUE


def test_a_record_not_synced_since_its_last_change_is_not_certain_and_delays_the_stall():
    # rank 1 may be in a C++-issued call its sidecar has not written yet
    d = detector()
    unsynced = RankProgress(records=4, open_collectives=1, phase="running", settled=False,
                            waits=(("0", 4, (0, 1), "all_reduce 5 float32"),), entered={"0": 4})
    seen = {0: in_call("0", 5, (0, 1)), 1: unsynced}
    d.observe(0.0, seen)
    assert d.observe(1.0, seen) is Decision.CONTINUE
    assert d.observe(9.9, seen) is Decision.CONTINUE     # stall timeout 5 s + 5 s grace for the sidecar
    assert d.observe(10.0, seen) is Decision.STALL


def _created_pair_first(rank: int) -> RankProgress:
    """Ranks 0-2 made new_group([0, 1]) then new_group(all), and wait in the all_reduce on the latter."""
    return RankProgress(records=3, open_collectives=1, phase="running", settled=True,
                        waits=(("2", 1, (0, 1, 2, 3), "all_reduce 1 float32 - -"),), entered={"new_group": 2, "2": 1},
                        left=(("new_group", 1, "new_group - - - 0,1"), ("new_group", 2, "new_group - - - 0,1,2,3")))


def test_a_rank_in_a_new_group_its_peers_left_after_other_members_is_certain():
    d = StallDetector(world_size=4, limits=Limits(stall_timeout=30.0), start=0.0)
    last = in_call("new_group", 1, (0, 1, 2, 3), "new_group - - - 0,1,2,3")
    seen = {0: _created_pair_first(0), 1: _created_pair_first(1), 2: _created_pair_first(2), 3: last}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.DEADLOCK and d.certain.reason == "clash"
    assert d.certain.waiting == (0, 3)   # the first waiting rank, and the one it waits for
    assert d.certain.evidence.startswith("certain: rank 3 waits in new_group #1, which rank 0 left after")


@pytest.mark.parametrize("theirs, mine", [
    # a broadcast's root returns before a receiver has its data: that call is completing, not stuck
    ("broadcast 4 float32 0 -", "broadcast 4 float32 0 -"),
    # other shapes may yet complete or abort the rank (gloo): left to the stall timeout
    ("all_reduce 4 float32 - -", "all_reduce 8 float32 - -"),
])
def test_a_peer_that_left_a_call_that_may_pair_leaves_it_open(theirs, mine):
    d = detector(stall_timeout=30.0)
    peer = RankProgress(records=2, phase="running", settled=True, entered={"0": 2}, left=(("0", 2, theirs),))
    seen = {0: peer, 1: in_call("0", 2, (0, 1), mine)}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.CONTINUE


def test_same_call_with_fingerprints_that_cannot_match_is_certain():
    d = detector(stall_timeout=30.0)
    seen = {0: in_call("0", 3, (0, 1), "all_reduce 577 float32 - -"), 1: in_call("0", 3, (0, 1), "barrier - - - -")}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.DEADLOCK and d.certain.reason == "clash"


def test_same_op_with_other_shapes_in_one_call_is_left_to_the_stall():
    """NCCL runs it (no size check); gloo aborts a rank, or lets some through: not certain, whoever waits in it."""
    d = detector(stall_timeout=30.0)
    seen = {0: in_call("0", 3, (0, 1), "all_reduce 577 float32 - -"), 1: in_call("0", 3, (0, 1), "all_reduce () float32 - -")}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.CONTINUE


def test_same_call_with_matching_fingerprints_is_completing():
    d = detector(stall_timeout=30.0)
    seen = {0: in_call("0", 3, (0, 1), "all_reduce 577 float32"), 1: in_call("0", 3, (0, 1), "all_reduce 577 float32")}
    d.observe(1.0, seen)
    assert d.observe(2.0, seen) is Decision.CONTINUE


def test_a_rank_making_progress_without_cpu_is_late_until_the_busy_timeout():
    d = detector(busy_timeout=60.0)
    downloading = RankProgress(records=2, phase="running", settled=True, evidence="read or wrote 1.2 MB in the last 0.5 s")
    d.observe(0.0, ranks(r0=downloading, r1=WAITING))
    assert d.observe(30.0, ranks(r0=downloading, r1=WAITING)) is Decision.CONTINUE
    assert d.waiting_for_late(30.0, ranks(r0=downloading, r1=WAITING)) == [0]
    assert d.observe(60.0, ranks(r0=downloading, r1=WAITING)) is Decision.BUSY_TIMEOUT   # its own end reason
    assert Decision.BUSY_TIMEOUT.end_reason is EndReason.BUSY_TIMEOUT
    assert Decision.DEADLOCK.end_reason is EndReason.CERTAIN_HANG


def test_a_rank_that_stopped_making_progress_is_stuck_a_stall_timeout_later():
    d = detector()
    busy = RankProgress(records=2, phase="running", settled=True, evidence="its stack moved")
    blocked = RankProgress(records=2, phase="running", settled=True)
    d.observe(0.0, ranks(r0=busy, r1=WAITING))
    assert d.observe(4.0, ranks(r0=busy, r1=WAITING)) is Decision.CONTINUE
    assert d.observe(4.5, ranks(r0=blocked, r1=WAITING)) is Decision.CONTINUE
    assert d.observe(8.9, ranks(r0=blocked, r1=WAITING)) is Decision.CONTINUE   # progress seen at 4.0
    assert d.observe(9.0, ranks(r0=blocked, r1=WAITING)) is Decision.STALL
