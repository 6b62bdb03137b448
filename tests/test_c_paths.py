"""distcheck's two C extensions, the tracer's hot path (``distcheck.rank._hot_path_c``) and distcheck's thread in a
rank (``distcheck.rank._native_thread``), where they build, and their Python fallbacks where they do not:

* the sources compile warning-free (``-Wall -Wextra``) on this interpreter's headers, through the compiler's
  builtins and through their portable C, and use no C API that 3.12 deprecated; the free-threaded branches compile;
* the C types keep their contracts (no torch needed: ``.ci/c_paths`` runs these on every CPython 3.10-3.13);
* a wheel carries the built modules, never their sources; the sdist carries the sources;
* an install without a C compiler succeeds, says so in one line, and runs both fallbacks; ``distcheck env`` says
  which path runs and why.

The tracer's own tests run through both hot paths (``tests/conftest.py``'s ``hot_path`` fixture). Nothing here
imports torch at the top: a test that needs it skips where it is missing. ``DISTCHECK_C_SOURCE`` names the source
tree to build from where the tests run from elsewhere (``.ci/c_paths``); by default, this checkout.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("DISTCHECK_C_SOURCE") or Path(__file__).resolve().parent.parent)
HOT_C = sorted((SOURCE / "distcheck/rank/hot_path_c").glob("*.c"))
THREAD_C = SOURCE / "distcheck/rank/native_thread_c/native_thread.c"
C_FILES = [*HOT_C, THREAD_C]
INCLUDE = sysconfig.get_paths()["include"]
GCC = shutil.which("gcc") or shutil.which("cc")
NO_COMPILER_LINE = re.compile(r"^\s*distcheck: no C compiler \((?P<why>[^)]*)\): the tracer's hot path and the "
                              r"native thread use their Python fallbacks \(about [0-9.]+ .s more per traced call\)$")
# Replaced in 3.12 (PyErr_GetRaisedException / PyErr_SetRaisedException): a build for 3.12+ must not call them.
DEPRECATED_IN_312 = ("PyErr_Fetch", "PyErr_Restore", "PyErr_NormalizeException")

needs_sources = pytest.mark.skipif(not (SOURCE / "setup.py").exists() or not HOT_C,
                                   reason=f"no distcheck source tree at {SOURCE}")
needs_gcc = pytest.mark.skipif(GCC is None or not Path(INCLUDE, "Python.h").exists(),
                               reason="no C compiler or no Python headers here")


def _c_module(name: str):
    return pytest.importorskip(f"distcheck.rank.{name}", reason=f"distcheck.rank.{name} is not built here")


# -- the sources ----------------------------------------------------------------------------------------------


def _compile(path: Path, *flags: str, out: Path | None = None) -> subprocess.CompletedProcess:
    target = ["-c", "-o", str(out)] if out else ["-fsyntax-only"]
    return subprocess.run([GCC, *target, "-Wall", "-Wextra", "-Werror", "-O0", f"-I{INCLUDE}", *flags, str(path)],
                          capture_output=True, text=True, timeout=120)


@needs_sources
@needs_gcc
@pytest.mark.parametrize("variant", ["builtins", "portable"])
def test_the_sources_compile_without_a_warning_on_this_pythons_headers(variant):
    flags = ["-DDISTCHECK_PORTABLE_C"] if variant == "portable" else []
    failed = {p.name: done.stderr[-2000:] for p in C_FILES if (done := _compile(p, *flags)).returncode}
    assert not failed, failed


@needs_sources
@needs_gcc
@pytest.mark.skipif(sys.version_info < (3, 13), reason="free-threaded CPython starts at 3.13")
def test_the_free_threaded_branches_compile():
    # Py_GIL_DISABLED as a 3.13t build defines it (its headers' object layout aside: this checks distcheck's code)
    failed = {p.name: done.stderr[-2000:] for p in C_FILES
              if (done := _compile(p, "-DPy_GIL_DISABLED=1")).returncode}
    assert not failed, failed
    module = (SOURCE / "distcheck/rank/hot_path_c/module.c").read_text()
    assert "#ifdef Py_GIL_DISABLED" in module and "PyExc_ImportError" in module   # refuses: the Python path runs
    assert "PyUnstable_Module_SetGIL" in THREAD_C.read_text()   # the thread keeps the GIL off (rule 0)


@needs_sources
@needs_gcc
def test_no_c_api_that_312_deprecated_is_called(tmp_path):
    called = set()
    for path in C_FILES:
        done = _compile(path, out=tmp_path / f"{path.stem}.o")
        assert done.returncode == 0, done.stderr[-2000:]
        nm = subprocess.run(["nm", "-u", str(tmp_path / f"{path.stem}.o")], capture_output=True, text=True)
        if nm.returncode != 0:
            pytest.skip("no nm here")
        called |= {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    if sys.version_info >= (3, 12):
        assert not called & set(DEPRECATED_IN_312) and "PyErr_GetRaisedException" in called
    # structmember.h's old names: gone (3.12 renamed them Py_T_*, Py_READONLY); the overflow builtins: behind the
    # header's compiler guard only
    header = (SOURCE / "distcheck/rank/hot_path_c/hot_path_c.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", "".join(p.read_text() for p in C_FILES), flags=re.S)   # code, not comments
    assert not re.search(r"\bT_OBJECT(_EX)?\b|\bREADONLY\b|__builtin_\w+_overflow", text)
    assert "#if defined(HAVE_OVERFLOW_BUILTINS)" in header


KEY_CASES = [(0, 1, 0), (5, 7, 3), (2**64 - 2, 1, 0), (2**64 - 1, 1, 0), (2**64 - 1, 0, 0), (0, 0, 1), (3, 0, 3),
             (3, 0, 4), (10, 5, -1), (2**64 - 3, 1, -1), (2**64 - 3, 1, -2), (2**64 - 3, 1, -3), (0, 0, -(2**63)),
             (2**63, 0, -(2**63)), (2**63, 2**63, 0), (2**63 - 1, 2**63, 0), (1, 1, 2**63 - 1),
             (2**64 - 1, 0, 2**63 - 1)]
KEY_PROGRAM = r"""
#include "hot_path_c.h"
#include <inttypes.h>
#include <stdio.h>
int main(void) {
    unsigned long long base, seq; long long skew;
    while (scanf("%llu %llu %lld", &base, &seq, &skew) == 3) {
        uint64_t out = 0;
        if (key_overflows(base, seq, skew, &out)) printf("overflow\n"); else printf("%" PRIu64 "\n", out);
    }
    return 0;
}
"""


def _python_key(base: int, seq: int, skew: int) -> str:
    """As the builtins check it: base + seq, then - skew, each within 64 bits unsigned."""
    total = base + seq
    if total >= 2**64 or not 0 <= total - skew < 2**64:
        return "overflow"
    return str(total - skew)


@needs_sources
@needs_gcc
@pytest.mark.parametrize("variant", ["builtins", "portable"])
def test_a_calls_key_is_checked_alike_with_and_without_the_compilers_builtins(tmp_path, variant):
    program = tmp_path / "key.c"
    program.write_text(KEY_PROGRAM)
    flags = ["-DDISTCHECK_PORTABLE_C"] if variant == "portable" else []
    built = subprocess.run([GCC, "-O2", "-Wall", "-Wextra", "-Werror", f"-I{INCLUDE}",
                            f"-I{SOURCE / 'distcheck/rank/hot_path_c'}", *flags, str(program),
                            "-o", str(tmp_path / "key")], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    feed = "".join(f"{b} {s} {k}\n" for b, s, k in KEY_CASES)
    got = subprocess.run([str(tmp_path / "key")], input=feed, capture_output=True, text=True, timeout=30).stdout
    assert got.split() == [_python_key(*case) for case in KEY_CASES]


# -- the C types' contracts, without torch ---------------------------------------------------------------------


def test_hot_state_reads_as_its_attributes_did_and_survives_a_delete():
    c = _c_module("_hot_path_c")
    hot = c.HotState()
    assert hot.busy_group is None and hot.count == 0
    hot.busy_group, hot.count = "g1", 2**64 - 1
    assert hot.busy_group == "g1" and hot.count == 2**64 - 1
    del hot.busy_group   # read as None after, as the T_OBJECT member read it (and never a NULL the fast path frees)
    assert hot.busy_group is None
    hot.busy_group = "g2"
    assert hot.busy_group == "g2"
    with pytest.raises(TypeError):
        c.HotState(1)


def test_the_thread_flag_is_one_value_per_thread():
    c = _c_module("_hot_path_c")
    flag, seen = c.ThreadFlag(), []
    flag.active = True
    worker = threading.Thread(target=lambda: seen.append(flag.active))
    worker.start()
    worker.join()
    assert flag.active is True and seen == [False]
    flag.active = False
    assert flag.active is False


def test_the_slot_cursor_appends_within_its_mapping():
    c = _c_module("_hot_path_c")
    buf, cursor = bytearray(8), c.SlotCursor()
    cursor.attach(buf, 2)
    cursor.write(b"abc")
    assert cursor.tell() == 5 and bytes(buf[2:5]) == b"abc"
    with pytest.raises(ValueError):
        cursor.write(b"abcd")
    assert cursor.detach() == 5
    with pytest.raises(ValueError):
        cursor.write(b"x")


def test_the_native_thread_ticks_unseen_and_stops():
    c = _c_module("_native_thread")
    ticks, idents = [], []

    def tick():
        ticks.append(time.monotonic())
        idents.append(threading.get_ident())
        return True

    thread = c.NativeThread(tick, 0.01)
    before = threading.active_count()
    thread.start()
    deadline = time.monotonic() + 10
    while len(ticks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ticks) >= 3 and thread.running
    assert threading.active_count() == before and thread.ident == idents[0] != threading.get_ident()
    assert thread.stop(2.0) is True and not thread.running
    after = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == after



def test_a_forked_child_s_native_thread_forgets_the_parent_s_and_ticks_anew():
    """After fork the thread is gone from the child while its object says it ran, and its lock may be held:
    ``forget_after_fork`` makes the lock and condition anew, and the child starts and stops its own thread."""
    c = _c_module("_native_thread")
    ticks: list[float] = []
    thread = c.NativeThread(lambda: ticks.append(time.monotonic()) or True, 0.01)
    thread.start()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: report how it went through the pipe, then leave at once
            ok = False
            try:
                thread.forget_after_fork()
                seen = len(ticks)
                thread.start()
                deadline = time.monotonic() + 10
                while len(ticks) < seen + 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                ok = len(ticks) >= seen + 3 and thread.stop(2.0) is True and not thread.running
            finally:
                os.write(write, b"1" if ok else b"0")
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"1"
        os.waitpid(pid, 0)
    finally:
        assert thread.stop(2.0) is True


# -- what the package ships, and an install without a C compiler ---------------------------------------------


def _copy_sources(dest: Path) -> Path:
    """The source tree as a fresh clone has it (no build outputs, no built modules), so a build here is clean."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=SOURCE, capture_output=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (SOURCE / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(SOURCE / name, dest / name)
    else:
        shutil.copytree(SOURCE, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".venv"))
    return dest


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A copy of the source tree to build in."""
    pytest.importorskip("setuptools", reason="building needs setuptools in this interpreter")
    if not (SOURCE / "setup.py").exists():
        pytest.skip(f"no distcheck source tree at {SOURCE}")
    return _copy_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory, sources):
    """A wheel built where the C compiler fails (CC=/bin/false), as pip builds it, with the build's output."""
    work, src = tmp_path_factory.mktemp("no_compiler"), sources
    env = {**os.environ, "CC": "/bin/false", "LDSHARED": "/bin/false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(work / "dist"), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, src, next((work / "dist").glob("distcheck-*.whl")), done.stdout + done.stderr


@needs_sources
def test_without_a_compiler_the_build_succeeds_and_says_so_in_one_line(no_compiler):
    _, _, wheel, output = no_compiler
    said = [line for line in output.splitlines() if re.match(r"\s*distcheck:", line)]
    assert len(said) == 1 and NO_COMPILER_LINE.match(said[0]), said
    assert NO_COMPILER_LINE.match(said[0])["why"] == "/bin/false failed"
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith(".so")]
    assert "distcheck/rank/hot_path.py" in names and "distcheck/rank/ticker.py" in names


@needs_sources
def test_a_wheel_carries_no_c_sources_and_the_sdist_carries_them_all(no_compiler, tmp_path):
    _, src, wheel, _ = no_compiler
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".c", ".h"))], names
    assert "distcheck/rank/inject/sitecustomize.py" in names   # package data that is wanted stays
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sdist = next(tmp_path.glob("distcheck-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {str(p.relative_to(SOURCE)) for p in [*C_FILES, *(SOURCE / "distcheck/rank/hot_path_c").glob("*.h")]}
    assert sources <= in_sdist, sources - in_sdist


FREE_THREADED_BUILD = r"""
import runpy, sys, sysconfig
real = sysconfig.get_config_var
sysconfig.get_config_var = lambda name: 1 if name == "Py_GIL_DISABLED" else real(name)   # as a 3.13t Python says
sys.argv = ["setup.py", "-q", "build_ext", "--build-lib", sys.argv[1], "--build-temp", sys.argv[2]]
runpy.run_path("setup.py", run_name="__main__")
"""


@needs_sources
@needs_gcc
def test_on_a_free_threaded_python_setup_builds_no_hot_path_and_says_so(sources, tmp_path):
    done = subprocess.run([sys.executable, "-c", FREE_THREADED_BUILD, str(tmp_path / "lib"), str(tmp_path / "tmp")],
                          cwd=sources, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = sorted(p.name.split(".")[0] for p in (tmp_path / "lib").rglob("*.so"))
    assert built == ["_native_thread"]
    said = [line for line in done.stderr.splitlines() if line.startswith("distcheck:")]
    assert said == [("distcheck: a free-threaded Python: the tracer's hot path in C needs the GIL, so its Python "
                     "fallback runs")]


INSTALLED_PROBE = r"""
import importlib, json, os, sys
import distcheck
from distcheck import envinfo
facts = {"from": distcheck.__file__, "c_paths": envinfo.c_paths(os.environ), "modules": {}}
for name in ("distcheck.rank._hot_path_c", "distcheck.rank._native_thread"):
    try:
        importlib.import_module(name)
        facts["modules"][name] = "loaded"
    except ImportError as exc:
        facts["modules"][name] = type(exc).__name__
try:
    import torch  # noqa: F401  (distcheck.rank needs it)
except ImportError:
    pass
else:
    from distcheck.rank import hot_path, ticker
    facts["c_hot_path"] = repr(hot_path.c_hot_path())
    facts["native_thread_type"] = repr(ticker.native_thread_type())
print(json.dumps(facts), flush=True)
try:   # then what `distcheck env` shows, where its command line's libraries are
    from distcheck.cli import main
except ImportError as exc:
    sys.exit(print(f"no distcheck env here: {exc}"))
sys.argv = ["distcheck", "env"]
main()
"""


@needs_sources
def test_without_a_compiler_the_install_imports_and_runs_the_fallbacks(no_compiler):
    work, _, wheel, _ = no_compiler
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # distcheck's dependencies from this interpreter's site folders, by plain path lines (after the venv's own, so
    # its distcheck is the wheel's): no editable finder or other .pth file of theirs comes with them
    sites = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    Path(site, "_host_libraries.pth").write_text("".join(f"{p}\n" for p in sites))
    env = {k: v for k, v in os.environ.items() if k not in ("DISTCHECK_HOT_PATH", "PYTHONPATH")}
    probe = subprocess.run([str(py), "-c", INSTALLED_PROBE], capture_output=True, text=True, cwd=work, env=env,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    first, _, shown = probe.stdout.partition("\n")
    facts = json.loads(first)
    assert facts["from"].startswith(str(venv))
    assert set(facts["modules"].values()) == {"ModuleNotFoundError"}
    assert facts["c_paths"] == {"hot_path": "Python (no C compiler at install)",
                                "native_thread": "_thread fallback (no C compiler at install)"}
    if "c_hot_path" in facts:
        assert facts["c_hot_path"] == "None" and facts["native_thread_type"] == "None"
    if importlib.util.find_spec("typer") and importlib.util.find_spec("torch"):   # `distcheck env` ran there too
        assert re.search(r"tracer hot path\s+Python \(no C compiler at install\)", shown), shown
        assert re.search(r"rank thread\s+_thread fallback \(no C compiler at install\)", shown), shown


# -- `distcheck env`: which path runs -------------------------------------------------------------------------


@pytest.mark.parametrize("forced", [False, True])
def test_env_says_the_path_the_tracer_and_the_ticker_take(monkeypatch, forced):
    pytest.importorskip("torch")
    from distcheck import envinfo
    from distcheck.rank import hot_path, ticker
    if forced:
        monkeypatch.setenv("DISTCHECK_HOT_PATH", "python")
    else:
        monkeypatch.delenv("DISTCHECK_HOT_PATH", raising=False)
    paths = envinfo.c_paths(os.environ)
    assert (paths["hot_path"] == "C") == (hot_path.c_hot_path() is not None)
    assert (paths["native_thread"] == "native") == (ticker.native_thread_type() is not None)
    if forced:
        assert paths == {"hot_path": "Python (DISTCHECK_HOT_PATH=python)",
                         "native_thread": "_thread fallback (DISTCHECK_HOT_PATH=python)"}
    info = envinfo.collect(os.environ)
    assert (info.hot_path, info.native_thread) == (paths["hot_path"], paths["native_thread"])
    assert info.to_dict()["hot_path"] == paths["hot_path"]


def test_env_view_shows_both_paths_and_why_a_fallback_runs():
    pytest.importorskip("rich")
    from rich.console import Console

    from distcheck import envinfo
    from distcheck.report import env_view
    info = envinfo.EnvInfo(distcheck="0.1.0", python="3.12", platform="Linux", hostname="n1", cpus=2, torch=None,
                           torch_error="ModuleNotFoundError: torch", hot_path="Python (no C compiler at install)",
                           native_thread="native")
    console = Console(width=120, record=True, force_terminal=False)
    env_view.render(info, console)
    out = console.export_text()
    assert re.search(r"tracer hot path\s+Python \(no C compiler at install\)", out), out
    assert re.search(r"rank thread\s+native", out), out


def test_a_free_threaded_or_broken_build_is_told_apart_from_no_compiler(monkeypatch):
    from distcheck import envinfo

    def refuse(name):
        raise ImportError("distcheck.rank._hot_path_c needs the GIL")

    monkeypatch.delenv("DISTCHECK_HOT_PATH", raising=False)
    monkeypatch.setattr(importlib, "import_module", refuse)
    assert envinfo.c_paths({})["hot_path"] == ("Python (the C module did not load: "
                                               "distcheck.rank._hot_path_c needs the GIL)")
