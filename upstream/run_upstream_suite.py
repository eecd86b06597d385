"""Runs pytorch/xla's own ``test/dynamo`` suite against the patch and against this project's backends.

Given a pytorch/xla checkout (a work tree, or a git directory and a ref), the
script exports ``test/dynamo/`` and the helpers those tests import
(:data:`EXPORTED`), and runs every test file, each in a subprocess of its own,
in these modes:

``upstream``
    the installed torch_xla, unpatched, tests unchanged (the baseline);
``patched``
    a copy of the installed torch_xla with the patch series in ``upstream/``
    applied, and the exported tests with the same series applied (the series
    updates the upstream tests whose counts it improves);
``openxla_fused_grad`` / ``openxla_fused_step``
    the installed torch_xla, unpatched, with this project's backend name
    swapped in for every ``'openxla'`` string in the tests, this project's
    package first on the path. The tests get the series' edits to upstream's
    tests (the execution counts of a fused backward, which
    ``openxla_fused_grad`` is) unless ``--backend-tests upstream``.

A file that crashes (a segfault) or hangs loses only the test in flight: the
file is rerun without the tests that already have an outcome. The report
lists per file and mode the tests passed and failed, and the failures that
are new against ``upstream``.

The files of :data:`PYTEST_FILES` also run as ``python -m pytest FILE``, one
process in pytest's order (test classes in definition order, where ``python
FILE`` takes them alphabetically), as their users run them: a test that fails there but passes
in the file's own run failed because of what an earlier test left behind (an
exception inside a step). ``--check`` fails on such a test in a backend mode
unless it fails that way under ``upstream`` too.

    python upstream/run_upstream_suite.py --checkout /path/to/xla                # a work tree
    python upstream/run_upstream_suite.py --checkout /path/to/xla.git --ref v2.9.0
    python upstream/run_upstream_suite.py ... --modes upstream,patched --files test_dynamo.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = ROOT / "upstream"
MODES = ("upstream", "patched", "openxla_fused_grad", "openxla_fused_step")
BACKEND_MODES = ("openxla_fused_grad", "openxla_fused_step")
# What test/dynamo's files import from outside their folder: test_dynamo.py
# puts test/ on sys.path for test_utils, test_dynamo_dynamic_shape.py puts
# examples/ there for decoder_only_model.
EXPORTED = ("test/dynamo", "test/test_utils.py", "examples/decoder_only_model.py")
TEST_DIR = "test/dynamo"
# Per-file environment, as upstream's test/run_tests.sh runs them
# (run_save_tensor_ir for the graph dump test); "{tree}" is the mode's tree.
FILE_ENV = {
    "test_dynamo_graph_dump.py": {"XLA_SAVE_TENSORS_FILE": "{tree}/xla_test_save_ir.txt", "XLA_SAVE_TENSORS_FMT": "text"},
}
# Files also run as one pytest process (see the module docstring), reported as "FILE (pytest)".
PYTEST_FILES = ("test_dynamo.py",)
PYTEST_SUFFIX = " (pytest)"
# Outcomes that count as a failure.
FAILED = ("failure", "error", "unexpected_success", "crashed", "timeout")

# Runs one test file as `python <file> -v` would (sys.argv[0] and sys.path[0]
# are the file's), recording every test's outcome as a JSON line, flushed at
# once, so that a crash loses only the test in flight. Tests named in
# RUS_SKIP (already run by an earlier attempt) are not run again.
_RECORDER = textwrap.dedent(
    """
    import json, os, re, runpy, sys, traceback, unittest

    _out = open(os.environ["RUS_RECORD"], "a", buffering=1)
    _skip = set(json.loads(os.environ.get("RUS_SKIP", "[]")))

    def _write(**kw):
        _out.write(json.dumps(kw) + "\\n")

    def _id(test):
        # Parameterized ids name functions by address, which differs per process.
        return re.sub(r" at 0x[0-9a-f]+>", ">", test.id())

    def _hook(name, outcome):
        orig = getattr(unittest.TestResult, name)

        def hooked(self, test, *args):
            if name == "addSubTest":
                if args[1] is not None:
                    _write(test=_id(test), outcome="failure", detail=str(args[0]))
            elif _id(test) not in _skip:
                detail = {}
                if name in ("addFailure", "addError"):
                    # The exception's last line: enough to tell failures apart in the report.
                    detail = {"detail": "".join(traceback.format_exception_only(*args[0][:2])).strip()[:300]}
                _write(test=_id(test), outcome=outcome, **detail)
            return orig(self, test, *args)

        setattr(unittest.TestResult, name, hooked)

    for _name, _outcome in [("startTest", "started"), ("addSuccess", "ok"), ("addFailure", "failure"),
                            ("addError", "error"), ("addSkip", "skipped"),
                            ("addExpectedFailure", "expected_failure"),
                            ("addUnexpectedSuccess", "unexpected_success"), ("addSubTest", None)]:
        _hook(_name, _outcome)

    _run = unittest.TestCase.run

    def _run_unless_done(self, result=None):
        if _id(self) in _skip:
            return result
        return _run(self, result)

    unittest.TestCase.run = _run_unless_done

    import torch_xla
    _write(torch_xla=torch_xla.__file__)
    if os.environ.get("RUS_BACKEND"):
        import torch_xla_bridge
        _write(torch_xla_bridge=torch_xla_bridge.__file__)
    path = os.path.abspath(sys.argv[1])
    sys.argv = [path] + sys.argv[2:]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
    """
)


# A pytest plugin recording what _RECORDER records (pytest's node ids), for a pytest run.
_PYTEST_PLUGIN = textwrap.dedent(
    """
    import json, os

    _out = open(os.environ["RUS_RECORD"], "a", buffering=1)

    def _write(**kw):
        _out.write(json.dumps(kw) + "\\n")

    def pytest_sessionstart(session):
        import torch_xla
        _write(torch_xla=torch_xla.__file__)
        if os.environ.get("RUS_BACKEND"):
            import torch_xla_bridge
            _write(torch_xla_bridge=torch_xla_bridge.__file__)

    def pytest_collectreport(report):
        if report.failed:
            _write(test=f"{report.nodeid} (collection)", outcome="error",
                   detail=str(report.longrepr).strip().splitlines()[-1][:300])

    def pytest_runtest_logstart(nodeid, location):
        _write(test=nodeid, outcome="started")

    def pytest_runtest_logreport(report):
        # One outcome per test: a failed or skipped phase, else the call's success.
        if report.failed:
            outcome = "error" if report.when != "call" else "failure"
            _write(test=report.nodeid, outcome=outcome, detail=str(report.longrepr).strip().splitlines()[-1][:300])
        elif report.skipped:
            _write(test=report.nodeid, outcome="skipped")
        elif report.when == "call":
            _write(test=report.nodeid, outcome="ok")
    """
)


def unittest_id(pytest_id: str) -> str:
    """A pytest node id of a test file (``FILE::Class::test_x``) as _RECORDER's id without its
    parameters (``__main__.Class.test_x``), to compare a test's outcomes under both runners."""
    return "__main__." + ".".join(pytest_id.split("::")[1:])


def _bare(test_id: str) -> str:
    """A unittest id without a parameterized test's parameters."""
    return re.sub(r" \(.*\)$", "", test_id)


# Where a pytorch/xla checkout is looked for when none is given: the
# environment variable (a work tree, or a git directory), then this machine's
# mirror of the repository.
CHECKOUT_ENV = "PYTORCH_XLA_CHECKOUT"
DEFAULT_CHECKOUTS = (pathlib.Path("/work/.mirror/pytorch+xla/repo"),)


def find_checkout() -> Optional[pathlib.Path]:
    """A pytorch/xla work tree or git directory at hand, if any."""
    for path in ([pathlib.Path(os.environ[CHECKOUT_ENV])] if os.environ.get(CHECKOUT_ENV) else []) + list(
        DEFAULT_CHECKOUTS
    ):
        if (path / TEST_DIR).is_dir() or (path / "HEAD").is_file() or (path / ".git").exists():
            return path
    return None


def git_dir(checkout: pathlib.Path) -> Optional[pathlib.Path]:
    """The git directory of a checkout (itself if bare), if it has one."""
    if (checkout / ".git").exists():
        return checkout / ".git"
    return checkout if (checkout / "HEAD").is_file() else None


def _load_make_patch():
    spec = importlib.util.spec_from_file_location("make_patch", HERE / "make_patch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_patch", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return sys.modules["make_patch"]


def patch_files() -> list[pathlib.Path]:
    """The patch series, in the order it applies."""
    return [HERE / name for name in _load_make_patch().PATCH_NAMES]


def export_tests(checkout: pathlib.Path, ref: Optional[str], dest: pathlib.Path) -> None:
    """Copies :data:`EXPORTED` from a work tree, or from ``ref`` of a git directory, into ``dest``."""
    if (checkout / TEST_DIR).is_dir():
        if ref is not None:
            raise SystemExit(f"{checkout} is a work tree; --ref applies to a git directory only")
        for rel in EXPORTED:
            src, out = checkout / rel, dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, out)
        return
    archive = subprocess.run(
        ["git", "--git-dir", str(checkout), "archive", ref or "HEAD", *EXPORTED],
        capture_output=True, check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def apply_series(root: pathlib.Path, *, check_only: bool = False, include: str = "") -> subprocess.CompletedProcess:
    """``git apply`` of the series to ``root`` (a tree that need not be a git repository).

    ``include``: a pathspec glob limiting which files are patched (e.g. ``test/*``).
    """
    args = ["git", "apply", "--verbose"] + (["--check"] if check_only else [])
    if include:
        args.append(f"--include={include}")
    proc = None
    for patch in patch_files():
        proc = subprocess.run(args + [str(patch)], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            return proc
    return proc


def swap_backend(test_dir: pathlib.Path, backend: str) -> int:
    """Replaces every ``'openxla'`` / ``"openxla"`` string literal in the tests; returns how many."""
    total = 0
    for f in sorted(test_dir.glob("*.py")):
        text, n = re.subn(r"""(['"])openxla\1""", lambda m: f"{m[1]}{backend}{m[1]}", f.read_text())
        if n:
            f.write_text(text)
            total += n
    return total


def prepare(
    mode: str, checkout: pathlib.Path, ref: Optional[str], work: pathlib.Path, backend_tests: str = "patched"
) -> tuple[pathlib.Path, dict]:
    """The tree a mode runs in and the environment additions it needs.

    ``backend_tests``: for the backend modes, ``patched`` runs the tests with the
    series' edits to them, ``upstream`` runs them as the checkout has them.
    """
    tree = work / mode
    tree.mkdir(parents=True)
    export_tests(checkout, ref, tree)
    env: dict[str, str] = {}
    if mode == "patched":
        installed = pathlib.Path(importlib.util.find_spec("torch_xla").origin).parent
        shutil.copytree(installed, tree / "torch_xla", ignore=shutil.ignore_patterns("__pycache__"))
        proc = apply_series(tree)
        if proc.returncode != 0:
            raise SystemExit(f"the patch series does not apply:\n{proc.stdout}{proc.stderr}")
        env["PYTHONPATH"] = str(tree)
    elif mode in BACKEND_MODES:
        if backend_tests == "patched":
            # The series' edits to upstream's tests (the counts of a fused backward,
            # which openxla_fused_grad is); not its new test file, which needs the
            # patched torch_xla.
            for rel in _load_make_patch().VENDORED_BLOBS:
                if rel.startswith("test/"):
                    proc = apply_series(tree, include=rel)
                    if proc.returncode != 0:
                        raise SystemExit(f"the series' test edits do not apply:\n{proc.stdout}{proc.stderr}")
        if swap_backend(tree / TEST_DIR, mode) == 0:
            raise SystemExit("no 'openxla' string found in the tests to swap")
        env["PYTHONPATH"] = str(ROOT)
        env["RUS_BACKEND"] = mode
    return tree, env


@dataclasses.dataclass
class FileResult:
    """Outcome per test id of one test file in one mode."""

    outcomes: dict[str, str] = dataclasses.field(default_factory=dict)
    details: dict[str, str] = dataclasses.field(default_factory=dict)
    crashes: list[str] = dataclasses.field(default_factory=list)
    attempts: int = 0
    seconds: float = 0.0
    imported: dict[str, str] = dataclasses.field(default_factory=dict)
    tail: str = ""

    def count(self, *outcomes: str) -> int:
        return sum(o in outcomes for o in self.outcomes.values())

    @property
    def failed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in FAILED}


def _command(tree: pathlib.Path, test_file: str, runner: str, patterns: Sequence[str], done: Sequence[str]) -> list[str]:
    """How ``runner`` runs one file: as ``python FILE -v`` (through _RECORDER, which skips the tests in
    ``done``) or as ``python -m pytest FILE`` (with _PYTEST_PLUGIN, ``done`` deselected)."""
    path = str(tree / TEST_DIR / test_file)
    if runner == "unittest":
        return [sys.executable, str(tree / "_recorder.py"), path, "-v"] + [a for p in patterns for a in ("-k", p)]
    return ([sys.executable, "-m", "pytest", path, "-q", "-p", "_rus_pytest_plugin", "-p", "no:cacheprovider"]
            + (["-k", " or ".join(f"({p})" for p in patterns)] if patterns else [])
            + [a for t in done for a in ("--deselect", t)])


def run_file(
    tree: pathlib.Path, test_file: str, env_extra: dict, timeout: float, patterns: Sequence[str] = (),
    max_attempts: int = 20, runner: str = "unittest",
) -> FileResult:
    """Runs one file until every test has an outcome; a test in flight at a crash or timeout gets one.

    ``runner``: ``unittest`` (``python FILE``) or ``pytest`` (``python -m pytest FILE``, ids are pytest's).
    """
    result = FileResult()
    (tree / "_recorder.py").write_text(_RECORDER)
    (tree / "_rus_pytest_plugin.py").write_text(_PYTEST_PLUGIN)
    record = tree / f"_record_{runner}_{test_file}.jsonl"
    # CI: torch's run_tests() takes any non-empty CI as pytorch's own CI and then reports through
    # xmlrunner (a pytorch CI dependency): without it every file fails at import, in every mode alike.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_DYNAMO_FUSED_GRAD", "CI")}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", **env_extra)
    if runner == "pytest":
        # The plugin, importable by name, and test/'s helpers (test_utils), which `python FILE` finds
        # through the file's own sys.path edit (relative to sys.argv[0], pytest's under pytest).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(tree), str(tree / "test")) if p)
    env.update({k: v.format(tree=tree) for k, v in FILE_ENV.get(test_file, {}).items()})
    start = time.monotonic()
    while result.attempts < max_attempts:
        result.attempts += 1
        record.write_text("")
        env["RUS_RECORD"] = str(record)
        env["RUS_SKIP"] = json.dumps(sorted(result.outcomes))
        try:
            proc = subprocess.run(
                _command(tree, test_file, runner, patterns, sorted(result.outcomes)),
                cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
            )
            ended, rc, tail = "crashed", proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as e:
            ended, rc = "timeout", None
            tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-4000:]
        in_flight: Optional[str] = None
        for line in record.read_text().splitlines():
            entry = json.loads(line)
            if "test" in entry:
                entry["test"] = normalize(entry["test"])
            if "test" not in entry:
                result.imported.update(entry)
            elif entry["outcome"] == "started":
                in_flight = entry["test"]
            else:
                # A failed subtest must not be overwritten by the test's own success.
                if result.outcomes.get(entry["test"]) not in FAILED:
                    result.outcomes[entry["test"]] = entry["outcome"]
                if "detail" in entry:
                    result.details[entry["test"]] = entry["detail"]
                if entry["test"] == in_flight:
                    in_flight = None
        result.tail = tail
        if in_flight is None:
            if rc is not None and rc > 0 and not result.outcomes:
                result.outcomes[f"{test_file} (import)"] = "error"  # no test ran: import or collection failed
            elif rc is None or rc < 0:
                # Died outside any test (setUpClass, teardown, exit): nothing to resume.
                result.outcomes[f"{test_file} (outside a test)"] = ended
                result.crashes.append(f"{ended} outside a test (rc {rc})")
            break  # the file ran to its end (rc 1 when a test failed)
        result.outcomes[in_flight] = ended
        result.crashes.append(in_flight)
    result.seconds = time.monotonic() - start
    return result


# Failures a backend mode may add against ``upstream``, each with the reason
# (docs/upstream.md lists them): tests of upstream-internal bridge metrics, and
# execution counts the backend lowers on purpose. Keys: (mode, file, test id).
_STEP = "openxla_fused_step"
_DYN = "test_dynamo_dynamic_shape.py"
_BRIDGE_METRIC = "asserts an upstream-internal bridge metric ({}), which only upstream's bridge records"
EXPECTED_NEW_FAILURES: dict[tuple[str, str, str], str] = {
    **{
        (_STEP, _DYN, f"__main__.DynamoDynamicShapeBasicTest.{name}"): _BRIDGE_METRIC.format("DynamoExtractCompiledGraph")
        for name in (
            "test_dynamic_decoder", "test_dynamic_shape_basic", "test_dynamic_shape_basic_with_mark_dynamic",
            "test_dynamic_shape_decoder_mark_dynamic", "test_dynamic_shape_mix_with_non_dynamic",
            "test_dynamic_shape_multiple_batchs",
        )
    },
    (_STEP, "test_dynamo.py", "__main__.DynamoInferenceBasicTest.test_resnet180 ('openxla_fused_step')"):
        _BRIDGE_METRIC.format("RunCachedGraphInputData"),
    (_STEP, "test_dynamo.py", "__main__.DynamoTrainingOptimizerTest.test_resnet18"):
        _BRIDGE_METRIC.format("RunCachedGraphInputData"),
    (_STEP, "test_dynamo.py", "__main__.DynamoTrainingBasicTest.test_resnet18"):
        "asserts that data.grad is device data right after loss.backward(); the fused step leaves the whole step, "
        "accumulation included, pending until it is cut (no optimizer and no torch_xla.sync() in this loop), on purpose "
        "(with the tests unchanged: RunCachedGraphInputData, an upstream-internal bridge metric)",
    (_STEP, "test_dynamo.py", "__main__.DynamoInferenceBasicTest.test_simple_model"):
        _BRIDGE_METRIC.format("DynamoSyncInputExecuteTime") + "; the fused step executes an inference graph's "
        "pending inputs in the graph's own execution, one where upstream runs two, and leaves them materialized "
        "as upstream does",
    (_STEP, "test_dynamo_config.py", "__main__.DynamoconfigTest.test_config_skip_input_data_check"):
        "asserts the effect of config.skip_input_data_check, a switch of upstream's bridge, which the fused step does not use",
    (_STEP, "test_dynamo_graph_dump.py", "__main__.DynamoGraphDumpTest.test_dump_graph_with_dynamo_execution"):
        "asserts the position of 'Graph Hash:' in the XLA_SAVE_TENSORS_FILE dump that upstream's bridge writes for "
        "its cached graph; the fused step runs as a torch_xla.sync(), whose dump is laid out differently",
}
# Failures of defects not fixed yet (keys as above), allowed by --check; --check reports
# those that pass, so that they are removed.
KNOWN_DEFECTS: dict[tuple[str, str, str], str] = {
    # None at present: a defect found is listed here, with its cause, until fixed.
}


def unexpected_failures(results: dict[str, dict[str, "FileResult"]]) -> tuple[list[str], list[str]]:
    """New failures against ``upstream`` that no list above allows, files where no test ran, and listed ones that passed."""
    base = results.get("upstream", {})
    unexpected, fixed = [], []
    for mode, per_file in results.items():
        for f, r in per_file.items():
            # A file that ran no test compares nothing: an import error fails every mode alike.
            if f"{f} (import)" in r.outcomes or any(t.endswith(" (collection)") for t in r.outcomes):
                unexpected.append(f"{mode}: {f}: no test ran; the last run ended with:\n{r.tail[-1500:]}")
        if mode == "upstream":
            continue
        for f, r in per_file.items():
            if f.endswith(PYTEST_SUFFIX):
                upstream_too = order_dependent(base, f) if f in base else set()
                unexpected += [
                    f"{mode}: {f} {t}: fails in pytest's order, passes in the file's own run (an earlier test "
                    f"left the process unusable)" for t in sorted(order_dependent(per_file, f) - upstream_too)
                ]
                continue
            allowed = {**EXPECTED_NEW_FAILURES, **KNOWN_DEFECTS}
            for t in sorted(r.failed - (base[f].failed if f in base else set())):
                if (mode, f, t) not in allowed:
                    unexpected.append(f"{mode}: {f} {short(t)}: {r.outcomes[t]}")
            for (m, lf, t) in allowed:
                if m == mode and lf == f and r.outcomes.get(t) == "ok":
                    fixed.append(f"{mode}: {f} {short(t)} passes: remove it from the list")
    return unexpected, fixed


def order_dependent(per_file: dict[str, "FileResult"], pytest_key: str) -> set[str]:
    """Tests of a file that failed in its pytest run (``pytest_key``) but passed in its own run."""
    own = per_file.get(pytest_key.removesuffix(PYTEST_SUFFIX))
    if own is None:
        return set()
    passed = {_bare(t) for t, o in own.outcomes.items() if o == "ok"}
    failed = {_bare(t) for t in own.failed}
    # A parameterized test passes in its own run only if every one of its cases does.
    return {t for t in per_file[pytest_key].failed if unittest_id(t) in passed - failed}


def normalize(test_id: str) -> str:
    """A test id that is the same in every run: parameterized ids name functions by address."""
    return re.sub(r" at 0x[0-9a-f]+>", ">", test_id)


def short(test_id: str) -> str:
    return test_id.removeprefix("__main__.")


def report(results: dict[str, dict[str, FileResult]], modes: list[str]) -> str:
    """A markdown table: per file and mode, passed / failed, and the failures new against ``upstream``."""
    files = sorted({f for per_mode in results.values() for f in per_mode})
    head = "| file | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes) + "\n"
    rows, notes = [], []
    for f in files:
        cells = []
        base = results.get("upstream", {}).get(f)
        for mode in modes:
            r = results.get(mode, {}).get(f)
            if r is None:
                cells.append("")
                continue
            cell = f"{r.count('ok')} / {len(r.failed)}"
            if mode != "upstream" and base is not None:
                new = sorted(r.failed - base.failed)
                cell += f" (+{len(new)})"
                notes += [f"- {mode}: `{f}` {short(t)}: {r.outcomes[t]}" for t in new]
            if f.endswith(PYTEST_SUFFIX):
                cell += f" order {len(order_dependent(results[mode], f))}"
            if r.crashes:
                cell += " crash"
            cells.append(cell)
        rows.append(f"| {f} | " + " | ".join(cells) + " |\n")
    legend = (
        "\nCells: passed / failed (+ failures new against upstream); 'crash': a subprocess died and the file was "
        f"resumed; 'order N' (rows{PYTEST_SUFFIX}): N tests failed in pytest's order that passed in the file's own run.\n"
    )
    return head + "".join(rows) + legend + ("\nNew failures:\n" + "\n".join(notes) + "\n" if notes else "")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=pathlib.Path, default=find_checkout(),
                    help=f"a pytorch/xla work tree, or a (bare) git directory with --ref "
                    f"(default: ${CHECKOUT_ENV}, else {DEFAULT_CHECKOUTS[0]})")
    ap.add_argument("--ref", help="the ref to export from a git directory (default HEAD)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--files", default="", help="comma-separated test file names (default: every test_*.py)")
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run only tests matching this unittest -k pattern (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per file attempt")
    ap.add_argument("--json", type=pathlib.Path, help="write every test's outcome here")
    ap.add_argument("--backend-tests", choices=("patched", "upstream"), default="patched",
                    help="backend modes: run the tests with the series' edits to them (the fused counts), "
                    "or unchanged")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a failure new against upstream that EXPECTED_NEW_FAILURES / KNOWN_DEFECTS do not list")
    ap.add_argument("--no-pytest", action="store_true",
                    help=f"do not also run {', '.join(PYTEST_FILES)} as one pytest process")
    ap.add_argument("--keep", type=pathlib.Path, help="build the trees here and keep them")
    args = ap.parse_args(argv)
    if args.checkout is None:
        ap.error(f"no pytorch/xla checkout found: pass --checkout or set {CHECKOUT_ENV}")
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes: {sorted(unknown)}")
    work = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="upstream_suite_"))
    results: dict[str, dict[str, FileResult]] = {}
    try:
        for mode in modes:
            tree, env = prepare(mode, args.checkout, args.ref, work, args.backend_tests)
            names = args.files.split(",") if args.files else sorted(
                p.name for p in (tree / TEST_DIR).glob("test_*.py")
            )
            runs = [(name, "unittest") for name in names] + [
                (name, "pytest") for name in names if name in PYTEST_FILES and not args.no_pytest]
            for name, runner in runs:
                r = run_file(tree, name, env, args.timeout, args.patterns, runner=runner)
                key = name + (PYTEST_SUFFIX if runner == "pytest" else "")
                results.setdefault(mode, {})[key] = r
                print(f"{mode:20} {key:34} passed {r.count('ok'):3} failed {len(r.failed):3} "
                      f"skipped {r.count('skipped'):3} {r.seconds:6.0f}s"
                      + (f" crashes: {', '.join(map(short, r.crashes))}" if r.crashes else ""), flush=True)
                if not r.outcomes:
                    print(r.tail, file=sys.stderr)
    finally:
        if args.json:
            args.json.write_text(json.dumps(
                {m: {f: dataclasses.asdict(r) for f, r in per.items()} for m, per in results.items()},
                indent=1, sort_keys=True,
            ))
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(report(results, modes))
    if args.check:
        if "upstream" not in modes:
            ap.error("--check compares against the upstream mode: include it in --modes")
        unexpected, fixed = unexpected_failures(results)
        for line in fixed:
            print("listed, but passed:", line)
        for line in unexpected:
            print("UNEXPECTED:", line)
        return 1 if unexpected else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
