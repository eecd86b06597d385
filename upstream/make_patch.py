"""Generates the pytorch/xla patch from this project's modules and torch_xla 2.9.0's own files.

One implementation, two packagings: the patch's new modules
``torch_xla/_dynamo/grad_sync.py`` and ``torch_xla/_dynamo/deferred_backward.py``
are ``torch_xla_bridge/grad_sync.py`` and ``torch_xla_bridge/dynamo_bridge.py``
with the few edits listed in :data:`EDITS` (names, imports, the unfused
fallback), each of which must match exactly once. The hunks in upstream's
``dynamo_bridge.py`` and ``config.py`` are the glue in :data:`BRIDGE_EDITS`
and :data:`CONFIG_EDITS`; the upstream-style test is copied verbatim. The
pristine upstream files are read from the installed ``torch_xla==2.9.0`` wheel
after checking them against the wheel's RECORD hashes (the wheel ships the
repository's Python files unchanged, so the patch applies to a v2.9.0 checkout
with ``git apply`` or ``patch -p1`` as well as to an installed package).

    python upstream/make_patch.py            # rewrites upstream/<PATCH_NAME>
    python upstream/make_patch.py --check    # exit 1 if the committed patch is stale
"""

from __future__ import annotations

import argparse
import ast
import base64
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
PATCH_NAME = "0001-dynamo-fuse-backward-with-grad-accumulation.patch"
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
            ("    return spmd.compile_upstream(gm, example_inputs)\n", _UNFUSED_COMPILE),
        ],
    ),
}

# Functions of the package that upstream does not need (the bridge itself
# warns about CPU inputs), removed from the generated module.
DROPPED_FUNCTIONS = {"torch_xla/_dynamo/deferred_backward.py": ["check_inputs_on_xla"]}

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
# `.grad` after `loss.backward()`. XLA_DYNAMO_FUSED_GRAD=0 turns it off.
fused_backward = os.environ.get('XLA_DYNAMO_FUSED_GRAD', '1') != '0'
""",
    ),
]

MODIFIED: dict[str, Edits] = {
    "torch_xla/_dynamo/dynamo_bridge.py": BRIDGE_EDITS,
    "torch_xla/_dynamo/config.py": CONFIG_EDITS,
}
TEST_FILE = "test/dynamo/test_dynamo_fused_grad.py"


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
    """A file of the installed torch_xla wheel, checked against the wheel's RECORD."""
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


def new_files() -> dict[str, str]:
    """Path in the pytorch/xla tree -> content of each file the patch creates."""
    out: dict[str, str] = {}
    for rel, (source, edits) in EDITS.items():
        text = (PACKAGE / source).read_text()
        for fn in DROPPED_FUNCTIONS.get(rel, []):
            text = drop_function(text, fn, rel)
        text = apply_edits(text, edits, rel)
        if rel.endswith("deferred_backward.py"):
            text = replace_docstring(text, _DEFERRED_DOC) + _BRIDGE_ENTRY
        out[rel] = text
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


def make_patch() -> str:
    parts = [
        "Fuse the dynamo backward with the accumulation of gradients into .grad\n\n"
        "Generated by torch_xla_bridge's upstream/make_patch.py from its modules and the\n"
        f"torch_xla {UPSTREAM_VERSION} sources; apply in a pytorch/xla v{UPSTREAM_VERSION} checkout or an\n"
        "installed package's parent folder with `patch -p1` (or `git apply`).\n\n"
    ]
    for rel, edits in MODIFIED.items():
        old = pristine_upstream_file(rel)
        parts.append(_unified(rel, old, apply_edits(old, edits, rel)))
    for rel, text in new_files().items():
        parts.append(_unified(rel, None, text))
    return "".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed patch differs")
    args = ap.parse_args(argv)
    path = HERE / PATCH_NAME
    text = make_patch()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run python upstream/make_patch.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
