"""What pyproject.toml alone cannot say: package discovery (every package under distcheck/, found, never listed by
hand, plus the built-in scenarios, kept in scenarios/ and installed as ``distcheck.builtin_scenarios``) and the
tracer's hot path in C. Everything else is in pyproject.toml."""

from glob import glob

from setuptools import Extension, find_packages, setup

setup(
    packages=find_packages(include=["distcheck", "distcheck.*"]) + ["distcheck.builtin_scenarios"],
    package_dir={"distcheck.builtin_scenarios": "scenarios"},
    # Optional: where it cannot be built (no C compiler) the install goes on and the tracer's Python wrapper
    # records the same calls, a little slower (distcheck.rank.hot_path).
    ext_modules=[Extension("distcheck.rank._hot_path_c", sorted(glob("distcheck/rank/hot_path_c/*.c")),
                           depends=["distcheck/rank/hot_path_c/hot_path_c.h"], optional=True)],
)
