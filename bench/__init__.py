"""The project's benchmarks (``python -m bench``; see docs/benchmarks.md)."""

from pathlib import Path

# The repository root: the benchmarks' subprocesses run there, and their results go under it.
ROOT = Path(__file__).resolve().parent.parent
