"""A real two-node Slurm on this host, for tests: munged, slurmctld and two slurmd (``-N n1``, ``-N n2``),
all on 127.0.0.1 with ports of their own, in a folder of their own (config, state, logs, munge key and
socket), so nothing of the machine's own Slurm or munge setup is read or changed.

Every daemon runs in the foreground as a child of ours (``-F``/``-D``), so ``stop`` ends exactly the
processes ``start`` started, by their ids, after cancelling whatever job is still in the queue.
Commands (``srun``, ``sbatch``, ``squeue``...) find this cluster through ``SLURM_CONF`` (``env``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 8          # declared, not real: OverSubscribe=FORCE lets jobs share the host's cores
KILL_WAIT_S = 8            # SIGTERM -> SIGKILL at a time limit or scancel; short, so tests end soon
DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
    """Slurm or munge is not installed here, or would not start: the Slurm tests skip with this reason."""


def missing_programs() -> list[str]:
    return [p for p in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
            if shutil.which(p) is None]


@dataclass
class SlurmCluster:
    root: Path
    base_port: int
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment a test runs Slurm's commands under (``srun`` passes it on to the tasks)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf)}

    def command(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def start(self, timeout: float = 60) -> None:
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing; "
                                   "apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("a test Slurm needs root (slurmd starts every task as its user)")
        self._write_files()
        self._spawn("munged", "munged", "-F", "-f", f"--socket={self.root / 'munge.socket'}",
                    f"--key-file={self.root / 'munge.key'}", f"--pid-file={self.root / 'munged.pid'}",
                    f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munged.seed'}")
        self._wait(lambda: (self.root / "munge.socket").exists(), 10, "munged did not open its socket")
        self._spawn("slurmctld", "slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self._spawn(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(self.conf))
        self._wait(self._all_idle, timeout, "the nodes did not come up idle")

    def stop(self) -> None:
        """Cancel every job, then end the daemons we started (SIGTERM, then SIGKILL), slurmd first."""
        if any(p.poll() is None for p in self.procs):
            self.command("scancel", "--full", "--user", "root", timeout=10)
            self._wait(lambda: not self.jobs(), 30, None)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()

    def jobs(self) -> list[str]:
        """The ids of the jobs still in the queue."""
        try:
            done = self.command("squeue", "-h", "-o", "%i", timeout=10)
        except subprocess.TimeoutExpired:
            return ["?"]
        return done.stdout.split() if done.returncode == 0 else []

    def job_field(self, job_id: str, name: str) -> str | None:
        """One field of ``scontrol show job`` (e.g. Restarts, JobState), while the controller remembers it."""
        done = self.command("scontrol", "-o", "show", "job", job_id)
        for word in done.stdout.split():
            key, _, value = word.partition("=")
            if key == name:
                return value
        return None

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _all_idle(self) -> bool:
        done = self.command("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in NODES)

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(self.root / f"{name}.out", "wb")   # noqa: SIM115 (closed with the process's end)
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _wait(self, predicate, timeout: float, failure: str | None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead and failure:
                break
            time.sleep(0.2)
        if failure:
            logs = "; ".join(f"{n}: {self._tail(n)}" for n in ("munged", "slurmctld", "slurmd-n1"))
            self.stop()
            raise SlurmUnavailable(f"{failure} ({logs})")

    def _tail(self, name: str) -> str:
        texts = [(self.root / f"{name}.{ext}") for ext in ("log", "out")]
        text = " ".join(p.read_text(errors="replace") for p in texts if p.exists())
        return " ".join(text.split()[-30:])

    def _write_files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)     # munged refuses a key or socket in a folder others may write
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        self.conf.write_text(slurm_conf(self.root, self.base_port))


def slurm_conf(root: Path, base_port: int) -> str:
    """slurm.conf for nodes n1, n2 on 127.0.0.1: ports base_port (slurmctld), +1 and +2 (the slurmds)."""
    lines = [
        "ClusterName=distchecktest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={base_port}",
        "SlurmUser=root", "SlurmdUser=root", f"AuthInfo=socket={root / 'munge.socket'}",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={root / 'jobcomp.txt'}",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides", "ReturnToService=2", f"KillWait={KILL_WAIT_S}",
        "InactiveLimit=0", "MinJobAge=300", "SlurmctldTimeout=30", "SlurmdTimeout=30",
        "SchedulerParameters=sched_interval=1", "MessageTimeout=10",
    ]
    for i, node in enumerate(NODES):
        lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={base_port + 1 + i} "
                     f"CPUs={CPUS_PER_NODE} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
                 "OverSubscribe=FORCE")
    return "\n".join(lines) + "\n"
