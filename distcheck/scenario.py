"""Writing scenarios: the ``@scenario`` decorator and the context a scenario gets.

A scenario is a function taking a :class:`ScenarioContext`, decorated with what
it is expected to show::

    @scenario(expect="hang", requires=("torchmetrics",))
    def auroc_rank0_only_compute(ctx):
        '''Only rank 0 calls BinaryAUROC.compute().'''

The decorator arguments must be literals: distcheck reads them without
importing the file (see ``discovery``), so listing scenarios never needs the
scenario's optional dependencies.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distcheck.models import FINDING_KINDS, PASS

EXPECTATIONS = (PASS, *(k.value for k in FINDING_KINDS))   # the user writes them as strings
BACKENDS = ("gloo", "nccl")
OPTIONAL_LIBRARIES = ("torchmetrics", "lightning")   # the 'distcheck[metrics]' and '[lightning]' extras
TORCH_FEATURE = "torch:"   # requires=("torch:fully_shard",): a feature of torch (distcheck.torch_features)


@dataclass(frozen=True)
class ScenarioSpec:
    """What the decorator declares, as read from the source."""

    name: str
    file: str
    expect: tuple[str, ...] = ("pass",)
    requires: tuple[str, ...] = ()
    backends: tuple[str, ...] = BACKENDS
    min_world_size: int = 2
    description: str = ""
    builtin: bool = False
    # (world size, expectation) where it differs from ``expect``: at 2 ranks an extra call against the
    # others' barrier has no odd one out (each side waits in its own call: a certain hang, no mismatch)
    expect_by_world_size: tuple[tuple[int, tuple[str, ...]], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "file": self.file, "expect": list(self.expect),
            "requires": list(self.requires), "backends": list(self.backends),
            "min_world_size": self.min_world_size, "description": self.description,
            "builtin": self.builtin,
            "expect_by_world_size": {str(n): list(e) for n, e in self.expect_by_world_size},
        }

    def at_world_size(self, world_size: int) -> ScenarioSpec:
        """This scenario as it runs on ``world_size`` ranks: ``expect`` is what it expects there."""
        expect = dict(self.expect_by_world_size).get(world_size, self.expect)
        return dataclasses.replace(self, expect=expect)


def expectations_by_world_size(value: Mapping[int, str | tuple[str, ...]], where: str) -> tuple[
        tuple[int, tuple[str, ...]], ...]:
    """``expect_by_world_size={2: "hang"}`` checked, as the spec keeps it."""
    out = []
    for n, expect in sorted(value.items()):
        expected = (expect,) if isinstance(expect, str) else tuple(expect)
        unknown = [e for e in expected if e not in EXPECTATIONS]
        if not isinstance(n, int) or n < 1 or unknown:
            raise ValueError(f"{where}: expect_by_world_size wants {{ranks: expectation}} with ranks ≥ 1 and "
                             f"expectations among {', '.join(EXPECTATIONS)} (got {n!r}: {expect!r})")
        out.append((n, expected))
    return tuple(out)


def missing_requirements(spec: ScenarioSpec, cpu_tensors: bool = True, backend: str = "gloo") -> list[str]:
    """The libraries ``spec`` requires that are not installed (found without importing them), and the
    torch features (``torch:NAME``) the installed torch lacks for this backend and device."""
    return [name for name in spec.requires if _feature_problem(name, cpu_tensors, backend) or (
        not name.startswith(TORCH_FEATURE) and importlib.util.find_spec(name) is None)]


def _feature_problem(requirement: str, cpu_tensors: bool, backend: str) -> str | None:
    if not requirement.startswith(TORCH_FEATURE):
        return None
    from distcheck import torch_features

    return torch_features.feature_problem(requirement.removeprefix(TORCH_FEATURE), cpu_tensors, backend)


def skip_reason(spec: ScenarioSpec, backend: str, nproc_per_node: int, device: str = "auto") -> str | None:
    """Why ``spec`` cannot run on this backend, device and rank count (None: it can)."""
    cpu_tensors = device == "cpu" or (device == "auto" and backend != "nccl")   # the worker's pick_device
    features = [p for name in spec.requires if (p := _feature_problem(name, cpu_tensors, backend))]
    if features:
        return f"needs what this torch lacks: {'; '.join(features)}"
    missing = missing_requirements(spec, cpu_tensors, backend)
    if missing:
        # [metrics] brings torchmetrics; [lightning] brings Lightning and torchmetrics (pyproject.toml)
        extra = (("'distcheck[lightning]'" if "lightning" in missing else "'distcheck[metrics]'")
                 if set(missing) <= set(OPTIONAL_LIBRARIES) else " ".join(missing))
        return f"needs {', '.join(missing)}, which is not installed (pip install {extra})"
    # emulated_nccl runs on CPU tensors: what runs on gloo runs there, with NCCL's host view
    if (backend if backend != "emulated_nccl" else "gloo") not in spec.backends:
        return f"only meaningful on {'/'.join(spec.backends)}; this run uses {backend}"
    if nproc_per_node < spec.min_world_size:
        return f"needs at least {spec.min_world_size} ranks; this run has {nproc_per_node}"
    return None


def scenario(
    expect: str | tuple[str, ...] = "pass",
    requires: tuple[str, ...] = (),
    backends: tuple[str, ...] = BACKENDS,
    min_world_size: int = 2,
    expect_by_world_size: Mapping[int, str | tuple[str, ...]] | None = None,
) -> Callable[[Callable], Callable]:
    """Mark a function as a distcheck scenario (runtime side of the declaration). ``expect_by_world_size``
    ({2: "hang"}): what it expects instead at those rank counts."""
    expected = (expect,) if isinstance(expect, str) else tuple(expect)
    unknown = [e for e in expected if e not in EXPECTATIONS]
    if unknown:
        raise ValueError(f"unknown expectation {unknown[0]!r}; use one of {', '.join(EXPECTATIONS)}")
    by_size = expectations_by_world_size(expect_by_world_size or {}, "@scenario")

    def mark(fn: Callable) -> Callable:
        fn.__distcheck_scenario__ = {  # type: ignore[attr-defined]
            "expect": expected, "requires": tuple(requires),
            "backends": tuple(backends), "min_world_size": min_world_size, "expect_by_world_size": by_size,
        }
        return fn

    return mark


@dataclass
class NumericCheck:
    name: str
    ok: bool
    max_abs_diff: float
    shape: list[int]
    differing: list[dict[str, Any]]
    actual: Any = None
    reference: Any = None
    note: str = ""
    n_differing: int = 0            # all differing entries; ``differing`` keeps the first 50

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SampleRecord:
    dataset: str
    dataset_size: int
    ids: list[int]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ScenarioContext:
    """What a scenario function receives on every rank."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any                     # torch.device
    seed: int
    generator: Any = None           # torch.Generator seeded per rank
    numeric_checks: list[NumericCheck] = field(default_factory=list)
    samples: list[SampleRecord] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)     # distcheck run --option / --min-busbw
    tables: list[dict[str, Any]] = field(default_factory=list)
    requirements: list[dict[str, Any]] = field(default_factory=list)

    def generator_for(self, rank: int) -> Any:
        """A generator with the same seed rank ``rank`` uses: lets any rank rebuild
        another rank's data for a single-process reference."""
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed * 100_003 + rank)
        return g

    def check_close(
        self, name: str, actual: Any, reference: Any, rtol: float = 1e-5, atol: float = 1e-6, note: str = "",
    ) -> bool:
        """Declare that a distributed result must equal its single-process reference."""
        import torch

        a = torch.as_tensor(actual).detach().double().cpu()
        r = torch.as_tensor(reference).detach().double().cpu()
        if a.shape != r.shape:
            check = NumericCheck(name, False, math.inf, list(r.shape),
                                 [{"index": None, "actual": list(a.shape), "reference": list(r.shape)}],
                                 note=note or "shape differs from the reference")
            self.numeric_checks.append(check)
            return False
        diff = (a - r).abs()
        bad = ~torch.isclose(a, r, rtol=rtol, atol=atol)
        differing = []
        for idx in bad.nonzero().tolist()[:50]:
            differing.append({"index": idx, "actual": a[tuple(idx)].item(), "reference": r[tuple(idx)].item()})
        if a.dim() == 0 and bool(bad):
            differing = [{"index": [], "actual": a.item(), "reference": r.item()}]
        small = a.numel() <= 256
        check = NumericCheck(
            name, not bool(bad.any()), float(diff.max()) if diff.numel() else 0.0, list(a.shape), differing,
            actual=a.tolist() if small else None, reference=r.tolist() if small else None, note=note,
            n_differing=int(bad.sum()),
        )
        self.numeric_checks.append(check)
        return check.ok

    def record_samples(self, ids: Iterable[int], dataset_size: int, dataset: str = "dataset", note: str = "") -> None:
        """Record which sample ids this rank evaluated (duplicates/missing analysis)."""
        self.samples.append(SampleRecord(dataset, int(dataset_size), [int(i) for i in ids], note))

    def report_table(self, title: str, columns: list[str], rows: list[list[Any]],
                     records: list[dict[str, Any]] | None = None) -> None:
        """A table for the report (e.g. bandwidth per message size); rank 0's is shown. ``records``: the
        same results with named fields and full precision, for the JSON report."""
        table = {"title": title, "columns": list(columns), "rows": [list(r) for r in rows]}
        self.tables.append({**table, "records": list(records)} if records is not None else table)

    def require(self, name: str, ok: bool, summary: str, severity: str = "error", **data: Any) -> bool:
        """A health requirement of this node (e.g. a bandwidth floor); a failed one is a `health` finding
        of ``severity`` (an "info" one is shown, but does not fail the scenario)."""
        self.requirements.append({"name": name, "ok": bool(ok), "summary": summary, "severity": severity,
                                  "data": data})
        return bool(ok)

    def results(self) -> dict[str, Any]:
        out = {
            "numeric_checks": [c.to_dict() for c in self.numeric_checks],
            "samples": [s.to_dict() for s in self.samples],
            "tables": self.tables,
            "requirements": self.requirements,
        }
        return out
