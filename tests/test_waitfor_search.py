"""The wait-for graph's one search over every rank (``waitfor._Graph.may_move``) gives the verdict the plain
definition gives: the first waiting rank, in rank order, whose own search from scratch reaches no rank that may
move. Random jobs of 2-9 ranks: collectives on a few groups, P2P pairs (a receive from any source among them),
clashing fingerprints, ranks finished, dead, unsettled or using the CPU."""

from __future__ import annotations

import random

from distcheck.diagnose import waitfor
from distcheck.launch.progress import RankProgress
from distcheck.models import Phase
from distcheck.models.group_key import GroupKey

SIGNATURES = ("all_reduce|f32", "all_reduce|f64", "barrier", "new_group|1,2", "new_group|1,3")


def _each_on_its_own(ranks):
    """The definition: each waiting rank's own search, from scratch, in rank order."""
    for rank in sorted(ranks):
        p = ranks[rank]
        if p.waits and not p.dead:
            found = waitfor._Graph(ranks).closure(rank)
            if found is not None:
                return found
    return None


def _job(rng: random.Random) -> dict[int, RankProgress]:
    n = rng.randint(2, 9)
    groups = {"0": tuple(range(n))}
    for g in range(rng.randint(0, 3)):
        groups[str(g + 1)] = tuple(sorted(rng.sample(range(n), rng.randint(1, n))))
    ranks = {}
    for r in range(n):
        entered = {g: rng.randint(0, 4) for g in groups if r in groups[g]}
        waits: tuple = ()
        if rng.random() < 0.65 and rng.random() < 0.7:
            g = rng.choice([g for g in groups if r in groups[g]])
            seq = rng.randint(1, 5)
            entered[g] = max(entered[g], seq)
            waits = ((GroupKey(g), seq, groups[g], rng.choice(SIGNATURES[:4])),)
        elif rng.random() < 0.5:
            peer = (r + rng.randint(1, n - 1)) % n
            src, dst = (r, peer) if rng.random() < 0.5 else (peer, r)
            key = GroupKey.p2p(None if rng.random() < 0.1 else src, dst)
            seq = rng.randint(1, 3)
            entered[key] = seq
            waits = ((key, seq, (src, dst), "send" if src == r else "recv"),)
        left = tuple((g, rng.randint(1, 5), rng.choice(SIGNATURES))
                     for g in rng.sample(list(groups), rng.randint(0, len(groups))))
        ranks[r] = RankProgress(records=10, open_collectives=len(waits), waits=waits, entered=entered, left=left,
                                phase=rng.choice([Phase.RUNNING] * 6 + [Phase.FINISHED, Phase.ERROR]),
                                alive=rng.random() < 0.9, settled=rng.random() < 0.85,
                                cpu=rng.choice([None, 0.0, 0.9]))
    return ranks


def test_one_search_over_every_rank_gives_each_ranks_own_verdict():
    rng = random.Random(20261208)
    hangs = 0
    for _ in range(4000):
        ranks = _job(rng)
        expected = _each_on_its_own(ranks)
        assert waitfor.certain_hang(ranks) == expected, ranks
        hangs += expected is not None
    assert 500 < hangs < 3500   # both answers were asked for, many times
