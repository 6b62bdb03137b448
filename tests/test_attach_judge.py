"""attach's judging on hand-built views (pure, milliseconds): ranks nobody read, a trickle of I/O, an unreadable
sample, the Flight Recorder join by sequence number, and a view's round trip between nodes; and how ranks are
grouped into jobs, the backend named and another user's job told, on hand-built processes. On NCCL: a host blocked
in a device sync, told from recorded py-spy stacks, and the call it waits in from dumps in NCCL's format."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import re
import threading

import pytest

from distcheck.attach.discover import RankProc, group_jobs, siblings
from distcheck.attach.flight import FrCall, FrState, open_call, read_file
from distcheck.attach.foreign import Foreign, no_job_error
from distcheck.attach.judge import RankView, judge, progress
from distcheck.diagnose.progress import IO_FLOOR_BPS
from distcheck.attach.read import StackRead, backend_of, parse_dump
from distcheck.attach.session import backend, wants_native
from distcheck.errors import LaunchError
from distcheck.attach.nodes import attach_nodes, view_from_dict, view_to_dict
from distcheck.errors import UsageError
from distcheck.launch.slurm import endpoint_port
from distcheck.attach.position import Position, position
from distcheck.attach.read import ProcState
from distcheck.diagnose.verdict import Scenario
from distcheck.launch.procs import Activity

WAIT = Position("collective", "all_reduce", None, "job.py:82:main", None, None, 11, "stack of rank 0", calls=1)
POLL = Position("outside", None, None, "job.py:28:poll_for", None, None, 22, "stack of a polling rank", calls=2)
PAST = Position("outside", None, None, "job.py:131:main", None, None, 33, "in work.wait()", calls=3)
SCENARIO = Scenario(name="attach", source="job")


def view(rank: int, at: Position, *, io: int = 0, cores: float = 0.0, fr: FrState | None = None, node: int = 0,
         samples: int = 3) -> RankView:
    return RankView(rank, 1000 + rank, (at,) * samples, Activity(10.0, 2.0, cores, io, 0), ProcState(True, "S"),
                    host="h", node=node, fr=fr)


def verdict(views: dict[int, RankView], world: int, **kw):
    return judge(views, world, SCENARIO, started=1.0, ended=3.0, **kw).result


def kinds(result) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in result.findings:
        out.setdefault(f.kind, []).append(f)
    return out


def test_a_hang_with_idle_absent_ranks_is_certain_from_outside():
    result = verdict({0: view(0, WAIT), 1: view(1, POLL), 2: view(2, POLL)}, 3)
    [hang] = kinds(result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2)
    assert "certain from outside" in hang.summary and "stacks and /proc only" in hang.summary


def test_ranks_stopped_at_different_calls_from_outside_are_no_mismatch_and_the_fewest_come_first():
    """A TP pair stalled in its all_reduce, the others waiting downstream in receives (a 3-D mesh from outside): no
    groups or numbers say these are one call, so no mismatch and no "cannot match" is claimed; the verdict says
    where each stands, the fewest first (at 4,096 simulated ranks it was "different collectives were paired")."""
    recv = Position("collective", "recv", None, "job.py:90:main", None, None, 12, "stack of a receiving rank", calls=1)
    result = verdict({r: view(r, WAIT if r in (6, 7) else recv) for r in range(16)}, 16)
    assert "mismatch" not in kinds(result)
    [hang] = [f for f in result.findings if f.severity == "error"]
    assert hang.kind == "hang" and hang.waiting_ranks == tuple(range(16)) and hang.callsite == "job.py:82:main"
    assert hang.summary.startswith("16 ranks stand in 2 different collectives and none moved: ranks 6, 7 in "
                                   "all_reduce at job.py:82; ranks 0-5, 8-15 in recv at job.py:90."), hang.summary
    assert "the fewest, ranks 6, 7, are in all_reduce at job.py:82" in hang.summary
    assert "Decided: every rank in a collective, none out of it in 3 samples" in hang.summary
    assert "cannot match" not in hang.summary and "paired" not in hang.summary
    assert hang.data["apart"] == [[6, 7], [0, 1, 2, 3, 4, 5, *range(8, 16)]]
    absent = verdict({0: view(0, WAIT), 1: view(1, recv), 2: view(2, recv), 3: view(3, POLL)}, 4)
    [hang] = [f for f in absent.findings if f.severity == "error"]
    assert hang.summary.startswith("3 ranks stand in 2 different collectives and none moved: rank 0 in all_reduce")
    assert "the fewest" not in hang.summary   # 1 against 2: no call stands out by its few ranks
    assert "Outside every collective: rank 3 in none (running outside any collective at job.py:28)." in hang.summary
    assert "ranks 0, 1, 2 each in the same call in every sample" in hang.summary, hang.summary
    assert hang.absent_ranks == (3,)
    busy = verdict({0: view(0, WAIT), 1: view(1, recv), 2: view(2, POLL, io=64 * 1024)}, 3)
    [late] = kinds(busy)["straggler"]
    assert late.summary.startswith("Ranks 0, 1 wait in 2 different collectives (recv at job.py:90, all_reduce at "
                                   "job.py:82) for rank 2, which is making progress"), late.summary


def test_ranks_nobody_read_leave_the_hang_undecided_and_are_named():
    result = verdict({0: view(0, WAIT), 1: view(1, POLL)}, 4, unread_why="node 1's attach never came")
    found = kinds(result)
    assert "hang" not in found
    [note] = found["coverage"]
    assert note.severity == "warning" and note.data["unread_ranks"] == [2, 3] and note.waiting_ranks == (0,)
    assert "node 1's attach never came" in note.summary and "job.py:82" in note.summary


def test_a_trickle_of_io_is_no_progress_but_real_io_is():
    trickle = int(IO_FLOOR_BPS * 2.0) - 1          # a log line now and then over the 2 s span
    result = verdict({0: view(0, WAIT), 1: view(1, POLL, io=trickle)}, 2)
    assert [f.kind for f in result.findings if f.severity == "error"] == ["hang"]
    busy = verdict({0: view(0, WAIT), 1: view(1, POLL, io=64 * 1024)}, 2)
    assert not [f for f in busy.findings if f.severity == "error"]
    [late] = kinds(busy)["straggler"]
    assert "64.0 KiB" in late.summary and "late, not hung" in late.summary


def test_an_unreadable_sample_does_not_move_a_waiting_rank():
    timed_out = Position("unreadable", stack="py-spy did not answer in 5 s")
    rank0 = RankView(0, 1000, (WAIT, timed_out, WAIT), Activity(10.0, 2.0, 0.0, 0, 0), ProcState(True, "S"))
    result = verdict({0: rank0, 1: view(1, POLL)}, 2)
    [hang] = kinds(result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1,)


def _fr(seq: int, open_: bool) -> FrState:
    call = FrCall("0:default_pg", seq, "all_reduce", ((4,),), ("float32",), "job.py:120:main")
    return FrState(f"/tmp/fr_{seq}", {"0:default_pg": call}, call if open_ else None)


def test_the_flight_recorder_joins_by_sequence_number_a_rank_past_its_call():
    """Rank 0's Python thread is in ``work.wait()`` (no collective on its stack): its dump has #6 in flight."""
    views = {0: view(0, PAST, fr=_fr(6, True)), 1: view(1, POLL, fr=_fr(5, False)), 2: view(2, POLL, fr=_fr(5, False))}
    [hang] = kinds(verdict(views, 3))["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1, 2) and hang.seq == 6
    assert "all_reduce #6" in hang.summary and "job.py:131" in hang.callsite
    assert "Flight Recorder dumps of every rank, joined by sequence number" in hang.summary
    assert "never entered by ranks 1, 2" in hang.summary


def test_dumps_older_than_the_hang_are_not_joined():
    """The stack waits in a collective, the dump holds no call in flight: the dump predates the hang."""
    views = {0: view(0, WAIT, fr=_fr(5, False)), 1: view(1, POLL, fr=_fr(5, False))}
    [hang] = kinds(verdict(views, 2))["hang"]
    assert "no Flight Recorder dump to join" in hang.summary and hang.waiting_ranks == (0,)


def test_without_flight_recorder_a_rank_past_its_call_is_not_called_waiting():
    result = verdict({0: view(0, PAST), 1: view(1, POLL)}, 2)
    assert not [f for f in result.findings if f.severity == "error"]


def test_a_view_crosses_to_node_0_unchanged():
    v = view(3, WAIT, io=5, cores=0.25, fr=_fr(6, True), node=1)
    assert view_from_dict(view_to_dict(v)) == v
    bare = view(2, POLL)
    assert view_from_dict(view_to_dict(bare)) == bare
    nccl = FrState("/tmp/fr_0", {"0:default_pg": FrCall("0:default_pg", 6, "all_reduce")},
                   FrCall("0:default_pg", 5, "all_reduce"), device=True,
                   status={"0:default_pg": {"last_enqueued_collective": 6, "last_completed_collective": 4}})
    synced = _synced_rank(0, fr=nccl)
    assert view_from_dict(view_to_dict(synced)) == synced and synced.positions[-1].sync


def test_a_loop_polling_in_one_function_is_idle_a_move_between_functions_is_progress():
    """Under load a sample finds a polling rank on its loop's other line (``while not release.exists()``)."""
    other_line = Position("outside", None, None, "job.py:27:poll_for", None, None, 23, "on the while line", calls=2)
    poller = RankView(1, 1001, (POLL, other_line, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    [hang] = kinds(verdict({0: view(0, WAIT), 1: poller}, 2))["hang"]
    assert hang.absent_ranks == (1,) and "in the same functions in 3 samples" in hang.summary
    elsewhere = Position("outside", None, None, "job.py:40:load", None, None, 24, "loading", calls=4)
    mover = RankView(1, 1001, (POLL, elsewhere, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    result = verdict({0: view(0, WAIT), 1: mover}, 2)
    assert "hang" not in kinds(result) and "its stack moved" in kinds(result)["straggler"][0].summary


def test_a_rank_running_in_most_samples_is_late_though_a_crowded_node_gives_it_little_cpu():
    running = Position("outside", None, None, "job.py:33:busy_until", None, None, 44, "computing", calls=5,
                       active=True)
    starved = RankView(1, 1001, (running,) * 3, Activity(10.0, 2.0, 0.05, 0, 0), ProcState(True, "R"))
    result = verdict({0: view(0, WAIT), 1: starved}, 2)
    assert "hang" not in kinds(result)
    assert "its main thread was running in 3 of 3 samples" in kinds(result)["straggler"][0].summary
    awake = Position("outside", None, None, "job.py:27:poll_for", None, None, 23, "on the while line", calls=2,
                     active=True)   # a polling rank caught once between its sleeps
    caught_once = RankView(1, 1001, (POLL, awake, POLL), Activity(10.0, 2.0, 0.0, 0, 40), ProcState(True, "S"))
    [hang] = kinds(verdict({0: view(0, WAIT), 1: caught_once}, 2))["hang"]
    assert hang.absent_ranks == (1,)


SLURM_STEP = {"SLURM_JOB_ID": "8812", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "127.0.0.1,127.0.0.2", "SLURM_STEP_NUM_TASKS": "2", "MASTER_PORT": "29500"}


def test_under_srun_each_node_s_attach_meets_node_0_by_slurm_s_variables_never_on_the_job_s_port():
    nodes = attach_nodes(None, None, None, None, 60.0, None, SLURM_STEP)
    assert (nodes.nnodes, nodes.node_rank) == (2, 1)
    assert nodes.rdzv_endpoint == f"127.0.0.1:{endpoint_port('8812')}" and nodes.store_address[1] != 29500


def test_several_nodes_without_an_endpoint_is_one_clear_line():
    with pytest.raises(UsageError, match="needs --rdzv-endpoint HOST:PORT"):
        attach_nodes(2, 0, None, None, 60.0, None, {})
    one = attach_nodes(None, None, None, None, 60.0, None, {"MASTER_PORT": "29500"})
    assert not one.multi


def proc(pid: int, rank: int, *, port: str = "29500", run_id: str = "none", world: int = 3, ppid: int = 1,
         started: float = 100.0, group: str | None = None) -> RankProc:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "TORCHELASTIC_RUN_ID": run_id, **({"GROUP_RANK": group} if group is not None else {})}
    return RankProc(pid, rank, world, env, ppid, started)


def test_jobs_with_torchrun_s_default_run_id_are_told_apart_by_their_rendezvous():
    a = [proc(10 + r, r, port="29500") for r in range(3)]
    b = [proc(20 + r, r, port="29600") for r in range(3)]
    found = group_jobs(a + b)
    assert [sorted(r.pid for r in j.ranks) for j in found] == [[10, 11, 12], [20, 21, 22]]
    assert found[0].key == "MASTER_ADDR:MASTER_PORT=127.0.0.1:29500"
    named = group_jobs([proc(1, 0, run_id="abc"), proc(2, 1, run_id="abc")])
    assert [j.key for j in named] == ["TORCHELASTIC_RUN_ID=abc"]
    assert len(group_jobs([proc(1, 0, world=2), proc(2, 1, world=3)])) == 2      # WORLD_SIZE disagrees


def test_two_ranks_claiming_one_rank_number_are_two_jobs():
    """An earlier run's ranks, orphaned, beside a new run of torchrun on the same port."""
    stale = [proc(10 + r, r, ppid=1, started=100.0 + r) for r in range(3)]
    new = [proc(50 + r, r, ppid=49, started=200.0 + r) for r in range(3)]
    found = group_jobs([stale[0], new[0], stale[1], new[1], new[2], stale[2]])
    assert sorted(sorted(r.pid for r in j.ranks) for j in found) == [[10, 11, 12], [50, 51, 52]]
    assert all("started" in j.key for j in found) and found[0].key != found[1].key


def test_from_one_rank_its_siblings_are_found_launcher_or_not():
    job = [proc(10 + r, r, group="0") for r in range(2)] + [proc(12 + r, 2 + r, group="1") for r in range(2)]
    other = [proc(30 + r, r, port="29600", group="0") for r in range(2)]
    stale = proc(90, 1, group="0", started=10.0)          # an earlier run's rank 1, long before
    found = siblings([job[1]], job + other + [stale])
    assert sorted(r.pid for r in found) == [10, 11, 12, 13]   # its rendezvous (both agents here), not the stale one
    # one attach per node (--nnodes): its own agent's ranks (GROUP_RANK), though another agent's run on this machine
    assert sorted(r.pid for r in siblings([job[1]], job + other + [stale], one_agent=True)) == [10, 11]
    assert sorted(r.pid for r in siblings([job[3]], job + other, one_agent=True)) == [12, 13]


def test_the_backend_is_what_the_process_group_s_threads_are_named():
    assert backend_of(("python", "pt_gloo_runloop", "pt_gloo_runloop", "gloo_tcp_loop")) == "gloo"
    assert backend_of(("python", "pt_nccl_watchdg", "pt_nccl_heartbt")) == "nccl"
    assert backend_of(("python", "pt_nccl_watchdg", "pt_gloo_runloop")) == "nccl+gloo"
    assert backend_of(("python", "pt_elastic")) == ""
    rank = view(0, POLL)
    gloo = dataclasses.replace(rank, state=ProcState(True, "S", backend="gloo"))
    assert backend({0: gloo, 1: rank}) == "gloo" and backend({0: rank}) == "unknown"
    assert view_from_dict(view_to_dict(gloo)) == gloo


def test_ranks_not_read_and_none_waiting_is_not_decided_never_a_pass():
    judged = judge({2: view(2, POLL), 3: view(3, POLL)}, 4, SCENARIO, started=1.0, ended=3.0, unread_why="why")
    first = judged.result.findings[0]
    assert judged.undecided == first.summary and not judged.result.ok and judged.result.observed == ("coverage",)
    assert first.summary.startswith("Not decided: no rank read waits in a collective, and ranks 0, 1 were not read")
    assert first.data["unread_ranks"] == [0, 1]
    whole = judge({0: view(0, POLL), 1: view(1, POLL)}, 2, SCENARIO, started=1.0, ended=3.0)
    assert whole.undecided is None and whole.result.ok


def test_a_rank_whose_stacks_could_not_be_read_is_not_decided_not_absent():
    denied = Position("unreadable", stack="Permission denied (os error 13)")
    blind = RankView(1, 1001, (denied,) * 3, None, ProcState(True, "S"))
    judged = judge({0: view(0, WAIT), 1: blind}, 2, SCENARIO, started=1.0, ended=3.0, unread_todo="Run as root.")
    assert "hang" not in kinds(judged.result) and judged.undecided is not None
    assert "the stacks of rank 1 could not be read (Permission denied" in judged.undecided
    assert judged.undecided.endswith("Run as root.") and judged.result.findings[0].data["unreadable_ranks"] == [1]


def _foreign(pid: int, uid: int, user: str, command: str) -> Foreign:
    return Foreign(pid, uid, user, command)


def test_another_user_s_job_is_named_with_what_to_do():
    theirs = [_foreign(7, os.getuid() + 1, "alice", "torchrun train.py"), _foreign(8, os.getuid() + 1, "alice", "x")]
    asked = no_job_error(theirs, [7])
    assert isinstance(asked, LaunchError) and asked.exit_code == 3
    assert "process 7 (torchrun train.py) (and 1 more process of theirs) belongs to user alice" in asked.message
    assert "sudo -u alice distcheck attach 7" in asked.hint and "ptrace_scope" in asked.hint
    scan = no_job_error([_foreign(9, os.getuid() + 1, "bob", "torchrun t.py")], [])
    assert "1 process of other users looks like one: 9 (bob: torchrun t.py)" in scan.message
    none = no_job_error([], [])
    assert isinstance(none, UsageError) and "no torch.distributed job found" in none.message


# -- NCCL: a host blocked in a device sync, the call it waits in from the Flight Recorder ------------------------------

# What ``py-spy dump --native --full-filenames`` prints for a rank whose host is blocked in ``loss.item()`` on NCCL:
# the CUDA driver's frames (no symbols), the runtime's stream sync, torch's ``_local_scalar_dense`` (``Tensor.item()``
# copies the value to the host, then syncs the stream), then the user's Python frames (py-spy drops CPython's own).
ITEM_NATIVE = """\
Process 48213: /opt/conda/bin/python -u /home/alice/proj/train.py --epochs 3
Python v3.11.9 (/opt/conda/bin/python3.11)

Thread 48213 (active): "MainThread"
    0x7f9c2a0d3f5c (libcuda.so.535.161.08)
    0x7f9c2a1b8e21 (libcuda.so.535.161.08)
    0x7f9c29f4b6a3 (libcuda.so.535.161.08)
    0x7f9c7c3e2a11 (libcudart.so.12)
    cudaStreamSynchronize (libcudart.so.12)
    at::native::_local_scalar_dense_cuda(at::Tensor const&)::{lambda()#1}::operator() (libtorch_cuda.so)
    at::native::_local_scalar_dense_cuda (libtorch_cuda.so)
    at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA___local_scalar_dense (libtorch_cuda.so)
    c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<c10::CompileTimeFunctionPointer<c10::Scalar (at::Tensor const&), &at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA___local_scalar_dense>, c10::Scalar, c10::guts::typelist::typelist<at::Tensor const&> >, c10::Scalar (at::Tensor const&)>::call (libtorch_cuda.so)
    at::_ops::_local_scalar_dense::call (libtorch_cpu.so)
    at::native::item (libtorch_cpu.so)
    at::_ops::item::call (libtorch_cpu.so)
    torch::autograd::THPVariable_item (libtorch_python.so)
    train_step (/home/alice/proj/train.py:42)
    main (/home/alice/proj/train.py:71)
    <module> (/home/alice/proj/train.py:75)
    0x7f9c8e02924a (libc.so.6)
    __libc_start_main (libc.so.6)
    _start (python3.11)
Thread 48391 (idle): "Thread-1 (_pin_memory_loop)"
    0x7f9c8e0a3f16 (libc.so.6)
    PyThread_acquire_lock_timed (libpython3.11.so.1.0)
    Condition.wait (/opt/conda/lib/python3.11/threading.py:324)
    Queue.get (/opt/conda/lib/python3.11/queue.py:180)
    _pin_memory_loop (/opt/conda/lib/python3.11/site-packages/torch/utils/data/_utils/pin_memory.py:54)
"""

# ... and in ``torch.cuda.synchronize()``: torch's Python function, the device-wide sync below it.
SYNCHRONIZE_NATIVE = """\
Thread 51877 (active): "MainThread"
    0x7f2be8e0a4d9 (libcuda.so.550.54.15)
    0x7f2be8c1f2e0 (libcuda.so.550.54.15)
    0x7f2c3a5e0c41 (libcudart.so.12)
    cudaDeviceSynchronize (libcudart.so.12)
    c10::cuda::device_synchronize (libc10_cuda.so)
    THCPModule_cudaSynchronize (libtorch_python.so)
    synchronize (/opt/conda/lib/python3.11/site-packages/torch/cuda/__init__.py:985)
    evaluate (/home/alice/proj/train.py:88)
    main (/home/alice/proj/train.py:102)
    <module> (/home/alice/proj/train.py:110)
"""

# A wait that is no device sync (a store's get): native frames of torch, none of CUDA's.
STORE_GET_NATIVE = """\
Thread 24222 (idle): "MainThread"
    poll (libc.so.6)
    c10d::detail::SocketImpl::waitForInput (libtorch_cpu.so)
    c10d::TCPStore::doWait (libtorch_cpu.so)
    c10d::TCPStore::get (libtorch_cpu.so)
    pybind11::cpp_function::dispatcher (libtorch_python.so)
    main (/home/alice/proj/train.py:5)
"""

# NCCL's blocking wait (TORCH_NCCL_BLOCKING_WAIT=1): a stream sync inside the backend is the collective's own wait.
BLOCKING_WAIT_NATIVE = """\
Thread 60001 (active): "MainThread"
    cudaStreamSynchronize (libcudart.so.12)
    c10d::ProcessGroupNCCL::WorkNCCL::synchronizeStream (libtorch_cuda.so)
    c10d::ProcessGroupNCCL::WorkNCCL::wait (libtorch_cuda.so)
    step (/home/alice/proj/train.py:30)
"""

# emulated_nccl's stand-ins, Python frames only (what ``py-spy dump --nonblocking`` reads).
EMULATED = importlib.util.find_spec("distcheck.testing.emulated_nccl").origin   # distcheck's own file: not the user's
THREADING = threading.__file__                                                  # the standard library's
EMULATED_SYNC = f"""\
Thread 700 (idle): "MainThread"
    Condition.wait ({THREADING}:327)
    _Stream.drain ({EMULATED}:176)
    synchronize ({EMULATED}:270)
    main (/home/alice/proj/train.py:42)
"""
EMULATED_READ = f"""\
Thread 701 (idle): "MainThread"
    Condition.wait ({THREADING}:327)
    Event.wait ({THREADING}:629)
    _Pending.wait_for ({EMULATED}:209)
    _WaitOnRead.__torch_function__ ({EMULATED}:225)
    main (/home/alice/proj/train.py:43)
"""
EMULATED_PASSING = f"""\
Thread 702 (active): "MainThread"
    _Pending.wait_for ({EMULATED}:204)
    _WaitOnRead.__torch_function__ ({EMULATED}:225)
    main (/home/alice/proj/train.py:44)
"""


def pyspy(text: str, *, native: bool = True) -> StackRead:
    """The read attach makes of ``text`` (py-spy's printed dump): through py-spy's JSON form, as ``read_stacks``
    parses it. ``native`` False: the same stack read without ``--native`` (its Python frames alone)."""
    threads: list[dict] = []
    for line in text.splitlines():
        head = re.match(r'^Thread (\d+) \((\w+)\): "(.*)"$', line)
        if head:
            threads.append({"pid": 1, "thread_id": int(head[1]), "thread_name": head[3], "os_thread_id": int(head[1]),
                            "active": head[2] == "active", "owns_gil": False, "frames": []})
        elif line.startswith("    ") and threads:
            name, _, where = line.strip().rpartition(" (")
            file, _, lineno = where[:-1].rpartition(":")
            python = lineno.isdigit()
            if python or native:
                threads[-1]["frames"].append({
                    "name": name, "filename": file if python else where[:-1], "line": int(lineno) if python else 0,
                    "module": None if python else where[:-1], "short_filename": os.path.basename(file or where[:-1]),
                    "locals": None, "is_entry": False, "is_shim_entry": False})
    return parse_dump(threads[0]["os_thread_id"], json.dumps(threads))


def test_a_host_in_item_s_stream_sync_is_blocked_in_a_device_sync_at_the_user_s_line():
    at = position(pyspy(ITEM_NATIVE))
    assert at.kind == "device_sync" and at.op is None
    assert at.sync == "cudaStreamSynchronize in Tensor.item()"
    assert at.callsite == "/home/alice/proj/train.py:42:train_step"
    without = position(pyspy(ITEM_NATIVE, native=False))      # the same stack without --native: only a user line
    assert without.kind == "outside" and without.digest == at.digest


def test_torch_cuda_synchronize_is_a_device_sync_with_or_without_native_frames():
    at = position(pyspy(SYNCHRONIZE_NATIVE))
    assert at.kind == "device_sync" and at.sync == "cudaDeviceSynchronize in torch.cuda.synchronize()"
    assert at.callsite == "/home/alice/proj/train.py:88:evaluate"
    python_only = position(pyspy(SYNCHRONIZE_NATIVE, native=False))
    assert python_only.kind == "device_sync" and python_only.sync == "torch.cuda.synchronize()"


def test_emulated_nccl_s_waits_are_device_syncs_only_while_blocked():
    drained = position(pyspy(EMULATED_SYNC))
    assert drained.kind == "device_sync" and drained.sync == "emulated_nccl.synchronize()"
    assert drained.callsite == "/home/alice/proj/train.py:42:main"
    read = position(pyspy(EMULATED_READ))
    assert read.kind == "device_sync" and "pending emulated_nccl call" in read.sync
    assert position(pyspy(EMULATED_PASSING)).kind == "outside"     # a read of a tensor no call touches, passing by


def test_other_native_waits_are_no_device_sync():
    assert position(pyspy(STORE_GET_NATIVE)).kind == "outside"
    blocking = position(pyspy(BLOCKING_WAIT_NATIVE))
    assert blocking.kind == "collective" and blocking.native_wait.startswith("c10d::ProcessGroupNCCL")


def test_on_nccl_a_rank_at_one_line_is_read_once_with_native_frames():
    item = [pyspy(ITEM_NATIVE, native=False)] * 3
    assert wants_native(item, on_device=True) and not wants_native(item, on_device=False)
    moved = [pyspy(ITEM_NATIVE, native=False), pyspy(STORE_GET_NATIVE, native=False)]
    assert not wants_native(moved, on_device=True)


def _synced_rank(rank: int, *, fr: FrState | None = None, cores: float = 1.0) -> RankView:
    """A rank whose host spins in ``loss.item()``'s stream sync: two non-blocking reads, then the native one."""
    reads = (pyspy(ITEM_NATIVE, native=False),) * 2 + (pyspy(ITEM_NATIVE),)
    return RankView(rank, 1000 + rank, tuple(position(r) for r in reads), Activity(10.0, 2.0, cores, 0, 0),
                    ProcState(True, "R"), host="h", fr=fr)


def _nccl_entry(seq: int, state: str) -> dict:
    """An entry of NCCL's Flight Recorder (torch 2.13, dump version "2.10"): all_reduce #seq of the default group,
    issued at train.py:41; NCCL's watchdog retires an entry once its work completed."""
    ns = 1_765_000_000_000_000_000 + seq * 1_000_000
    site_packages = "/opt/conda/lib/python3.11/site-packages/torch/distributed"
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"), "thread_name": "pt_main_thread",
            "thread_id": "139912", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "nccl:all_reduce", "time_created_ns": ns, "input_sizes": [[1024]],
            "input_dtypes": ["Float"], "output_sizes": [[1024]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": ns + 1000 if state != "scheduled" else None,
            "time_discovered_completed_ns": ns + 2000 if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": 600000, "is_p2p": False,
            "frames": [{"name": "all_reduce", "filename": f"{site_packages}/distributed_c10d.py", "line": 2950},
                       {"name": "wrapper", "filename": f"{site_packages}/c10d_logger.py", "line": 81},
                       {"name": "train_step", "filename": "/home/alice/proj/train.py", "line": 41},
                       {"name": "main", "filename": "/home/alice/proj/train.py", "line": 71}]}


def _nccl_dump(tmp_path, rank: int, states: list[str], status: dict[str, int]) -> FrState:
    """Rank ``rank``'s dump as NCCL writes it to TORCH_FR_DUMP_TEMP_FILE<rank>, read as attach reads it."""
    path = tmp_path / f"nccl_trace_rank_{rank}"
    path.write_bytes(pickle.dumps({
        "version": "2.10", "comm_lib_version": "2.27.3",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": status}, "entries": [_nccl_entry(i + 1, s) for i, s in enumerate(states)]}))
    state = read_file(path, rank, 2)
    assert isinstance(state, FrState), state
    return state


def _status(enqueued: int, completed: int, started: int = -1) -> dict[str, int]:
    return {"last_enqueued_collective": enqueued, "last_started_collective": started,
            "last_completed_collective": completed}


def test_on_nccl_the_call_a_rank_waits_in_is_the_first_not_completed(tmp_path):
    """#5 started and never finished (its peer never came); #6 was enqueued behind it on the same stream."""
    fr = _nccl_dump(tmp_path, 0, ["completed"] * 4 + ["started", "scheduled"], _status(6, 4, 5))
    assert fr.device and fr.open.seq == 5 and fr.entered == {"0:default_pg": 6}
    assert fr.open.callsite == "/home/alice/proj/train.py:41:train_step"
    assert fr.status == {"0:default_pg": _status(6, 4, 5)}
    # pg_status is the watchdog's word: #5 completed though its entry still said "started"
    later = _nccl_dump(tmp_path, 0, ["completed"] * 4 + ["started", "scheduled"], _status(6, 5, 5))
    assert later.open.seq == 6
    # a peer that enqueued past #5 says nothing of #5's completion on NCCL
    ahead = FrState("peer", {"0:default_pg": FrCall("0:default_pg", 7, "all_reduce")}, device=True)
    assert open_call(0, {0: fr, 1: ahead}).seq == 5


def test_a_host_blocked_in_a_device_sync_waits_in_the_call_its_dump_holds_not_completed(tmp_path):
    rank0 = _synced_rank(0, fr=_nccl_dump(tmp_path, 0, ["completed"] * 4 + ["started", "scheduled"], _status(6, 4)))
    rank1 = view(1, POLL, fr=_nccl_dump(tmp_path, 1, ["completed"] * 4, _status(4, 4)))
    judged = judge({0: rank0, 1: rank1}, 2, SCENARIO, started=1.0, ended=3.0)
    [hang] = kinds(judged.result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1,) and hang.seq == 5 and hang.op == "all_reduce"
    assert ("Rank 0 is waiting in all_reduce #5 (group 0:default_pg) called at /home/alice/proj/train.py:41 (it "
            "returned, but its work never completed on the device; the host is blocked in a device sync at "
            "/home/alice/proj/train.py:42); rank 1 never entered it (running outside any collective at job.py:28)"
            ) in hang.summary
    assert "all_reduce #5 [group 0:default_pg] in flight on rank 0, never entered by rank 1" in hang.summary
    [out0] = [r for r in judged.result.ranks if r.rank == 0]
    assert out0.state == "stuck" and out0.where == "/home/alice/proj/train.py:42:train_step"
    assert out0.last_event.enqueued and out0.flight_recorder == {"0:default_pg": _status(6, 4)}


def test_a_spinning_device_sync_is_no_progress_but_a_spinning_rank_elsewhere_is():
    spinning = _synced_rank(0)
    assert spinning.activity.cores == 1.0 and progress(spinning) is None
    busy = RankView(0, 1000, (PAST,) * 3, Activity(10.0, 2.0, 1.0, 0, 0), ProcState(True, "R"))
    assert progress(busy) is not None


def test_without_the_flight_recorder_a_device_sync_is_not_decided_and_no_number_is_claimed():
    judged = judge({0: _synced_rank(0), 1: view(1, POLL)}, 2, SCENARIO, started=1.0, ended=3.0)
    first = judged.result.findings[0]
    assert judged.undecided == first.summary and not judged.result.ok and judged.result.observed == ("coverage",)
    assert first.summary.startswith("Not decided: the host of rank 0 is blocked in a device sync at "
                                    "/home/alice/proj/train.py:42 (cudaStreamSynchronize in Tensor.item())")
    assert "rank 1 is running outside any collective at job.py:28" in first.summary
    assert "no Flight Recorder dump was reachable" in first.summary and "TORCH_FR_BUFFER_SIZE" in first.summary
    assert "TORCH_FR_DUMP_TEMP_FILE" in first.summary and "watchdog" in first.summary
    assert not re.search(r"#\d", first.summary) and "hang" not in kinds(judged.result)
    assert first.data["not_decided"] and first.data["device_sync"]["0"]["sync"].startswith("cudaStreamSynchronize")
    [out0] = [r for r in judged.result.ranks if r.rank == 0]
    assert out0.state == "stuck" and out0.last_event is None


def test_dumps_that_hold_no_call_of_the_blocked_rank_are_read_but_name_nothing(tmp_path):
    stale = _nccl_dump(tmp_path, 0, ["completed"] * 4, _status(4, 4))
    peer = _nccl_dump(tmp_path, 1, ["completed"] * 4, _status(4, 4))
    judged = judge({0: _synced_rank(0, fr=stale), 1: view(1, POLL, fr=peer)}, 2, SCENARIO, started=1.0, ended=3.0)
    assert "hold no call in flight for it" in judged.undecided and "#" not in judged.undecided


def test_a_rank_blocked_in_a_device_sync_absent_from_a_peer_s_collective_is_named_so():
    """No Flight Recorder: rank 0 waits in an all_reduce its Python thread is in; rank 1 never came, its host
    blocked in a device sync (spinning: its CPU is not work)."""
    judged = judge({0: view(0, WAIT), 1: _synced_rank(1)}, 2, SCENARIO, started=1.0, ended=3.0)
    [hang] = kinds(judged.result)["hang"]
    assert hang.waiting_ranks == (0,) and hang.absent_ranks == (1,)
    assert "rank 1 never entered it (blocked in a device sync at /home/alice/proj/train.py:42)" in hang.summary
    assert "no CPU outside the device sync of rank 1" in hang.summary and "TORCH_FR_DUMP_TEMP_FILE" in hang.summary


def test_on_nccl_every_rank_in_a_call_that_never_completes_is_a_hang_in_it(tmp_path):
    """Both ranks enqueued #5, it never completed (a link down): rank 0's host blocked in ``.item()``, rank 1's idle
    in its own code; neither is in a Python collective."""
    stuck = ["completed"] * 4 + ["started"]
    rank0 = _synced_rank(0, fr=_nccl_dump(tmp_path, 0, stuck, _status(5, 4)))
    rank1 = view(1, POLL, fr=_nccl_dump(tmp_path, 1, stuck, _status(5, 4)))
    [hang] = kinds(verdict({0: rank0, 1: rank1}, 2))["hang"]
    assert hang.waiting_ranks == (0, 1) and not hang.absent_ranks and hang.seq == 5
    assert "every rank entered it but it never completed" in hang.summary
    assert "rank 0: the host is blocked in a device sync at /home/alice/proj/train.py:42" in hang.summary
    assert "rank 1: the host is blocked at job.py:28" in hang.summary
