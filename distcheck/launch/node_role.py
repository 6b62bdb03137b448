"""Which part this node's watchdog plays in the job: alone (one node), node 0 of several (it decides for all), or
another node (it follows node 0's decision). One object the watchdog is given (``node_role``), so its poll reads
as the decision it makes, whatever the node's part; the multi-node channel is ``cluster.LaunchChannel``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from distcheck.launch.progress import RankProgress


@dataclass(frozen=True)
class Posted:
    """A decision node 0 posted for the whole job."""

    decision: str
    stall_onset: float | None
    detected_at: float | None


class NodeChannel(Protocol):
    """Multi-node: how one node's watchdog shares progress and node 0's decision (``cluster.LaunchChannel``)."""

    @property
    def is_leader(self) -> bool: ...
    def publish(self, progress: Mapping[int, RankProgress]) -> None: ...
    def everyone(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]: ...
    def post_decision(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None: ...
    def post_release(self) -> None: ...
    def node0_says(self) -> dict[str, Any]: ...   # another node: {"released": True, "decision": {...}} so far
    @property
    def lost_nodes(self) -> list[int]: ...


class NodeRole(Protocol):
    """What the watchdog asks of its node's part in the job."""

    decides: bool   # this node judges the job (alone, or node 0); another node follows node 0

    def share(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]: ...
    def released(self) -> bool: ...
    def posted(self) -> Posted | None: ...
    def tell(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None: ...
    def tell_released(self) -> None: ...
    def lost_node_0(self, exc: BaseException) -> bool: ...


class Alone:
    """One node: its ranks are the job."""

    decides = True

    def share(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]:
        return dict(local)

    def released(self) -> bool:
        return False

    def posted(self) -> Posted | None:
        return None

    def tell(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None:
        return None

    def tell_released(self) -> None:
        return None

    def lost_node_0(self, exc: BaseException) -> bool:
        return False


class Leader:
    """Node 0 of several: it reads every node's ranks and decides for the job."""

    decides = True

    def __init__(self, channel: NodeChannel) -> None:
        self.channel = channel

    def share(self, local: Mapping[int, RankProgress]) -> dict[int, RankProgress]:
        self.channel.publish(local)
        return self.channel.everyone(local)

    def released(self) -> bool:
        return False

    def posted(self) -> Posted | None:
        return None

    def tell(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None:
        self.channel.post_decision(decision, stall_onset, detected_at)

    def tell_released(self) -> None:
        self.channel.post_release()

    def lost_node_0(self, exc: BaseException) -> bool:
        return False


class Follower(Leader):
    """Another node: it publishes its ranks and tears down for node 0's reason, when node 0 says."""

    decides = False

    def released(self) -> bool:
        return bool(self.channel.node0_says().get("released"))

    def posted(self) -> Posted | None:
        said = self.channel.node0_says().get("decision")
        return None if said is None else Posted(said["decision"], said["stall_onset"], said["detected_at"])

    def tell(self, decision: str, stall_onset: float | None, detected_at: float | None) -> None:
        return None   # only node 0 speaks for the job

    def tell_released(self) -> None:
        return None

    def lost_node_0(self, exc: BaseException) -> bool:
        """Its store connection dropped: node 0's distcheck ended (not a bug of ours)."""
        try:
            from torch.distributed import DistNetworkError
        except ImportError:   # a torch without it: nothing to tell it from
            return False
        return isinstance(exc, DistNetworkError)


def node_role(channel: NodeChannel | None) -> NodeRole:
    """The part a node with ``channel`` plays (None: one node)."""
    if channel is None:
        return Alone()
    return Leader(channel) if channel.is_leader else Follower(channel)
