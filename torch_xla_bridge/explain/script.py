"""Running an unchanged training script under an :class:`~.recorder.Explainer`."""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

from .grad_graph import Names
from .recorder import Explainer


def run_script(
    path: str,
    argv: Sequence[str] = (),
    steps: Optional[int] = None,
    graph: bool = False,
    names: Names = None,
) -> tuple[Explainer, int]:
    """Runs ``path`` as ``__main__`` with ``sys.argv = [path, *argv]`` while explaining.

    Returns the explainer (``.report``, ``.graph``) and the script's exit status
    (a ``SystemExit`` from the script is caught, so the report is still made).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no training script at {path!r}: pass the path of a Python file to run")
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [path, *argv]
    # As `python train.py` would: the script's directory first on the import path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    status = 0
    explainer = Explainer(steps=steps, graph=graph, names=names)
    try:
        with explainer:
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] != saved_path0:
            sys.path.pop(0)
    return explainer, status
