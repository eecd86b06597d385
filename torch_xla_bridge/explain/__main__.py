"""``python -m torch_xla_bridge.explain [options] train.py [options] [script args...]``

Runs an unchanged training script and prints every XLA execution per step
with its cause, then a one-line verdict. Options of this tool (``--steps``,
``--json``, ``--graph``) are recognised before and after the script path
(``-h``/``--help`` only before it: after it, it is the script's); every
other argument goes to the script, and so does everything after ``--``
(``... train.py --steps 3 -- --steps 100`` passes ``--steps 100`` to the script).

torch_xla's execution analysis (``PT_XLA_DEBUG_LEVEL=2``, written to a
temporary ``PT_XLA_DEBUG_FILE``) is switched on before torch_xla is imported,
so each execution gets torch_xla's graph hash, input/output counts and frame.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional, Sequence

_OURS = {"--steps": int, "--json": str, "--graph": str}
_HELP = ("-h", "--help")


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separates this tool's options (anywhere before ``--``) from the script's arguments."""
    ours, theirs = [], []
    it = iter(argv)
    for arg in it:
        if arg == "--" and theirs:  # the script path came first
            theirs.extend(it)
            break
        key = arg.split("=", 1)[0]
        if key in _HELP and not theirs:  # ours before the script path, the script's after it
            ours.append(arg)
        elif key in _OURS:
            ours.append(arg)
            if "=" not in arg:
                ours.append(next(it, ""))
        else:
            theirs.append(arg)
    return ours, theirs


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ours, rest = _split(argv)
    ap = argparse.ArgumentParser(
        prog="python -m torch_xla_bridge.explain",
        usage="%(prog)s [-h] [--steps N] [--json PATH] [--graph PATH] train.py [script args...]",
        description="Explain every XLA execution of a training script, per step.",
        epilog="This tool's options are recognised before and after the script path (-h/--help only before "
        "it); every other argument, and everything after `--`, goes to the script.",
    )
    ap.add_argument("script", nargs="?", metavar="train.py", help="the training script, run unchanged as __main__")
    ap.add_argument("--steps", type=int, default=None, metavar="N", help="stop the script after N training steps")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument(
        "--graph", metavar="PATH", help="write the first backward's autograd graph as DOT (and PATH.png with Graphviz)"
    )
    args = ap.parse_args(ours)
    if not rest or rest[0].startswith("-"):
        ap.error("give the training script to run: python -m torch_xla_bridge.explain train.py [args...]")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be a positive number of steps, got {args.steps}")
    if not os.path.isfile(rest[0]):
        ap.error(f"no training script at {rest[0]!r}: give the path of a Python file to run")
    args.script, args.script_args = rest[0], rest[1:]
    return args


def _enable_execution_analysis() -> Optional[str]:
    """torch_xla reads these once, on first use: they must be set before it is imported.

    Returns the temporary file made for the analysis, if one was.
    """
    if "torch_xla" in sys.modules:
        return None
    os.environ.setdefault("PT_XLA_DEBUG_LEVEL", "2")
    if os.environ.get("PT_XLA_DEBUG_FILE"):
        return None
    fd, path = tempfile.mkstemp(prefix="pt_xla_debug_", suffix=".txt")
    os.close(fd)
    os.environ["PT_XLA_DEBUG_FILE"] = path
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    temporary = _enable_execution_analysis()
    from .render import print_report
    from .script import run_script

    try:
        explainer, status = run_script(args.script, args.script_args, steps=args.steps, graph=bool(args.graph))
    finally:
        if temporary is not None:
            os.remove(temporary)
    sys.stdout.flush()
    print(f"\n== torch_xla_bridge.explain: {args.script} ==")
    print_report(explainer.report, graph=explainer.graph)
    if args.json:
        data = explainer.report.to_dict()
        if explainer.graph is not None:
            data["autograd_graph"] = explainer.graph.to_dict()
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
        print(f"report written to {args.json}")
    if args.graph:
        if explainer.graph is None:
            print("no backward pass ran: no autograd graph written")
        else:
            with open(args.graph, "w") as f:
                f.write(explainer.graph.dot())
            png = explainer.graph.render(os.path.splitext(args.graph)[0] + ".png")
            print(f"autograd graph written to {args.graph}" + (f" and {png}" if png else " (no Graphviz: no PNG)"))
    return status


if __name__ == "__main__":
    sys.exit(main())
