"""Node 0's view of the other nodes, over a real c10d store (no processes: the timing is the clock's)."""

from __future__ import annotations

from torch.distributed import HashStore, PrefixStore

from distcheck.launch.cluster import LaunchChannel, NodeLiveness, node_config
from distcheck.launch.watchdog import Decision, Limits, RankProgress, StallDetector
from distcheck.models import Phase


def _channel(store: HashStore, world_size: int = 4) -> LaunchChannel:
    config = node_config(2, 0, "127.0.0.1:29500", "job", "c10d", 300, None, None, None, env={})
    return LaunchChannel(PrefixStore("distcheck/job/launch", store), config, world_size,
                         NodeLiveness(store, 2, silent_after_s=0.0))


def test_a_node_silent_before_it_published_its_ranks_leaves_them_dead_not_awaited():
    # Node 1's distcheck beat once and was killed before its watchdog published ranks 2 and 3.
    store = HashStore()
    channel = _channel(store)
    store.add("heartbeat/1", 1)
    local = {0: RankProgress(phase=Phase.FINISHED, settled=True), 1: RankProgress(phase=Phase.FINISHED, settled=True)}
    assert sorted(channel.everyone(local)) == [0, 1]        # first sight of its heartbeat: alive, ranks unknown yet
    merged = channel.everyone(local)                        # the heartbeat has not moved since
    assert sorted(merged) == [0, 1, 2, 3]
    assert [r for r, p in merged.items() if p.dead] == [2, 3]
    # ... so the run ends as a stall after the short grace for the dead, not after the start timeout
    detector = StallDetector(4, Limits(stall_timeout=5.0, startup_timeout=120.0), start=0.0)
    assert detector.observe(0.0, merged) is Decision.CONTINUE
    assert detector.observe(5.0, merged) is Decision.STALL


def test_a_beating_node_whose_ranks_are_not_published_yet_is_waited_for():
    store = HashStore()
    channel = _channel(store)
    local = {0: RankProgress(phase=Phase.RUNNING), 1: RankProgress(phase=Phase.RUNNING)}
    for beat in range(1, 4):
        store.add("heartbeat/1", 1)
        merged = channel.everyone(local)
        assert sorted(merged) == [0, 1], beat
    store.set("distcheck/job/launch/progress/1", '{"2": {"phase": "running"}, "3": {"phase": "running"}}')
    store.add("heartbeat/1", 1)
    merged = channel.everyone(local)
    assert sorted(merged) == [0, 1, 2, 3] and not any(p.dead for p in merged.values())


def test_a_node_that_has_not_arrived_yet_is_not_taken_for_a_lost_one():
    # Node 1 starts late (a SLURM step starting later): no heartbeat yet, however long node 0 waits.
    # Its ranks are not dead: torch's rendezvous timeout says whether it ever comes.
    store = HashStore()
    channel = _channel(store)
    local = {0: RankProgress(phase=Phase.STARTING), 1: RankProgress(phase=Phase.STARTING)}
    for _ in range(3):
        assert sorted(channel.everyone(local)) == [0, 1]
    store.add("heartbeat/1", 1)                   # it arrives, then beats no more: now it is lost
    channel.everyone(local)
    assert [r for r, p in channel.everyone(local).items() if p.dead] == [2, 3]
