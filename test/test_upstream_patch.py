"""The pytorch/xla patch series in upstream/: generated from this package, yapf-clean, applies to torch_xla 2.9.0 and pytorch/xla, passes its tests.

The installed torch_xla package is copied to a temporary folder (its compiled
``_XLAC`` module lives beside it in site-packages and stays importable), the
series is applied there with ``git apply`` (without its edits to upstream
tests the wheel does not ship), and the upstream-style test file and the
measurement script run in subprocesses that import the patched copy. Where a
pytorch/xla checkout is at hand (``$PYTORCH_XLA_CHECKOUT``, or this machine's
mirror), the series is also applied with ``git am`` to its v2.9.0 and newest
trees, and part of its own test/dynamo suite runs against the patch and
against this project's backends (``upstream/run_upstream_suite.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from limits import HANG_TIMEOUT_S
from patched_tree import ROOT, UNCLEAN, apply_cleanly, copy_installed, run_script

UPSTREAM = ROOT / "upstream"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, UPSTREAM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make_patch = _load("make_patch")
suite = _load("run_upstream_suite")
PATCHES = [UPSTREAM / name for name in make_patch.PATCH_NAMES]
# Upstream files the series edits that the torch_xla wheel does not ship.
NOT_IN_WHEEL = sorted(make_patch.VENDORED_BLOBS)
# Refs of pytorch/xla the series must apply to, with identical results.
REFS = ("v2.9.0", "HEAD")

# Small enough for a 2-core CPU run; upstream's defaults are 224x224 images, batch 4, 10 samples.
UPSTREAM_TEST_ENV = {"BATCH_SIZE": "4", "SAMPLE_COUNT": "3", "IMAGE_SIZE": "64"}

def _git(*args: str, cwd: pathlib.Path | None = None, text: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=text, timeout=HANG_TIMEOUT_S, env=env)


def _run_patched(root: pathlib.Path, script: pathlib.Path, *args: str, env: dict | None = None):
    proc, out = run_script(script, root, *args, cwd=root, timeout=HANG_TIMEOUT_S, env=env)
    assert f"TORCH_XLA_FILE {root / 'torch_xla' / '__init__.py'}" in out, out[-3000:]
    assert "BRIDGE_IMPORTED False" in out, out[-3000:]
    return proc, out


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory) -> pathlib.Path:
    root = copy_installed(tmp_path_factory, "torch_xla", "pytorch_xla", "git",
                          "git is not installed; the series is applied with git apply")
    excludes = [f"--exclude={rel}" for rel in NOT_IN_WHEEL]
    for i, patch in enumerate(PATCHES):
        check = _git("apply", "--check", *excludes, str(patch), cwd=root)
        assert check.returncode == 0, check.stdout + check.stderr
        if i == 0:
            assert not (root / "torch_xla/_dynamo/deferred_backward.py").exists(), "--check changed files"
        # git apply also warns of whitespace errors: none either.
        apply_cleanly(["git", "apply", "--verbose", *excludes, str(patch)], root, unclean=f"{UNCLEAN}|warning")
    return root


def test_committed_series_is_generated_from_the_package():
    series = make_patch.make_series()
    assert list(series) == make_patch.PATCH_NAMES
    for name, text in series.items():
        assert text == (UPSTREAM / name).read_text(), f"{name} is stale: run python upstream/make_patch.py"
    on_disk = sorted(p.name for p in UPSTREAM.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert on_disk == sorted(series), "a patch file that is not part of the series"


def test_series_touches_the_bridge_config_and_tests_and_adds_the_modules(patched_root):
    files = [re.findall(r"^diff --git a/(\S+) ", p.read_text(), re.M) for p in PATCHES]
    assert files == [
        [
            "torch_xla/_dynamo/dynamo_bridge.py",
            "torch_xla/_dynamo/config.py",
            "torch_xla/_dynamo/grad_sync.py",
            "torch_xla/_dynamo/deferred_backward.py",
            "test/dynamo/test_dynamo_fused_grad.py",
        ],
        ["torch_xla/_dynamo/config.py", "test/dynamo/test_dynamo.py"],
    ]
    for rel in {f for per in files for f in per} - set(NOT_IN_WHEEL):
        assert (patched_root / rel).is_file(), rel
    # Patch 1 is off by default, patch 2 turns it on: the series ends on.
    config = (patched_root / "torch_xla/_dynamo/config.py").read_text()
    assert "fused_backward = os.environ.get('XLA_DYNAMO_FUSED_GRAD', '1') != '0'" in config
    # The shared implementation: each new module is generated from the package's module, and
    # keeps every one of its top-level functions and classes.
    for rel, (source, glue) in make_patch.NEW_MODULES.items():
        theirs = (patched_root / rel).read_text()
        assert theirs == make_patch.yapf_format(make_patch.upstream_module(source, glue)), rel
        assert _top_level_names(ROOT / "torch_xla_bridge" / source) <= _top_level_names(patched_root / rel), rel
        assert "torch_xla_bridge" not in theirs, rel


def _top_level_names(path: pathlib.Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_the_series_survives_edits_to_the_packages_docstrings_and_comments(tmp_path, monkeypatch):
    """Generated from the syntax tree, not from exact strings: rewording the package's
    docstrings and comments changes the upstream modules' text, nothing else."""
    package = tmp_path / "torch_xla_bridge"
    shutil.copytree(ROOT / "torch_xla_bridge", package)
    for source, _ in make_patch.NEW_MODULES.values():
        path = package / source
        tree = ast.parse(path.read_text())
        text = path.read_text()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node, clean=False):
                doc = ast.get_docstring(node, clean=False)
                text = text.replace(doc, doc + " Reworded.", 1)
        text = re.sub(r"^(\s*)# ", r"\1# Reworded: ", text, flags=re.M)
        path.write_text(text)
    monkeypatch.setattr(make_patch, "PACKAGE", package)
    for rel, (source, glue) in make_patch.NEW_MODULES.items():
        module = make_patch.upstream_module(source, glue)
        assert "# Reworded: " in module and "Reworded." in module, rel
        compile(module, rel, "exec")


def test_every_python_file_the_series_leaves_is_yapf_clean(patched_root):
    """Upstream's linter runs yapf 0.40.2 with its .style.yapf over test/ and torch_xla/."""
    yapf = pytest.importorskip("yapf", reason="yapf==0.40.2 is in the [upstream] and [test] extras")
    assert yapf.__version__ == "0.40.2"
    checked = []
    for patch in PATCHES:
        for rel in re.findall(r"^diff --git a/(\S+\.py) ", patch.read_text(), re.M):
            if rel in NOT_IN_WHEEL:
                continue
            text = (patched_root / rel).read_text()
            assert make_patch.yapf_format(text) == text, f"{rel} is not yapf-clean"
            checked.append(rel)
    assert "torch_xla/_dynamo/deferred_backward.py" in checked
    # The vendored upstream test, with patch 2's edits, through the same generator check.
    after = make_patch.series_files()[1]["test/dynamo/test_dynamo.py"][1]
    assert make_patch.yapf_format(after) == after


def _checkout_or_skip() -> pathlib.Path:
    checkout = suite.find_checkout()
    if checkout is None or suite.git_dir(checkout) is None:
        pytest.skip(
            f"no pytorch/xla git checkout at hand: set {suite.CHECKOUT_ENV} to a work tree or git directory "
            f"(looked at {', '.join(map(str, suite.DEFAULT_CHECKOUTS))})"
        )
    return checkout


@pytest.fixture(scope="module")
def applied_trees(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Per ref: a git repository holding that ref's torch_xla/_dynamo, test/dynamo and .style.yapf, with the series `git am`-ed."""
    gitdir = suite.git_dir(_checkout_or_skip())
    trees = {}
    for ref in REFS:
        repo = tmp_path_factory.mktemp(f"xla_{ref.replace('.', '_')}")
        archive = _git("--git-dir", str(gitdir), "archive", ref, "torch_xla/_dynamo", "test/dynamo", ".style.yapf",
                       "test/test_utils.py", text=False)
        if archive.returncode != 0:
            pytest.skip(f"{gitdir} has no ref {ref}: {archive.stderr.decode()[-300:]}")
        subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
        for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", ref)):
            assert _git(*args, cwd=repo).returncode == 0
        am = _git("am", "--whitespace=error", *map(str, PATCHES), cwd=repo)
        assert am.returncode == 0, f"git am on {ref}: {am.stdout}{am.stderr}"
        trees[ref] = repo
    return trees


def test_series_applies_with_git_am_to_v2_9_0_and_master_identically(applied_trees):
    subjects = {}
    results = {}
    for ref, repo in applied_trees.items():
        subjects[ref] = _git("log", "--format=%s", f"-{len(PATCHES)}", cwd=repo).stdout.splitlines()[::-1]
        # The trees git am leaves under the two folders the series changes.
        results[ref] = [_git("rev-parse", f"HEAD:{d}", cwd=repo).stdout.strip() for d in ("torch_xla/_dynamo", "test/dynamo")]
        assert all(results[ref]), results
    assert subjects[REFS[0]] == [p.subject for p in make_patch.SERIES]
    assert subjects[REFS[0]] == subjects[REFS[1]]
    assert results[REFS[0]] == results[REFS[1]], "the series leaves different files on v2.9.0 and master"


def test_vendored_upstream_files_match_both_refs(applied_trees):
    gitdir = suite.git_dir(_checkout_or_skip())
    for ref in REFS:
        for rel, blob in make_patch.VENDORED_BLOBS.items():
            assert _git("--git-dir", str(gitdir), "rev-parse", f"{ref}:{rel}").stdout.strip() == blob, (ref, rel)


def test_upstream_style_tests_pass_on_the_patched_copy(patched_root):
    test_file = patched_root / make_patch.TEST_FILE
    tree = ast.parse(test_file.read_text())
    expected = {
        f"{cls.name}.{fn.name}"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")
    }
    assert len(expected) == 8
    proc, out = _run_patched(patched_root, test_file, "-v", env=UPSTREAM_TEST_ENV)
    assert proc.returncode == 0, out[-5000:]
    passed = set(re.findall(r"^(test_\w+) \(__main__\.(\w+)\.test_\w+\) \.\.\. .*?ok$", out, re.M | re.S))
    assert {f"{cls}.{name}" for name, cls in passed} == expected, out[-5000:]
    assert f"Ran {len(expected)} tests" in out
    assert re.search(r"^OK$", out, re.M)


def test_executions_per_step_on_the_patched_copy(patched_root):
    proc, out = _run_patched(patched_root, UPSTREAM / "measure.py")
    assert proc.returncode == 0, out[-5000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    results = report["results"]
    unfused_counts = {
        "set_to_none=True, compiled optimizer": 4,
        "set_to_none=False, compiled optimizer": 5,
        "eager optimizer + mark_step": 4,
    }
    assert set(results) == set(unfused_counts)
    for loop, unfused in unfused_counts.items():
        fused_run, unfused_run = results[loop]["fused"], results[loop]["unfused"]
        assert fused_run["executions_per_step"] == [3] * 4, loop
        assert unfused_run["executions_per_step"] == [unfused] * 4, loop
        assert fused_run["sync_input_executions_after_warmup"] == 0, loop
        assert unfused_run["sync_input_executions_after_warmup"] == 4 * (unfused - 3), loop
        assert fused_run["grad_pending_after_backward"] is False, loop
        # Same programs, same numbers.
        assert fused_run["losses"] == unfused_run["losses"], loop
    assert results["set_to_none=False, compiled optimizer"]["unfused"]["grad_pending_after_backward"] is True


def test_check_fails_where_a_file_ran_no_test():
    """An import error in every mode adds no failure against upstream; --check must still fail."""
    broken = suite.FileResult(outcomes={"test_bridge.py (import)": "error"}, tail="ModuleNotFoundError: xmlrunner")
    passing = suite.FileResult(outcomes={"__main__.T.test_a": "ok"})
    unexpected, _ = suite.unexpected_failures({"upstream": {"test_bridge.py": broken},
                                               "patched": {"test_bridge.py": broken}})
    assert len(unexpected) == 2 and all("no test ran" in u and "xmlrunner" in u for u in unexpected), unexpected
    assert suite.unexpected_failures({"upstream": {"test_bridge.py": passing},
                                      "patched": {"test_bridge.py": passing}}) == ([], [])
    # The same where pytest cannot collect the file (its run records the collection error).
    key = "test_dynamo.py" + suite.PYTEST_SUFFIX
    uncollected = suite.FileResult(outcomes={"test/dynamo/test_dynamo.py (collection)": "error"}, tail="test_utils")
    unexpected, _ = suite.unexpected_failures({"upstream": {key: uncollected}, "patched": {key: uncollected}})
    assert len(unexpected) == 2 and all("no test ran" in u for u in unexpected), unexpected


# Upstream test files small enough for the suite (about 15 s each per mode on a 2-core
# machine), that exercise the bridge with forward, backward and inference graphs.
SUBSET = ("test_dynamo_aliasing.py", "test_dynamo_integrations_util.py", "test_bridge.py")


def test_upstream_suite_subset_in_every_mode(tmp_path):
    """pytorch/xla's own tests: the patch and our backends add no failure upstream lacks, except those listed.

    The whole suite (all 11 files, about 45 minutes on 2 cores) runs with
    ``python upstream/run_upstream_suite.py --check``; this runs a subset.
    """
    checkout = _checkout_or_skip()
    pytest.importorskip("expecttest", reason="test_bridge.py needs expecttest (the [test] extra)")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(UPSTREAM / "run_upstream_suite.py"), "--checkout", str(checkout),
         *([] if (checkout / suite.TEST_DIR).is_dir() else ["--ref", "v2.9.0"]),
         "--files", ",".join(SUBSET), "--json", str(out), "--check", "--timeout", str(HANG_TIMEOUT_S)],
        # CI set as CI machines set it: torch's run_tests() then wants xmlrunner, and every
        # file failed at import in every mode alike, which --check did not see.
        capture_output=True, text=True, timeout=HANG_TIMEOUT_S * len(SUBSET) * len(suite.MODES), env=dict(os.environ, CI="true"),
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == set(suite.MODES)
    for mode, per_file in results.items():
        assert set(per_file) == set(SUBSET), mode
        for f, r in per_file.items():
            assert sum(o == "ok" for o in r["outcomes"].values()) > 0, (mode, f)
            assert r["crashes"] == [], (mode, f)
            installed = str(pathlib.Path(importlib.util.find_spec("torch_xla").origin))
            want = "patched/torch_xla/__init__.py" if mode == "patched" else installed
            assert r["imported"]["torch_xla"].endswith(want), (mode, r["imported"])
            if mode in suite.BACKEND_MODES:
                assert r["imported"]["torch_xla_bridge"] == str(ROOT / "torch_xla_bridge" / "__init__.py")


def test_a_file_run_by_pytest_resumes_after_a_crash_and_names_order_dependent_failures(tmp_path):
    """The runner's pytest mode on a file of its own: one process in definition order, a crash costs
    only the test in flight, and a test that fails there but passes in the file's own run is
    reported (an earlier test left the process unusable), unless upstream fails it that way too."""
    tests = tmp_path / suite.TEST_DIR
    tests.mkdir(parents=True)
    (tests / "test_order.py").write_text(textwrap.dedent("""
        import os, unittest
        STATE = []

        class TB(unittest.TestCase):
            def test_b_poisons(self):
                STATE.append("poison")

        class TA(unittest.TestCase):
            def test_a_needs_clean_state(self):
                self.assertEqual(STATE, [])

        class TC(unittest.TestCase):
            def test_c_crashes(self):
                os.abort()

            def test_d_after_the_crash(self):
                pass

        if __name__ == "__main__":
            unittest.main()
    """))
    own = suite.run_file(tmp_path, "test_order.py", {}, timeout=HANG_TIMEOUT_S)
    by_pytest = suite.run_file(tmp_path, "test_order.py", {}, timeout=HANG_TIMEOUT_S, runner="pytest")
    # `python FILE` takes the classes alphabetically (TA before TB): test_a passes there; pytest
    # takes them in definition order, TB first.
    assert own.outcomes["__main__.TA.test_a_needs_clean_state"] == "ok"
    assert {t.split("::")[-1]: o for t, o in by_pytest.outcomes.items()} == {
        "test_b_poisons": "ok", "test_a_needs_clean_state": "failure", "test_c_crashes": "crashed",
        "test_d_after_the_crash": "ok",
    }
    assert by_pytest.attempts == 2 and len(by_pytest.crashes) == 1
    per_file = {"test_order.py": own, "test_order.py" + suite.PYTEST_SUFFIX: by_pytest}
    poisoned = suite.order_dependent(per_file, "test_order.py" + suite.PYTEST_SUFFIX)
    assert [t.split("::")[-1] for t in poisoned] == ["test_a_needs_clean_state"]
    # Against an upstream whose own run of the file failed alike (the crash), only the order dependence is new.
    unexpected, _ = suite.unexpected_failures({"upstream": {"test_order.py": own}, suite.BACKEND_MODES[0]: per_file})
    assert len(unexpected) == 1 and "test_a_needs_clean_state" in unexpected[0] and "pytest's order" in unexpected[0]
    # The same order dependence under upstream is upstream's, not the backend's.
    assert suite.unexpected_failures({"upstream": per_file, suite.BACKEND_MODES[0]: per_file}) == ([], [])
