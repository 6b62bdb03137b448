"""Node 0's view of the other nodes, over a real c10d store (no processes: the timing is the clock's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from torch.distributed import HashStore, PrefixStore

from distcheck.launch import cluster
from distcheck.launch.cluster import LaunchChannel, NodeLiveness
from distcheck.launch.node_config import node_config
from distcheck.launch.progress import RankProgress
from distcheck.launch.watchdog import Decision, Limits, StallDetector
from distcheck.models import Finding, Phase, RankDetail, RankOutcome, ScenarioResult

REPO = Path(__file__).resolve().parent.parent


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
    store.add("distcheck/job/launch/version/1", 1)   # as a node publishes: its progress, then its version
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


def _node(store: HashStore, node: int, nnodes: int = 2, world_size: int = 4) -> LaunchChannel:
    config = node_config(nnodes, node, "127.0.0.1:29500", "job", "c10d", 300, None, None, None, env={})
    return LaunchChannel(PrefixStore("distcheck/job/launch", store), config, world_size,
                         NodeLiveness(store, nnodes))


def test_a_node_publishes_only_what_changed_and_node_0_reads_only_changed_nodes():
    store = HashStore()
    leader, other = _node(store, 0), _node(store, 1)
    running = {2: RankProgress(phase=Phase.RUNNING, records=4), 3: RankProgress(phase=Phase.RUNNING, records=4)}
    other.publish(running)
    other.publish(running)                       # the same progress again: nothing crosses the store
    assert store.add("distcheck/job/launch/version/1", 0) == 1
    local = {0: RankProgress(phase=Phase.RUNNING), 1: RankProgress(phase=Phase.RUNNING)}
    assert leader.everyone(local)[3].records == 4
    other.publish({**running, 3: RankProgress(phase=Phase.RUNNING, records=6)})
    assert store.add("distcheck/job/launch/version/1", 0) == 2
    assert leader.everyone(local)[3].records == 6


class _Asked:
    """A store that counts the requests made of it (the channel's round trips to node 0's store)."""

    def __init__(self, store):
        self.store, self.asked = store, []

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def asked(*args, **kwargs):
            self.asked.append(name)
            return call(*args, **kwargs)
        return asked


def test_node_0_reads_the_nodes_not_yet_published_in_one_round_trip_a_poll():
    """A node that has not published yet cost node 0 a round trip per poll (2,047 per poll at 2,048 nodes while
    they started); every node's version is read in one now, and a node that publishes later is read."""
    store = HashStore()
    nnodes = 64
    leader = _node(store, 0, nnodes=nnodes, world_size=nnodes)
    late = _node(store, 17, nnodes=nnodes, world_size=nnodes)
    leader.store = _Asked(leader.store)
    local = {0: RankProgress(phase=Phase.RUNNING)}
    leader.everyone(local)                       # the first poll makes every node's version key
    leader.store.asked.clear()
    assert 17 not in leader.everyone(local)
    assert leader.store.asked == ["multi_get"]
    late.publish({17: RankProgress(phase=Phase.RUNNING, records=3)})
    assert leader.everyone(local)[17].records == 3


def test_what_is_only_measured_crosses_at_most_every_refresh_and_what_is_judged_at_once(monkeypatch):
    """A running rank's memory and CPU differ at every poll: sent each time, node 0 would read every node at
    every poll. They wait for REFRESH_S (longer past 64 nodes); a change that can change a verdict goes at once."""
    from distcheck.launch import progress_wire

    store = HashStore()
    leader, other = _node(store, 0), _node(store, 1)
    version = lambda: store.add("distcheck/job/launch/version/1", 0)   # noqa: E731
    busy = lambda **kw: {2: RankProgress(**{"phase": Phase.RUNNING, "records": 4, **kw})}   # noqa: E731
    other.publish(busy(rss_bytes=100, cpu=0.5))
    other.publish(busy(rss_bytes=120, cpu=0.7, evidence=None))
    assert version() == 1                                          # measured only: not yet
    other.publish(busy(rss_bytes=130, evidence="its processes used 0.7 cores", evidence_age=0.1))
    assert version() == 2                                          # it shows progress now: a verdict may change
    other.publish(busy(rss_bytes=140, evidence="its processes used 0.9 cores", evidence_age=0.0))
    assert version() == 2
    # past 64 nodes, less often: node 0 reads about as many refreshes per poll at 512 nodes as at 64
    assert progress_wire.refresh_s(2) == progress_wire.refresh_s(64) == progress_wire.REFRESH_S
    assert progress_wire.refresh_s(512) == 8 * progress_wire.REFRESH_S
    monkeypatch.setattr(progress_wire, "REFRESH_S", 0.0)           # the refresh is due
    other.publish(busy(rss_bytes=150, evidence="its processes used 0.9 cores", evidence_age=0.0))
    assert version() == 3
    assert leader.everyone({})[2].rss_bytes == 150
    other.publish(busy(rss_bytes=150, evidence="its processes used 0.9 cores", evidence_age=0.0, records=6))
    assert version() == 4


def test_only_node_0_reads_every_node_and_the_others_follow_its_release(monkeypatch):
    monkeypatch.setattr(cluster, "say_every_s", lambda nnodes: 0.0)   # every ask reads the store
    store = HashStore()
    leader, other = _node(store, 0), _node(store, 1)
    other.publish({2: RankProgress(phase=Phase.FINISHED), 3: RankProgress(phase=Phase.FINISHED)})
    leader.publish({0: RankProgress(phase=Phase.FINISHED), 1: RankProgress(phase=Phase.FINISHED)})
    assert sorted(other.everyone({2: RankProgress(phase=Phase.FINISHED)})) == [2]   # its own ranks only
    assert other.node0_says() == {}
    leader.post_release()
    assert other.node0_says() == {"released": True}
    leader.post_decision("deadlock", 10.0, 12.0)   # what it said before stays said
    assert other.node0_says() == {"released": True,
                                  "decision": {"decision": "deadlock", "stall_onset": 10.0, "detected_at": 12.0}}


class _CountedStore:
    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        self.requests += 1
        return getattr(self.store, name)


def test_another_node_reads_node_0s_word_once_per_poll_and_less_often_at_scale():
    """A follower's poll asks twice (released? decided?): one read serves both, and past 128 nodes the reads space
    out (2,048 nodes asking twice a poll were 40,000 requests a second to node 0's store)."""
    assert cluster.say_every_s(8) == 0.05 and cluster.say_every_s(512) == 0.2 and cluster.say_every_s(2048) == 0.8
    store = HashStore()
    leader = _node(store, 0)
    leader.post_decision("deadlock", 10.0, 12.0)
    other = _node(store, 1)
    counted = _CountedStore(other.store)
    other.store = counted
    said = [other.node0_says().get("decision"), other.node0_says().get("released")]
    assert said[0]["decision"] == "deadlock" and said[1] is None
    assert counted.requests == 2   # check + get, once for both asks


def test_node_0_reads_every_heartbeat_in_one_multi_get():
    store = HashStore()
    liveness = NodeLiveness(store, 4, silent_after_s=0.0)
    for node in (1, 2):
        store.add(f"heartbeat/{node}", 1)
    assert liveness.silent([1, 2, 3]) == []           # first sight; node 3 never beat: its key now reads 0
    store.add("heartbeat/1", 1)
    assert liveness.silent([1, 2, 3]) == [2, 3]
    assert liveness.arrived(1) and liveness.arrived(2) and not liveness.arrived(3)


def test_a_waiting_ranks_members_cross_the_store_as_runs_and_come_back_whole():
    store = HashStore()
    leader, other = _node(store, 0, world_size=4096), _node(store, 1, world_size=4096)
    members = tuple(r for r in range(4096) if r != 7)
    waiting = RankProgress(phase=Phase.RUNNING, open_collectives=1, waits=(("0", 5001, members, "barrier|x"),),
                           entered={"0": 5001}, settled=True, cpu=0.0, label="end", current="barrier #5001 [group 0]",
                           since=12.5,   # the last 32 calls it left: one step's call, then another group's
                           left=tuple(("0", seq, "all_reduce|y") for seq in range(4969, 5000)) + (("1", 3, "x"),))
    other.publish({4094: waiting, 4095: waiting})
    assert len(store.get("distcheck/job/launch/progress/1")) < 2000   # members and calls left as runs
    merged = leader.everyone({})
    got = merged[4095]
    assert got == waiting   # every field, field by field (dataclasses.asdict deep-copied 4,095 members a rank)
    # every rank in one call shares one tuple of its members on node 0 (4,096 of them: 16 M entries otherwise)
    assert merged[4094].waits[0][2] is got.waits[0][2]


def test_a_value_past_the_stores_message_limit_crosses_in_parts():
    # c10d's TCPStore refuses a message over 8 MiB: a 512-node result (196 MB) reset node 0's connection.
    import datetime

    import pytest
    from torch.distributed import TCPStore

    from distcheck.launch.cluster import _put, _take

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    text = "0123456789abcdef" * (10 * 1024 * 1024 // 16)     # 10 MiB
    with pytest.raises(Exception):
        client.set("plain", text)
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    _put(client, "result", text)
    assert _take(client, "result") == text


def test_past_64_ranks_the_other_nodes_get_the_verdict_without_per_rank_tables():
    # at 4,096 ranks the tables were 4.7 MB of the result, read by each of 511 nodes
    for world, kept in ((4, True), (100, False)):
        store = HashStore()
        leader, other = _node(store, 0, world_size=world), _node(store, 1, world_size=world)
        ranks = tuple(RankOutcome(rank=r, state="finished") for r in range(world))
        finding = Finding(kind="hang", severity="error", summary="Rank 0 is waiting",
                          ranks=(RankDetail(rank=0, role="waiting"),))
        leader.post_result(ScenarioResult(name="job", source="test", expected=("pass",), observed=("hang",), ok=False,
                                          duration_s=1.0, ranks=ranks, findings=(finding,)))
        got = ScenarioResult.from_dict(other.result(timeout_s=5))
        assert got.ok is False and got.findings[0].summary == "Rank 0 is waiting"
        assert (got.ranks == ranks and got.findings[0].ranks == finding.ranks) is kept
        assert kept or (got.ranks == () and got.findings[0].ranks == ())


def test_a_large_jobs_verdict_crosses_to_the_other_nodes_small_its_rank_lists_whole():
    # at 16,384 ranks a long-trace note's table of every group and a hang's 16,383 waiting ranks made the result
    # 689 KB, held by node 0's store for each of 2,047 readers: 1.3 GB of node 0's memory at the end of the run
    world = 16384
    store = HashStore()
    leader, other = _node(store, 0, world_size=world), _node(store, 1, world_size=world)
    waiting = tuple(r for r in range(world) if r != 9001)
    hang = Finding(kind="hang", severity="error", summary="Ranks 0-9000, 9002-16383 are waiting", waiting_ranks=waiting,
                   absent_ranks=(9001,), data={"evidence": "certain: rank 9001 finished"})
    note = Finding(kind="coverage", severity="info", summary="Long traces: …",
                   data={"calls_cut": 8, "first_kept": {f"p2p:{r}>{r + 8}": 104 for r in range(world)}})
    leader.post_result(ScenarioResult(name="job", source="test", expected=("pass",), observed=("hang",), ok=False,
                                      duration_s=1.0, ranks=tuple(RankOutcome(rank=r, state="stuck")
                                                                  for r in range(world)), findings=(hang, note)))
    said = other.result(timeout_s=5)
    assert len(json.dumps(said)) < 5_000
    got = ScenarioResult.from_dict(said)
    assert got.findings[0].waiting_ranks == waiting and got.findings[0].absent_ranks == (9001,)
    assert got.findings[0].data == hang.data and got.findings[1].data == {"calls_cut": 8}   # its table left out
    assert [f.summary for f in got.findings] == [hang.summary, note.summary]


def test_a_pipeline_pairs_send_and_receive_digests_agree_across_the_window(tmp_path):
    """A P2P pair's sender records ``send`` and its receiver ``recv`` at the same numbers: the digests of the calls
    before their windows must agree (they differed in every block, a false mismatch on every pipeline pair of a
    3-D job at scale), and node 0 finds no divergence between them."""
    import torch

    from distcheck.diagnose.windows import find_window_divergence
    from distcheck.files.trace_reader import read_trace_bytes, read_trace_dir
    from distcheck.files.trace_window import window
    from distcheck.rank.tracer import Tracer

    traces = tmp_path / "traces"
    traces.mkdir()
    for rank, peer, fn in ((0, 1, "send"), (1, 0, "recv")):
        world = object()
        path = tmp_path / f"whole{rank}.trace"
        tracer = Tracer(path, rank, group_resolver=lambda pg: ("0", (0, 1)), default_group=lambda: world)
        call = tracer.wrap(fn, (lambda tensor, dst=None, group=None, tag=0, group_dst=None: None) if fn == "send"
                           else (lambda tensor, src=None, group=None, tag=0, group_src=None: None))
        for _ in range(3000):
            call(torch.ones(4), peer)
        tracer.close()
        (traces / f"rank{rank}.trace").write_bytes(window(read_trace_bytes(path), node=1, held_at=str(path)))
    read = read_trace_dir(traces)
    assert read[0].elided["p2p:0>1"].digests == read[1].elided["p2p:0>1"].digests != {}
    assert find_window_divergence({r: t.elided for r, t in read.items()}) == []


def test_node_0_takes_every_nodes_bundle_in_a_few_round_trips_whole_and_in_order(tmp_path, monkeypatch):
    """Bundles of several parts, their parts read several nodes at a time (a batch ends inside a node's parts):
    every file arrives whole, one already at node 0 is kept, and node 0 makes no read per node (two per node, each
    behind every other node's requests at its store, took 15 minutes at 2,048 nodes)."""
    from distcheck.files.launch_dir import LaunchFiles

    monkeypatch.setattr(cluster, "PART_BYTES", 700)
    monkeypatch.setattr(cluster, "PARTS_PER_READ", 3)
    store = HashStore()
    nnodes = 5
    leader = _node(store, 0, nnodes=nnodes, world_size=nnodes)
    sent = {}
    for node in range(1, nnodes):
        files = LaunchFiles(tmp_path / f"node{node}")
        (files.root / "status").mkdir(parents=True)
        sent[node] = bytes(range(256)) * (3 + node)   # 1-3 KB: two to five parts each
        (files.root / "status" / f"rank{node}.json").write_bytes(sent[node])
        _node(store, node, nnodes=nnodes, world_size=nnodes).upload(files, {"node": node})
    mine = LaunchFiles(tmp_path / "node0")
    (mine.root / "status").mkdir(parents=True)
    (mine.root / "status" / "rank3.json").write_bytes(b"node 0's own")
    leader.store = _Asked(leader.store)
    summaries = leader.gather(mine, timeout_s=10)
    assert [s["node"] for s in summaries] == [1, 2, 3, 4]
    for node in (1, 2, 4):
        assert (mine.root / "status" / f"rank{node}.json").read_bytes() == sent[node]
    assert (mine.root / "status" / "rank3.json").read_bytes() == b"node 0's own"
    # one read of who uploaded, then the heads at once and the parts three at a time: no read per node
    assert leader.store.asked.count("get") == 1


def test_node_0s_watchdog_failing_ends_the_other_nodes_too(tmp_path):
    """A watchdog that fails ends its own ranks; node 0's must say so to the other nodes, or their ranks run on
    until node 0's gather gives up on them. Node 1 here publishes progress node 0 cannot read (a field of a
    distcheck that is not node 0's). The watchdogs tear down, so they run in a process of their own."""
    script = f"""
import json
from pathlib import Path
from torch.distributed import HashStore
from distcheck.files.launch_dir import LaunchFiles
from distcheck.launch import cluster
from distcheck.launch.watchdog import Decision, Limits, Watchdog
import tests.test_cluster as t

cluster.say_every_s = lambda nnodes: 0.0
store = HashStore()
leader, other = t._node(store, 0), t._node(store, 1)
dogs = []
for node, channel in ((0, leader), (1, other)):
    files = LaunchFiles(Path({str(tmp_path)!r}) / f"node{{node}}")
    files.make()
    dogs.append(Watchdog(files, 4, Limits(stall_timeout=5.0), channel=channel))
assert dogs[1].poll_once() is False and dogs[0].poll_once() is False     # both healthy
other.store.set("progress/1", json.dumps({{"2": {{"field_of_another_version": 1}}}}))
other.store.add("version/1", 1)
assert dogs[0].poll_once() is True and dogs[0].result.decision is Decision.FAILED, dogs[0].result
assert "field_of_another_version" in dogs[0].result.error
assert dogs[1].poll_once() is True and dogs[1].result.decision is Decision.FAILED, dogs[1].result
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
