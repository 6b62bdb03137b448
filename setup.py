"""Package discovery, which pyproject.toml alone cannot say: every package under distcheck/ (found,
never listed by hand) plus the built-in scenarios, kept in scenarios/ and installed as
``distcheck.builtin_scenarios``. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["distcheck", "distcheck.*"]) + ["distcheck.builtin_scenarios"],
    package_dir={"distcheck.builtin_scenarios": "scenarios"},
)
