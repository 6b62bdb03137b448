"""The NCCL-semantics lane's start-up module (first on PYTHONPATH for the lane's jobs): a job that asks for gloo runs
on ``distcheck.testing.emulated_nccl`` instead, the backend the host sees as NCCL's. Only the backend is swapped:
the job's code, and distcheck's tracer, sidecar, watchdog, rules and reports, are what NCCL runs.

Only where ``DISTCHECK_LANE_BACKEND=emulated_nccl``; every Python process of the job loads torch.distributed here
(the lane's cost, not a product's)."""

import os

if os.environ.get("DISTCHECK_LANE_BACKEND") == "emulated_nccl":
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from distcheck.testing import emulated_nccl

    emulated_nccl.register()

    def _swapped(backend):
        return emulated_nccl.NAME if backend in (None, "gloo", "cpu:gloo") else backend

    def _wrap(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if args and isinstance(args[0], str) or args and args[0] is None:
                args = (_swapped(args[0]), *args[1:])
            elif "backend" in kwargs or original.__name__ == "init_process_group":
                kwargs["backend"] = _swapped(kwargs.get("backend"))
            return original(*args, **kwargs)
        return call

    c10d.init_process_group = dist.init_process_group = _wrap(c10d.init_process_group)
    _new_group = c10d.new_group

    @functools.wraps(_new_group)
    def new_group(*args, **kwargs):
        if kwargs.get("backend") in ("gloo", "cpu:gloo"):
            kwargs["backend"] = emulated_nccl.NAME
        return _new_group(*args, **kwargs)

    c10d.new_group = dist.new_group = new_group
