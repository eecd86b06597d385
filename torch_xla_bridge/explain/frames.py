"""Finding the user's Python frame behind an execution.

A frame is the user's when its file lies outside torch, torch_xla, this package
and the standard library (and is a real file, not ``<eval_with_key>`` or
``<frozen runpy>``). A frame that dynamo runs as a compiled function (its caller
is dynamo's ``eval_frame``) is skipped too: the line that *called* the compiled
function says more than the function's ``def``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import sysconfig
import types
from typing import Iterable, Optional


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("torch", "torch_xla", "torch_xla_bridge"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.realpath(p) + os.sep for p in spec.submodule_search_locations)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.append(os.path.realpath(path) + os.sep)
    return tuple(dirs)


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    real = os.path.realpath(filename)
    return not any(real.startswith(d) for d in _library_dirs())


def _is_dynamo_frame(frame: types.FrameType) -> bool:
    caller = frame.f_back
    return caller is not None and caller.f_code.co_filename.endswith(
        os.path.join("torch", "_dynamo", "eval_frame.py")
    )


def format_frame(filename: str, line: int, func: str) -> str:
    """``path:line in func``, the path relative to the working directory when below it."""
    try:
        rel = os.path.relpath(filename)
        if not rel.startswith(".."):
            filename = rel
    except ValueError:  # another drive
        pass
    return f"{filename}:{line} in {func}"


def user_frame(frame: Optional[types.FrameType] = None) -> str:
    """The innermost user frame at or outside ``frame`` (default: the caller's), formatted."""
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename) and not _is_dynamo_frame(frame):
            return format_frame(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return ""


def first_user_frame(frames: Iterable[tuple[str, str, int]]) -> str:
    """The innermost user frame of ``(function, file, line)`` triples (innermost first)."""
    for func, filename, line in frames:
        if is_user_file(filename):
            return format_frame(filename, line, func)
    return ""


def stack_files(frame: Optional[types.FrameType]) -> Iterable[tuple[str, str]]:
    """``(file, function)`` of ``frame`` and every frame outside it."""
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_code.co_name
        frame = frame.f_back
