"""What a rank forked from the fork server finds in its process: each rank writes it as JSON beside the run."""

import json
import os
import signal
import sys

import distcheck


def _fd_kinds() -> list[str]:
    kinds = []
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kinds.append(target.split(":")[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) else target)
    return sorted(kinds)


@distcheck.scenario(expect="pass")
def fork_server_probe(ctx):
    import ctypes

    import torch
    import torch.distributed as dist

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    facts = {
        "num_threads": torch.get_num_threads(),
        "cpp_log_level": ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value,
        "stdout": [type(sys.stdout.buffer).__name__, sys.stdout.write_through],
        "stderr": [type(sys.stderr.buffer).__name__, sys.stderr.write_through],
        "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                            signal.SIGQUIT, signal.SIGCHLD)},
        "env": sorted(k for k in os.environ if k not in ("DISTCHECK_LAUNCHER_PID",)),
        "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
        "fds": _fd_kinds(),
        "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
        "server_was_distcheck": "distcheck.cli" in sys.modules,   # a fork of distcheck's own process
    }
    out = os.environ["FORK_SERVER_PROBE_OUT"]
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(facts, f)
    t = torch.ones(1)
    dist.all_reduce(t)
