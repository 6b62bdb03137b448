"""StallDetector rules on synthetic observations (pure, injected clock)."""

from distcheck.launch.watchdog import Decision, Limits, RankProgress, StallDetector


def ranks(**by_rank: RankProgress) -> dict[int, RankProgress]:
    return {int(k[1:]): v for k, v in by_rank.items()}


RUNNING = RankProgress(records=2, phase="running")
FINISHED = RankProgress(records=2, phase="finished")
WAITING = RankProgress(records=3, open_collectives=1, phase="running", current="barrier #1 [group 0]")


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
    later = RankProgress(records=5, open_collectives=1, phase="running")
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
