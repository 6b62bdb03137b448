"""The causal link between two findings (``Finding.caused_by``), as the linking pass (``diagnose.causes``)
sets it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distcheck.models.enums import Kind
from distcheck.models.group_key import GroupKey

if TYPE_CHECKING:
    from distcheck.models.results import Finding


@dataclass(frozen=True)
class Cause:
    """The finding another one follows from (``Finding.caused_by``): its kind and call; a crash names the
    fields that differed there, a cycle of waits the ranks out of step. report.json keeps it where it always
    was, as the finding's ``data["caused_by"]``, with only the keys it has."""

    kind: Kind
    group: GroupKey | None = None
    seq: int | None = None
    fields: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None

    @classmethod
    def of(cls, finding: Finding, *, fields: bool = False, ranks: bool = False) -> Cause:
        """The cause that ``finding`` is, with its differing fields or its odd ranks where asked."""
        return cls(kind=finding.kind, group=finding.group, seq=finding.seq,
                   fields=tuple(finding.fields) if fields else None, ranks=tuple(finding.odd_ranks) if ranks else None)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": str(self.kind), "group": self.group, "seq": self.seq}
        if self.fields is not None:
            d["fields"] = list(self.fields)
        if self.ranks is not None:
            d["ranks"] = list(self.ranks)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cause:
        return cls(kind=Kind(d["kind"]), group=d.get("group"), seq=d.get("seq"),
                   fields=tuple(d["fields"]) if d.get("fields") is not None else None,
                   ranks=tuple(d["ranks"]) if d.get("ranks") is not None else None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.group is not None:
            object.__setattr__(self, "group", GroupKey.of(self.group))
