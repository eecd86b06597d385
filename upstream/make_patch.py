"""Generates the pytorch/xla patch series from this project's modules and pytorch/xla 2.9.0's own files.

One implementation, two packagings: the series' new modules
``torch_xla/_dynamo/grad_sync.py`` and ``torch_xla/_dynamo/deferred_backward.py``
are ``torch_xla_bridge/grad_sync.py`` and ``torch_xla_bridge/dynamo_bridge.py``
with the few edits listed in :data:`EDITS` (names, imports, the unfused
fallback), each of which must match exactly once, then formatted with yapf
and upstream's ``.style.yapf`` (upstream's linter). The hunks in upstream's
files are the glue in :data:`BRIDGE_EDITS` and :data:`CONFIG_EDITS` (patch 1:
the mechanism, off by default) and :data:`CONFIG_DEFAULT_ON_EDITS` and
:data:`TEST_DYNAMO_EDITS` (patch 2: on by default, upstream's tests get the
lower counts); the upstream-style test is copied verbatim. Pristine upstream
files are read from the installed ``torch_xla==2.9.0`` wheel after checking
them against the wheel's RECORD hashes (the wheel ships the repository's
Python files unchanged), or, for files the wheel lacks, from ``vendor/``
after checking their git blob ids. The series applies to a v2.9.0 checkout
and to the newest master with ``git am`` or ``git apply``.

    python upstream/make_patch.py            # rewrites upstream/<NNNN-*.patch>
    python upstream/make_patch.py --check    # exit 1 if a committed patch is stale
"""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import difflib
import hashlib
import importlib.metadata
import pathlib
import re
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = ROOT / "upstream"
PACKAGE = ROOT / "torch_xla_bridge"
UPSTREAM_VERSION = "2.9.0"

# (old, new): plain substitutions, each required to match exactly once.
Edits = list[tuple[str, str]]

_DEFERRED_DOC = '''"""Runs AOTAutograd backward graphs as one pending XLA node, fused with ``.grad`` accumulation.

With ``openxla`` the backward graph used to run as its own cached program,
after which the autograd engine's AccumulateGrad nodes added each gradient into
``.grad`` lazily, outside any program: ``.grad`` was left as pending IR, and the
next reader (``.grad.cpu()``, the optimizer, whose inputs the bridge syncs) paid
an execution for it; the loss seed of ``loss.backward()`` cost one more.

Here a backward graph is lowered once per input signature to one XLA
computation and embedded per call as a single lazy IR node
(``_xla_user_computation``), so its outputs are pending: the engine's
accumulation lands in the same pending graph, and the input it gets from
outside (the loss seed, upstream gradients) fuses in as well. One engine
callback per backward pass then syncs everything (see :mod:`grad_sync`).

Where that is impossible (double backward, random ops, CPU-fallback ops,
in-place input updates, torch_xla eager mode) a graph runs through the unfused
path instead, correctly, with one warning saying why. Set
``XLA_DYNAMO_FUSED_GRAD=0`` (or ``torch_xla._dynamo.config.fused_backward =
False``) to always take the unfused path.
"""'''

_BRIDGE_ENTRY = '''

def is_backward_graph(gm: torch.fx.GraphModule) -> bool:
    """True for an AOTAutograd backward graph: its inputs include tangents (torch's partitioner names them so)."""
    return any(str(n.target).startswith("tangents") for n in gm.graph.find_nodes(op="placeholder"))


def extract_deferred_backward(gm: torch.fx.GraphModule, xla_args: Sequence[Any]) -> Callable[..., Any]:
    """The dynamo bridge's compiled function for a backward graph; called with unpacked arguments.

    The signature cache looks at the graph's traced (possibly symbolic)
    input values, not at the first call's concrete ones, so a graph traced
    with dynamic shapes is lowered per concrete shape.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    example_inputs = [n.meta.get("val", a) for n, a in zip(placeholders, xla_args)]
    deferred = DeferredBackward(gm, example_inputs)

    def run(*args: Any) -> Any:
        return deferred(list(args))

    return run
'''

_UNFUSED_COMPILE = '''    from torch_xla._dynamo import dynamo_bridge

    compiled: Optional[Callable[..., Any]] = None

    def run(args: list) -> Any:
        nonlocal compiled
        if compiled is None:
            with eager_mode_context(False):
                compiled = dynamo_bridge.extract_compiled_graph_helper(gm, args)
        return compiled(*args)

    return run
'''



def _package_function(module: str, name: str) -> str:
    """The source of a top-level function of one of the package's modules, as written there."""
    text = (PACKAGE / module).read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node) + "\n"


# torch_xla_bridge/spmd.py's keep_param_shardings, inlined into grad_sync.py (read from
# the package, not copied): upstream needs the gradient-sharding fix, and not the
# package's input-sharding workaround (the patched bridge is where upstream would
# change its threshold).
_KEEP_PARAM_SHARDING = "\n\n" + _package_function("spmd.py", "keep_param_shardings").replace(
    "def keep_param_shardings(", "def _keep_param_shardings("
)

EDITS: dict[str, tuple[str, Edits]] = {
    "torch_xla/_dynamo/grad_sync.py": (
        "grad_sync.py",
        [
            (":mod:`torch_xla_bridge.dynamo_bridge`", ":mod:`torch_xla._dynamo.deferred_backward`"),
            ('SYNC_COUNTER = "OpenxlaFusedGradSync"', 'SYNC_COUNTER = "DynamoFusedGradSync"'),
            ("from . import spmd\n\n", ""),
            ("log = logging.getLogger(__name__)\n", "log = logging.getLogger(__name__)\n" + _KEEP_PARAM_SHARDING),
            ("spmd.keep_param_shardings(leaves)", "_keep_param_shardings(leaves)"),
            ("import torch_xla\n", "import torch_xla\nimport torch_xla.runtime as xr\n"),
        ],
    ),
    "torch_xla/_dynamo/deferred_backward.py": (
        "dynamo_bridge.py",
        [
            ("from . import grad_sync, spmd\n", "from . import grad_sync\n"),
            ("from .backend import BACKEND_NAME\n", ""),
            (
                '_USER_COMPUTATION_NAME = "xla::torch_xla_bridge_graph"',
                'BACKEND_NAME = "openxla"\n_USER_COMPUTATION_NAME = "xla::dynamo_fused_backward"',
            ),
            ("runs unfused through upstream openxla ", "runs unfused "),
            ('    """AOTAutograd backward compiler of ``openxla_fused_grad``."""',
             '    """An AOTAutograd backward compiler: ``aot_autograd(fw_compiler=..., bw_compiler=this)``."""'),
            ('VALIDATION_COUNTER = "OpenxlaFusedValidationCompile"', 'VALIDATION_COUNTER = "DynamoDeferredValidationCompile"'),
            ("    return _inputs_synced_first(spmd.compile_upstream(gm, example_inputs))\n", _UNFUSED_COMPILE),
        ],
    ),
}

# Functions of the package that upstream does not need (the bridge itself
# warns about CPU inputs), removed from the generated module.
# The package's non-donating input sync in front of upstream's bridge is dropped too:
# upstream's deferred backward hands unfused graphs to the bridge itself.
DROPPED_FUNCTIONS = {"torch_xla/_dynamo/deferred_backward.py": ["on_xla", "check_inputs_on_xla", "_inputs_synced_first"]}

BRIDGE_EDITS: Edits = [
    (
        """  torch_xla._XLAC._xla_increment_counter('DynamoExtractCompiledGraph', 1)

  with torch_xla.experimental.eager_mode_context(False):
""",
        """  torch_xla._XLAC._xla_increment_counter('DynamoExtractCompiledGraph', 1)

  if config.fused_backward:
    from torch_xla._dynamo import deferred_backward
    if deferred_backward.is_backward_graph(xla_model):
      # An AOTAutograd backward: run it as one pending node and sync it
      # together with the autograd engine's accumulation into .grad, so that
      # backward + accumulation are one execution and no .grad is left as
      # pending IR (see deferred_backward.py).
      return deferred_backward.extract_deferred_backward(xla_model, xla_args)

  with torch_xla.experimental.eager_mode_context(False):
""",
    ),
]

CONFIG_EDITS: Edits = [
    ("import torch_xla\n", "import os\n\nimport torch_xla\n"),
    (
        "skip_input_data_check = False",
        """skip_input_data_check = False

# Whether AOTAutograd backward graphs run fused with the accumulation of their
# gradients into `.grad`: one execution for backward + accumulation, no pending
# `.grad` after `loss.backward()`. XLA_DYNAMO_FUSED_GRAD=1 turns it on.
fused_backward = os.environ.get('XLA_DYNAMO_FUSED_GRAD', '0') == '1'
""",
    ),
]

# Patch 2 of the series: the default flips, on top of patch 1's config.py.
CONFIG_DEFAULT_ON_EDITS: Edits = [
    (
        """# `.grad` after `loss.backward()`. XLA_DYNAMO_FUSED_GRAD=1 turns it on.
fused_backward = os.environ.get('XLA_DYNAMO_FUSED_GRAD', '0') == '1'
""",
        """# `.grad` after `loss.backward()`. XLA_DYNAMO_FUSED_GRAD=0 turns it off.
fused_backward = os.environ.get('XLA_DYNAMO_FUSED_GRAD', '1') != '0'
""",
    ),
]

# Upstream's test_dynamo.py pins the unfused path's counts of its ResNet-18
# training tests; with the fused default they are lower, and its TODO about
# `data.grad` being pending IR is resolved (that IR was the engine's
# accumulation, which now runs inside the backward's execution).
TEST_DYNAMO_EDITS: Edits = [
    (
        """    dynamo_train_model = torch.compile(self.train_model, backend='openxla')
    for data, target in loader:
      xla_output = dynamo_train_model(xla_resnet18, data, target)
""",
        """    dynamo_train_model = torch.compile(self.train_model, backend='openxla')
    first_grad = None
    for step, (data, target) in enumerate(loader, 1):
      xla_output = dynamo_train_model(xla_resnet18, data, target)
""",
    ),
    (
        """      # TODO(JackCaoG): Understand why `data.grad` is a pending IR starting
      # from second iteration instead of a `DeviceData`
      # torch.allclose(data.grad.cpu(), cpu_data.grad)
    # Graph 1: forward
    # Graph 2: backward
    # Graph 3: sync input for backward
    self.assertLessEqual(met.metric_data('CompileTime')[0], 3)
    # We execute 3 graphs per step.
    self.assertLessEqual(met.metric_data('ExecuteTime')[0], sample_count * 3)
    # one for each forward and one for each backward
    self.assertLessEqual(
        met.metric_data('RunCachedGraphInputData')[0], sample_count * 2)
    self.assertLessEqual(
        met.metric_data('RunCachedGraphOutputData')[0], sample_count * 2)
""",
        """      # The backward runs fused with the engine's accumulation into
      # `data.grad` (config.fused_backward), so `data.grad` is device data
      # after every step, not pending IR. Every step computes the same
      # gradient, which `data.grad` accumulates.
      self.assertFalse(
          torch_xla._XLAC._check_tensor_need_materialization([data.grad])[0])
      if first_grad is None:
        first_grad = data.grad.cpu()
      self.assertTrue(torch.allclose(data.grad.cpu(), first_grad * step))
    # Graph 1: forward
    # Graph 2: backward + accumulation into `.grad` (first step, no `.grad`)
    # Graph 3: backward + accumulation into `.grad`
    self.assertLessEqual(met.metric_data('CompileTime')[0], 3)
    # We execute 2 graphs per step.
    self.assertLessEqual(met.metric_data('ExecuteTime')[0], sample_count * 2)
    # one for each forward; the backward is synced with the accumulation
    self.assertEqual(
        met.metric_data('RunCachedGraphInputData')[0], sample_count)
    self.assertEqual(
        met.metric_data('RunCachedGraphOutputData')[0], sample_count)
""",
    ),
    (
        """    # Graph 1: forward
    # Graph 2: backward
    # Graph 3: optimizer
    # Graph 4: sync input for backward
    # Graph 5: sync input for backward (TODO(JackCaoG) understand why there are two graphs)
    # Graph 6, 7: PyTorch has updated the number of captured by resnet
    # (https://github.com/pytorch/pytorch/pull/117434)
    self.assertLessEqual(met.metric_data('CompileTime')[0], 7)
    # We execute 4 graphs per step (+ 1 for SGD) when optimizer is enabled.
    self.assertLessEqual(
        met.metric_data('ExecuteTime')[0], sample_count * 4 + 1)
    # one for each forward, backward and optimizer
    self.assertEqual(
        met.metric_data('RunCachedGraphInputData')[0], sample_count * 3)
    self.assertEqual(
        met.metric_data('RunCachedGraphOutputData')[0], sample_count * 3)
""",
        """    # Graph 1: forward
    # Graph 2: backward + accumulation into `.grad`
    # Graph 3: optimizer
    # Graph 4, 5: PyTorch has updated the number of captured by resnet
    # (https://github.com/pytorch/pytorch/pull/117434)
    self.assertLessEqual(met.metric_data('CompileTime')[0], 5)
    # We execute 3 graphs per step (+ 1 for SGD) when optimizer is enabled.
    self.assertLessEqual(
        met.metric_data('ExecuteTime')[0], sample_count * 3 + 1)
    # one for each forward and optimizer; the backward is synced with the
    # accumulation into `.grad`
    self.assertEqual(
        met.metric_data('RunCachedGraphInputData')[0], sample_count * 2)
    self.assertEqual(
        met.metric_data('RunCachedGraphOutputData')[0], sample_count * 2)
""",
    ),
]

VENDOR = HERE / "vendor"
# Upstream files that the torch_xla wheel does not ship, vendored from the
# pytorch/xla repository at v2.9.0 (BSD-3-Clause, see pytorch/xla's LICENSE),
# with their git blob ids there (the same at the newest master when this was written).
VENDORED_BLOBS = {
    "test/dynamo/test_dynamo.py": "c106483e1a37245085a4df8a843c4022e5ddd20c",
    ".style.yapf": "73cb05e2eaa3fef32f6e3bf190c749672bae8943",
}
TEST_FILE = "test/dynamo/test_dynamo_fused_grad.py"


@dataclasses.dataclass(frozen=True)
class SeriesPatch:
    """One patch of the series: a commit message and the files it changes, on top of the previous patches."""

    name: str
    subject: str
    body: str
    # Path -> edits to the file as the previous patches left it.
    modified: dict[str, Edits]
    adds_new_files: bool = False


SERIES = [
    SeriesPatch(
        "0001-dynamo-fuse-backward-with-grad-accumulation.patch",
        "dynamo: fuse the backward with the accumulation of gradients into .grad",
        "An AOTAutograd backward graph compiled by the openxla backend runs as one\n"
        "pending node (torch_xla/_dynamo/deferred_backward.py), synced together with\n"
        "the autograd engine's accumulation into .grad by one engine callback per\n"
        "backward pass (torch_xla/_dynamo/grad_sync.py): one execution for backward\n"
        "and accumulation, no .grad left as pending IR, no sync of the backward's\n"
        "inputs. Off by default in this commit (torch_xla._dynamo.config.fused_backward,\n"
        "XLA_DYNAMO_FUSED_GRAD=1); test/dynamo/test_dynamo_fused_grad.py turns it on.\n",
        {"torch_xla/_dynamo/dynamo_bridge.py": BRIDGE_EDITS, "torch_xla/_dynamo/config.py": CONFIG_EDITS},
        adds_new_files=True,
    ),
    SeriesPatch(
        "0002-dynamo-fused-backward-on-by-default.patch",
        "dynamo: turn the fused backward on by default",
        "XLA_DYNAMO_FUSED_GRAD=0 turns it off. test_dynamo.py's ResNet-18 training\n"
        "tests get the fused counts: 2 executions per step without an optimizer (was\n"
        "3), 3 with one (was 4), the backward no longer runs through\n"
        "_run_cached_graph (RunCachedGraphInputData counts forward and optimizer\n"
        "only), and the TODO about data.grad being pending IR from the second step on\n"
        "is resolved: that IR was the engine's accumulation, which now runs inside the\n"
        "backward's execution, so data.grad is device data, checked after every step\n"
        "against the CPU model's accumulated gradient.\n",
        {"torch_xla/_dynamo/config.py": CONFIG_DEFAULT_ON_EDITS, "test/dynamo/test_dynamo.py": TEST_DYNAMO_EDITS},
    ),
]
PATCH_NAMES = [p.name for p in SERIES]
# Placeholder identity and a fixed date, so that the series is reproducible;
# whoever submits it re-authors the commits (git commit --amend --reset-author).
AUTHOR = "torch_xla_bridge <noreply@torch-xla-bridge.invalid>"
DATE = "Thu, 3 Dec 2026 00:00:00 +0000"


def apply_edits(text: str, edits: Edits, where: str) -> str:
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"{where}: expected exactly one {old!r}, found {n}; update make_patch.py")
        text = text.replace(old, new)
    return text


def drop_function(text: str, name: str, where: str) -> str:
    """Removes a top-level function and the blank lines after it."""
    pattern = re.compile(rf"^def {name}\(.*?(?=^\S)", re.S | re.M)
    text, n = pattern.subn("", text, count=1)
    if n != 1:
        raise ValueError(f"{where}: no top-level function {name!r}; update make_patch.py")
    return text


def replace_docstring(text: str, doc: str) -> str:
    assert text.startswith('"""'), "module must start with its docstring"
    end = text.index('"""', 3) + 3
    return doc + text[end:]


def pristine_upstream_file(rel: str) -> str:
    """An upstream v2.9.0 file: from the installed torch_xla wheel (checked against its RECORD), or vendored."""
    if rel in VENDORED_BLOBS:
        data = (VENDOR / rel).read_bytes()
        if git_blob_id(data) != VENDORED_BLOBS[rel]:
            raise RuntimeError(f"{VENDOR / rel} differs from pytorch/xla v{UPSTREAM_VERSION}'s {rel}")
        return data.decode()
    dist = importlib.metadata.distribution("torch_xla")
    if dist.version != UPSTREAM_VERSION:
        raise RuntimeError(f"torch_xla {dist.version} is installed; the patch targets {UPSTREAM_VERSION}")
    for f in dist.files or []:
        if str(f) == rel:
            data = f.locate().read_bytes()
            algo, _, want = (f.hash.mode, None, f.hash.value) if f.hash else (None, None, None)
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            if got != want:
                raise RuntimeError(f"{f.locate()} differs from the torch_xla {UPSTREAM_VERSION} wheel (RECORD hash)")
            return data.decode()
    raise FileNotFoundError(f"{rel} is not part of the installed torch_xla wheel")


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def yapf_format(text: str) -> str:
    """``text`` formatted as upstream's CI requires: yapf 0.40.2 with the repository's ``.style.yapf``."""
    try:
        from yapf.yapflib.yapf_api import FormatCode
    except ImportError as e:
        raise ImportError("make_patch needs yapf==0.40.2 (pip install -e '.[upstream]')") from e
    pristine_upstream_file(".style.yapf")  # checks the vendored copy
    return FormatCode(text, style_config=str(VENDOR / ".style.yapf"))[0]


def new_files() -> dict[str, str]:
    """Path in the pytorch/xla tree -> content of each file the patch creates, yapf-formatted."""
    out: dict[str, str] = {}
    for rel, (source, edits) in EDITS.items():
        text = (PACKAGE / source).read_text()
        for fn in DROPPED_FUNCTIONS.get(rel, []):
            text = drop_function(text, fn, rel)
        text = apply_edits(text, edits, rel)
        if rel.endswith("deferred_backward.py"):
            text = replace_docstring(text, _DEFERRED_DOC) + _BRIDGE_ENTRY
        out[rel] = yapf_format(text)
    out[TEST_FILE] = (HERE / pathlib.Path(TEST_FILE).name).read_text()
    return out


def _unified(rel: str, old: Optional[str], new: str) -> str:
    a = [] if old is None else old.splitlines(keepends=True)
    b = new.splitlines(keepends=True)
    header = [f"diff --git a/{rel} b/{rel}\n"]
    if old is None:
        header.append("new file mode 100644\n")
    lines = list(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{rel}", f"b/{rel}", n=3))
    body = []
    for line in lines:
        # Unified diff's marker for a last line without its newline.
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(header + body)


def series_files() -> list[dict[str, tuple[Optional[str], str]]]:
    """Per patch of :data:`SERIES`: path -> (content before, content after), in the order the diff lists them.

    Every Python file a patch leaves behind is checked to be yapf-clean, as upstream's linter requires.
    """
    current: dict[str, str] = {}
    out = []
    for patch in SERIES:
        changes: dict[str, tuple[Optional[str], str]] = {}
        for rel, edits in patch.modified.items():
            old = current.get(rel) or pristine_upstream_file(rel)
            changes[rel] = (old, apply_edits(old, edits, f"{patch.name}: {rel}"))
        if patch.adds_new_files:
            changes.update({rel: (None, text) for rel, text in new_files().items()})
        for rel, (_, new) in changes.items():
            if rel.endswith(".py") and yapf_format(new) != new:
                raise ValueError(f"{patch.name}: {rel} is not yapf-clean; fix the edit in make_patch.py")
            current[rel] = new
        out.append(changes)
    return out


def make_series() -> dict[str, str]:
    """Patch file name -> its text, in ``git format-patch`` form (applies with ``git am``, ``git apply``, ``patch -p1``)."""
    texts = {}
    for i, (patch, changes) in enumerate(zip(SERIES, series_files()), 1):
        head = (
            "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            f"From: {AUTHOR}\nDate: {DATE}\nSubject: [PATCH {i}/{len(SERIES)}] {patch.subject}\n\n"
            f"{patch.body}\n"
            f"Generated by torch_xla_bridge's upstream/make_patch.py from its modules and\n"
            f"pytorch/xla v{UPSTREAM_VERSION}.\n---\n"
        )
        diffs = "".join(_unified(rel, old, new) for rel, (old, new) in changes.items())
        texts[patch.name] = head + diffs + "-- \n2.43.0\n\n"
    return texts


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed patch differs")
    args = ap.parse_args(argv)
    series = make_series()
    stale = sorted(set(p.name for p in HERE.glob("[0-9][0-9][0-9][0-9]-*.patch")) - set(series))
    if args.check:
        bad = [n for n, text in series.items() if not (HERE / n).exists() or (HERE / n).read_text() != text]
        if bad or stale:
            print(f"stale: {bad + stale}; run python upstream/make_patch.py", file=sys.stderr)
            return 1
        return 0
    for name in stale:
        (HERE / name).unlink()
    for name, text in series.items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
