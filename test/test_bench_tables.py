"""Every figure README.md and docs/ quote from the committed benchmark results is rendered from them.

`python -m bench.tables` renders the generated regions and the ``<!--fig:...-->`` figures from
docs/benchmarks/*.json; these tests regenerate them in memory and compare with what is
committed, and check that a figure typed by hand where the docs quote results is caught.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from limits import HANG_TIMEOUT_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import tables  # noqa: E402


@pytest.fixture
def repo(tmp_path):
    """A copy of the README, the docs and the committed results, to break."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def _edit_json(path: pathlib.Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def test_the_docs_quote_the_committed_results():
    # Regions, figures in prose, and the result pages rendered by the bench's own writers.
    assert tables.check() == []


def test_the_command_line_check_passes():
    proc = subprocess.run([sys.executable, "-m", "bench.tables", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr


def test_the_docs_quote_results_in_generated_regions_and_figures():
    # Guards the check itself: it has something to check on every page that quotes results.
    expected = {"README.md": {"executions", "headline"}, "docs/index.md": {"executions"},
                "docs/benchmarks.md": {"bench-steps", "bench-scaling", "bench-memory", "host-time", "per-op",
                                       "per-op-embed", "accumulation"},
                "docs/spmd.md": {"spmd", "spmd-llama"}}
    for page, regions in expected.items():
        text = (ROOT / page).read_text()
        assert {m["name"] for m in tables.REGION.finditer(text)} == regions, page
    figures = {page: len(tables.FIG.findall((ROOT / page).read_text()))
               for page in ("docs/benchmarks.md", "docs/design.md", "docs/fused_step.md", "docs/spmd.md")}
    assert all(figures.values()), figures


def test_a_changed_result_makes_its_figures_stale_and_writing_renders_them(repo):
    row = ("mlp32x256", "zero_grads", "openxla_fused_step")

    def edit(data):
        r = next(r for r in data["results"] if (r["workload"], r["loop"], r["mode"]) == row and "micro" not in r)
        r["step_ms_ratio"] = 0.123456

    _edit_json(repo / "docs/benchmarks/results.json", edit)
    problems = tables.check(repo, with_pages=False)
    stale = {p.split(":")[0] for p in problems}
    # The README's headline table and the benchmarks page's step table quote it.
    assert {"README.md", "docs/benchmarks.md"} <= stale, problems
    assert "0.12x" not in (repo / "README.md").read_text()

    assert tables.main(["--root", str(repo)]) == 0
    assert tables.check(repo) == []
    readme = (repo / "README.md").read_text()
    assert "| MLP 32x256 | `set_to_none=False` | 5 / 3 / 1 | 1.12x | 0.12x |" in readme
    assert "| 0.123 |" in (repo / "docs/benchmarks/results.md").read_text()  # the result page too


def test_a_figure_in_prose_is_checked_against_its_file(repo):
    design = repo / "docs/design.md"
    text = design.read_text()
    marker = "<!--fig:results/bank1000/zero_grads/openxla_fused_grad/callback_ms-->"
    assert marker + "10.7 ms<!--/fig-->" in text
    design.write_text(text.replace(marker + "10.7 ms", marker + "10.0 ms"))
    stale = "docs/design.md: stale figures (python -m bench.tables rewrites them)"
    assert tables.check(repo, with_pages=False) == [stale]


def test_a_figure_missing_from_its_file_fails(repo):
    _edit_json(repo / "docs/benchmarks/host_time.json",
               lambda data: data["workloads"].remove(next(w for w in data["workloads"] if w["workload"] == "bank1000")))
    problems = tables.check(repo, with_pages=False)
    assert problems and all("bank1000" in p for p in problems), problems
    assert any(p.startswith("docs/benchmarks.md: host_time.json: no workload bank1000") for p in problems), problems
    # Nothing is rewritten when a figure cannot be rendered.
    before = (repo / "docs/benchmarks.md").read_text()
    assert tables.main(["--root", str(repo)]) == 1
    assert (repo / "docs/benchmarks.md").read_text() == before


def test_an_edited_generated_table_is_stale(repo):
    readme = repo / "README.md"
    text = readme.read_text()
    assert "| 4 micro-batches, compiled optimizer | 14 | 9 | 1 |" in text
    readme.write_text(text.replace("| 4 micro-batches, compiled optimizer | 14 | 9 | 1 |",
                                   "| 4 micro-batches, compiled optimizer | 14 | 8 | 1 |"))
    assert tables.check(repo, with_pages=False) == ["README.md: stale figures (python -m bench.tables rewrites them)"]


def test_broken_markers_fail(repo):
    index = repo / "docs/index.md"
    index.write_text(index.read_text().replace("<!-- end generated -->", ""))
    spmd = repo / "docs/spmd.md"
    spmd.write_text(spmd.read_text().replace("<!-- generated: spmd -->", "<!-- generated: no-such-table -->"))
    problems = tables.check(repo, with_pages=False)
    assert any(p.startswith("docs/index.md: ") and "end marker" in p for p in problems), problems
    assert any(p.startswith("docs/spmd.md: ") and "no-such-table" in p for p in problems), problems


SECTION = """## Results

<!-- generated: executions -->
| a table |
<!-- end generated -->

{prose}
"""


@pytest.mark.parametrize("prose, typed", [
    ("The fused step takes 0.63x the host time.", ["0.63x"]),
    ("Upstream runs 14 executions against 1.", ["14", "1"]),
    ("It takes 16.1 MB and 96 ms, 10% of the step.", ["16.1 MB", "96 ms", "10%"]),
    ("The fused step takes <!--fig:host/mlp32x256/openxla_fused_step/host_ratio-->0.62x<!--/fig--> the time.", []),
    ("On a 32-layer MLP, 2-core machine, 4 micro-batches, at 10 and 100 tensors, after 7 steps, ResNet-18.", []),
    ("Measured separately (`python -m bench.host_time --one bank3000`): 353 ms.", []),
    ("Measured separately, with no command given: 353 ms.", ["353 ms"]),
    ("Run `torch_xla.sync()` with `CPU_NUM_DEVICES=4` and `--steps 3`.", []),
])
def test_figures_typed_by_hand_where_the_docs_quote_results(prose, typed):
    assert [n for n, _ in tables.unchecked_figures(SECTION.format(prose=prose))] == typed


def test_only_blocks_that_quote_results_are_checked():
    other = "## Elsewhere\n\nA hand measurement: 9.5 s against 4.0 s.\n"
    assert tables.unchecked_figures(other) == []
    cites = "## Elsewhere\n\nFrom [results.json](x/results.json): 9.5 s.\n\nNot this one: 4.0 s.\n"
    assert [n for n, _ in tables.unchecked_figures(cites)] == ["9.5 s"]
    # A paragraph that ends with ':' quotes the table after it.
    table = "## Elsewhere\n\nThe last full run:\n\n| a | 1.5 |\n"
    assert [n for n, _ in tables.unchecked_figures(table)] == ["1.5"]


def test_the_readme_is_a_short_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in readme
        assert (ROOT / command.split()[1]).is_file()
    assert "```text" not in readme  # the explain samples live in docs/explain.md
