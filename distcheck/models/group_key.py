"""The group a call was made on, as the records name it (``Event.group``, ``Finding.group``): a process
group's name (``"0"``, a mesh dimension's), or a point-to-point pair's. The P2P form is built and parsed
here only; everywhere else asks a ``GroupKey`` (``is_p2p``, ``src``, ``dst``)."""

from __future__ import annotations

_P2P = "p2p:"       # p2p:SRC>DST, the pair a send or receive was numbered on (SRC "any": a receive from any source)
_ANY = "any"


class GroupKey(str):
    """A group's key: a ``str`` (it hashes, compares, prints and goes to JSON as the name it always was),
    read once where records are read, so nothing else parses it."""

    __slots__ = ()

    @classmethod
    def of(cls, value: str) -> GroupKey:
        """``value`` as a GroupKey (itself when it is one already)."""
        return value if type(value) is cls else cls(value)

    @classmethod
    def p2p(cls, src: int | None, dst: int | None) -> GroupKey:
        """The key of the P2P pair from ``src`` (None: a receive from any source) to ``dst``."""
        return cls(f"{_P2P}{_ANY if src is None else src}>{dst}")

    @property
    def is_p2p(self) -> bool:
        return is_p2p(self)

    @property
    def any_source(self) -> bool:
        """A receive from any source (its sender was not known when it was posted)."""
        return self.is_p2p and self._pair()[0] == _ANY

    @property
    def src(self) -> int | None:
        """The sending rank of a P2P pair; None for a process group or a receive from any source."""
        side = self._pair()[0] if self.is_p2p else ""
        return int(side) if side.lstrip("-").isdigit() else None

    @property
    def dst(self) -> int | None:
        """The receiving rank of a P2P pair; None for a process group."""
        side = self._pair()[1] if self.is_p2p else ""
        return int(side) if side.lstrip("-").isdigit() else None

    @property
    def src_text(self) -> str:
        """The sending side as the key says it: a rank, or ``any``."""
        return self._pair()[0]

    def _pair(self) -> tuple[str, str]:
        src, _, dst = self[len(_P2P):].partition(">")
        return src, dst


def is_p2p(group: str) -> bool:
    """Whether a group key (a GroupKey or its plain string, as a hand-built record has it) names a P2P pair."""
    return group.startswith(_P2P)
