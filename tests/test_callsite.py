"""Call-site resolution (``CallsiteResolver``) on real stacks, in-process.

``collective()`` stands in for a traced collective: like the tracer's wrapper,
it resolves the stack of its caller (``sys._getframe(1)``). The walk must stop
at the first user frame, except to follow the module that issued the call
(see the docstring of ``distcheck.rank.callsite``): frames outside it are never
looked at, so the cost does not grow with the stack's depth.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distcheck.models import JOIN_LABEL
from distcheck.rank import integrations
from distcheck.rank.callsite import CallsiteResolver

THIS = os.path.abspath(__file__)

RESOLVER = CallsiteResolver()


def collective() -> tuple:
    """(callsite, library callsite, label) as the tracer records them for a collective called here."""
    return RESOLVER.resolve(sys._getframe(1))


def line_of(marker: str) -> int:
    for i, text in enumerate(Path(THIS).read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# <{marker}>"):
            return i
    raise LookupError(marker)


def site(function: str, marker: str) -> str:
    return f"{THIS}:{line_of(marker)}:{function}"


def _deep(depth: int, fn, *args):
    if depth == 0:
        return fn(*args)
    return _deep(depth - 1, fn, *args)


class Model(torch.nn.Module):
    def forward(self):
        return self.helper()

    def helper(self):
        return collective()  # <helper>

    def forward_through_plain_function(self):
        return run_step(self)

    def step(self):
        return collective()  # <step>

    def validate(self):
        return evaluate()

    def deep_step(self, depth: int):
        return _deep(depth, self.step)


def run_step(model: Model):
    return model.step()


def evaluate():
    return collective()  # <evaluate>


# -- the labels ---------------------------------------------------------------------------


def test_module_call_through_a_helper_method_is_labelled_forward():
    # helper is the first user frame; forward is on the same module, through nn.Module's _call_impl
    callsite, library, label = Model()()
    assert label == "Model.forward"
    assert callsite == site("helper", "helper") and library is None


def test_label_is_the_outermost_frame_of_the_innermost_module():
    class Inner(torch.nn.Module):
        def sync(self):
            return self._reduce()

        def _reduce(self):
            return collective()

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self):
            return self.inner.sync()

    assert Outer()()[2] == "Inner.sync"


def test_plain_user_code_has_no_label():
    callsite, library, label = collective()  # <plain>
    assert label is None and library is None
    assert callsite == site("test_plain_user_code_has_no_label", "plain")


def test_a_closure_around_a_bound_method_is_labelled_by_the_method_it_wraps_each_time():
    class Wrapping(torch.nn.Module):   # torchmetrics wraps compute and update this way
        def __init__(self):
            super().__init__()
            self.compute = self._wrap(self.compute)
            self.update = self._wrap(self.update)

        def _wrap(self, method):
            def wrapped(*args):
                assert self is not None   # a closure over self, as torchmetrics' wrapped_func
                return method(*args)
            return wrapped

        def compute(self):
            return self._sync()

        def update(self):
            return self._sync()

        def _sync(self):
            return collective()

    metric = Wrapping()
    # the same closure code wraps both: the second and later calls take the cached local's value
    assert [metric.compute()[2], metric.update()[2], metric.compute()[2], metric.update()[2]] == \
        ["Wrapping.compute", "Wrapping.update", "Wrapping.compute", "Wrapping.update"]


def test_lightning_deferred_self_log_names_the_logged_value_and_its_line(monkeypatch):
    class ResultMetric(torch.nn.Module):   # stands in for Lightning's _ResultMetric (duck-typed: meta.name)
        class meta:
            name = "val_loss"

        def compute(self):
            return self._sync()

        def _sync(self):
            return collective()

    monkeypatch.setitem(integrations.LOG_SITES, "val_loss", "/x/model.py:12:validation_step")
    callsite, _, label = ResultMetric().compute()
    assert label == "ResultMetric.compute (self.log 'val_loss')"
    assert callsite == "/x/model.py:12:validation_step"


# -- with torch.distributed (a one-rank gloo group) ------------------------------------------


@pytest.fixture
def resolved(monkeypatch):
    """Make dist.<op> for the named ops record what the resolver says of their caller."""
    seen: list[tuple[str, tuple]] = []

    def patch(*names: str) -> list[tuple[str, tuple]]:
        for name in names:
            original = getattr(dist, name)

            def recorded(*args, __name=name, __original=original, **kwargs):
                seen.append((__name, RESOLVER.resolve(sys._getframe(1))))
                return __original(*args, **kwargs)

            monkeypatch.setattr(dist, name, recorded)
        return seen

    return patch


def test_torchmetrics_compute_is_labelled_compute(process_group, resolved):
    from torchmetrics.classification import BinaryAUROC

    seen = resolved("barrier", "all_gather")
    metric = BinaryAUROC(thresholds=20)
    metric.update(torch.rand(16), torch.randint(0, 2, (16,)))
    metric.compute()  # <compute>
    assert [op for op, _ in seen][:3] == ["barrier", "all_gather", "all_gather"]
    for _, (callsite, library, label) in seen:
        assert label == "BinaryAUROC.compute"
        assert callsite == site("test_torchmetrics_compute_is_labelled_compute", "compute")
        assert "torchmetrics" in library


def test_torchmetrics_compute_from_a_deep_stack_is_resolved_the_same(process_group, resolved):
    from torchmetrics.classification import BinaryAUROC

    def compute(metric):
        return metric.compute()  # <deep-compute>

    seen = resolved("all_gather")
    for depth in (0, 150):
        metric = BinaryAUROC(thresholds=20)
        metric.update(torch.rand(16), torch.randint(0, 2, (16,)))
        _deep(depth, compute, metric)
    shallow = [r for _, r in seen[:len(seen) // 2]]
    deep = [r for _, r in seen[len(seen) // 2:]]
    assert shallow == deep and shallow
    assert {r[2] for r in shallow} == {"BinaryAUROC.compute"}
    assert {r[0] for r in shallow} == {site("compute", "deep-compute")}


def test_torchmetrics_forward_is_labelled_forward(process_group, resolved):
    from torchmetrics.classification import BinaryAccuracy

    seen = resolved("barrier", "all_gather")
    metric = BinaryAccuracy(dist_sync_on_step=True)
    metric(torch.rand(8), torch.randint(0, 2, (8,)))  # <forward>
    assert seen and {label for _, (_, _, label) in seen} == {"BinaryAccuracy.forward"}
    assert {c for _, (c, _, _) in seen} == {site("test_torchmetrics_forward_is_labelled_forward", "forward")}


def test_join_shadow_calls_get_the_join_label(process_group, resolved):
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
    seen = resolved("all_reduce")
    with Join([ddp]):
        pass   # this rank is out of data at once: Join's exit runs the shadow calls and DDP's post-hook
    labels = [label for _, (_, _, label) in seen]
    assert labels[0] == JOIN_LABEL   # Join's own all_reduce counting the ranks still working
    assert f"{JOIN_LABEL} (DistributedDataParallel._sync_final_model)" in labels
    assert {c.rsplit(":", 1)[1] for _, (c, _, _) in seen} == {"test_join_shadow_calls_get_the_join_label"}


# -- the walk stops -----------------------------------------------------------------------


def test_a_module_method_behind_a_plain_user_frame_is_not_the_label():
    # Model.forward -> run_step(self) -> self.step(): the walk stops at run_step, a user frame not on
    # the module; forward, further out and on the same module, is never seen.
    callsite, _, label = Model().forward_through_plain_function()
    assert label == "Model.step"
    assert callsite == site("step", "step")


def test_a_plain_function_called_from_a_module_method_has_no_label():
    # Model.validate -> evaluate() -> collective: accepted, documented in distcheck.rank.callsite
    callsite, _, label = Model().validate()
    assert label is None
    assert callsite == site("evaluate", "evaluate")


def test_the_label_does_not_depend_on_frames_beyond_a_deep_run_of_user_frames():
    model = Model()
    assert model.deep_step(0)[2] == model.deep_step(60)[2] == "Model.step"


class _Frame:
    """A frame as the resolver reads one; ``f_back`` defaults to a frame that fails when touched."""

    def __init__(self, fn, self_=None, back=None):
        self.f_code = fn.__code__
        self.f_locals = {} if self_ is None else {"self": self_}
        self.f_lasti = 0
        self.f_lineno = fn.__code__.co_firstlineno
        self.f_back = back if back is not None else _Tripwire()


class _Tripwire:
    def __getattr__(self, name):
        raise AssertionError(f"the walk went past where it must stop (read {name})")


def test_the_walk_never_reads_a_frame_past_a_plain_user_frame():
    # Fake frames: the one after the first user frame raises if the walk touches it.
    stack = _Frame(evaluate)
    assert RESOLVER.key(stack)[4] is None
    assert RESOLVER.key(_Frame(_deep, back=stack))[4] is None


def test_the_walk_follows_the_module_through_torch_frames_and_stops_after_it():
    model = Model()
    caller = _Frame(run_step)   # a user frame not on the module; beyond it, a tripwire
    call_impl = _Frame(torch.nn.Module._call_impl, model, back=caller)
    forward = _Frame(Model.forward, model, back=call_impl)
    helper = _Frame(Model.helper, model, back=forward)
    assert RESOLVER.describe(RESOLVER.key(helper))[2] == "Model.forward"

    other = Model()
    elsewhere = _Frame(Model.validate, other)   # a user frame on another module: the walk stops there
    step = _Frame(Model.step, model, back=_Frame(Model.forward, model, back=elsewhere))
    assert RESOLVER.describe(RESOLVER.key(step))[2] == "Model.forward"
