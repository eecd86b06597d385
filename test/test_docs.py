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


# The README's timed rows for the test command: "N minutes for M tests" (whole suite, then the quick tier).
_TIMED = re.compile(r"^\| `bash scripts/test\.sh( -m quick)?` \| ([\d.]+) minutes for (\d+) tests", re.M)


def test_readme_test_times_are_for_the_suite_as_it_is():
    """The README's times for the whole suite and the quick tier were taken on (within 10% of) as many tests
    as there are now: a suite that grew or shrank more than that must be timed again."""
    from conftest import QUICK

    timed = {bool(quick): int(count) for quick, _, count in _TIMED.findall((ROOT / "README.md").read_text())}
    assert set(timed) == {False, True}, "README.md has no 'N minutes for M tests' row for the suite and -m quick"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert proc.returncode == 0 and ids, proc.stdout[-2000:] + proc.stderr[-2000:]
    now = {False: len(ids), True: sum(i.startswith(QUICK) for i in ids)}
    for quick in (False, True):
        assert abs(timed[quick] - now[quick]) <= 0.1 * now[quick], (
            f"README.md times {'the quick tier' if quick else 'the suite'} on {timed[quick]} tests, there are "
            f"{now[quick]}: time `bash scripts/test.sh{' -m quick' if quick else ''}` again and update it")
