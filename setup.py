"""What pyproject.toml alone cannot say: package discovery (every package under distcheck/, found, never listed by
hand, plus the built-in scenarios, kept in scenarios/ and installed as ``distcheck.builtin_scenarios``) and the
C extensions, built where they can be. Everything else is in pyproject.toml."""

import sys
import sysconfig
from glob import glob

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

# What a traced call costs more through the Python wrapper than through the C hot path (benchmarks/tracer_overhead.py
# --hot-only, a 1-element all_reduce, thread CPU time; docs/performance.md).
FALLBACK_COST_US = 1.4
HOT_PATH = "distcheck.rank._hot_path_c"
NATIVE_THREAD = "distcheck.rank._native_thread"


def _say(line: str) -> None:
    """One line on stderr, where the build's log is (``pip install -v``, ``python -m build``, ``setup.py``)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except UnicodeEncodeError:
        print(line.replace("\u00b5", "u"), file=sys.stderr, flush=True)


class OptionalBuildExt(build_ext):
    """Both extensions are optional: where one cannot be built (no C compiler, no Python headers) the install goes
    on and says so in one line, and its Python fallback runs (``distcheck env`` says which path runs). On a
    free-threaded Python the hot path is not built at all: its per-wrapper cache assumes the GIL."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self._not_built: dict[str, str] = {}
        self._free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
        if self._free_threaded:
            self.extensions = [ext for ext in self.extensions if ext.name != HOT_PATH]

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (BaseError, CCompilerError, OSError) as exc:   # the compiler missing, failing, or no headers
            if not ext.optional:
                raise
            self._not_built[ext.name] = self._why(exc)

    def _why(self, exc: Exception) -> str:
        """The failure in a few words: which compiler, and whether it is missing or failed (its own output, above
        this line in the build's log, says why)."""
        command = getattr(self.compiler, "compiler_so", None) or ["the C compiler"]
        missing = isinstance(exc, FileNotFoundError) or "No such file or directory" in str(exc)
        return f"{command[0]} {'not found' if missing else 'failed'}"

    def run(self) -> None:
        super().run()
        if self._free_threaded:
            _say("distcheck: a free-threaded Python: the tracer's hot path in C needs the GIL, so its Python "
                 "fallback runs")
        if not self._not_built:
            return
        reason = next(iter(self._not_built.values()))
        if set(self._not_built) >= {ext.name for ext in self.extensions}:
            _say(f"distcheck: no C compiler ({reason}): the tracer's hot path and the native thread use their "
                 f"Python fallbacks (about {FALLBACK_COST_US} \u00b5s more per traced call)")
        else:
            names = ", ".join(sorted(self._not_built))
            _say(f"distcheck: {names} not built ({reason}): its Python fallback runs")


setup(
    packages=find_packages(include=["distcheck", "distcheck.*"]) + ["distcheck.builtin_scenarios"],
    package_dir={"distcheck.builtin_scenarios": "scenarios"},
    # Optional (OptionalBuildExt): where they cannot be built the install goes on. The tracer's Python wrapper then
    # records the same calls, a little slower (distcheck.rank.hot_path), and distcheck's thread in a rank is a
    # _thread one instead of a native one the job's threading.enumerate() never lists (distcheck.rank.ticker).
    ext_modules=[Extension(HOT_PATH, sorted(glob("distcheck/rank/hot_path_c/*.c")),
                           depends=["distcheck/rank/hot_path_c/hot_path_c.h"], optional=True),
                 Extension(NATIVE_THREAD, ["distcheck/rank/native_thread_c/native_thread.c"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
