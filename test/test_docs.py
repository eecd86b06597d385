"""The documentation builds with MkDocs in strict mode, and every Python sample in it runs."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from limits import HANG_TIMEOUT_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_samples() -> list[tuple[str, str]]:
    """(``file:line``, code) for every fenced ``python`` block under docs/."""
    samples = []
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            samples.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return samples


SAMPLES = python_samples()


def test_docs_have_samples():
    # Guards the extraction itself: the user guide's samples must be found.
    assert sum(name.startswith("docs/guide.md") for name, _ in SAMPLES) >= 5, [n for n, _ in SAMPLES]


@pytest.mark.parametrize("name,code", SAMPLES, ids=[name for name, _ in SAMPLES])
def test_python_sample_runs(name, code, tmp_path):
    script = tmp_path / "sample.py"
    script.write_text(code)
    # The package under test first on the path, as a user's checkout would have it installed.
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_mkdocs_build_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.skip("mkdocs is not installed (pip install -e .[docs]); scripts/env.sh installs it")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "guide/index.html", "design/index.html", "benchmarks/index.html",
                 "benchmarks/results/index.html", "frameworks/index.html", "frameworks/trainer/index.html",
                 "frameworks/accelerate/index.html", "frameworks/plain-loop/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
