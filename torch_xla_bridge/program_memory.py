"""XLA's compile-time accounting of a program's memory, as torch_xla's post-compilation analysis prints it.

With ``PT_XLA_DEBUG_LEVEL`` >= 1 and ``PT_XLA_DEBUG_FILE`` set before
torch_xla starts, torch_xla writes XLA's ``CompiledMemoryStats`` of every
program it compiles to that file, at compile time (steady steps pay
nothing), in GB with 6 decimals (1 KiB resolution)::

    Post Compilation Analysis: Graph input size: 0.000004 GB
    Post Compilation Analysis: Graph output size: 0.000002 GB
    Post Compilation Analysis: Aliased Input size: 0.000001 GB
    Post Compilation Analysis: Intermediate tensor size: 0.000003 GB

One home for reading it: the refused step's error (:mod:`.rollback`) and
the benchmark's memory columns (``bench/memory.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

_GIB = 1 << 30
_FIELDS = {
    "Graph input size": "argument",
    "Graph output size": "output",
    "Aliased Input size": "aliased",
    "Intermediate tensor size": "temporary",
}
_LINE = re.compile(r"Post Compilation Analysis: (?P<field>[A-Za-z ]+): (?P<value>\S+)(?: GB)?")


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's buffers, in bytes (1 KiB resolution)."""

    argument: int
    output: int
    aliased: int
    temporary: int

    @property
    def own_bytes(self) -> int:
        """Its own buffers while it runs: donated arguments share their output's buffer."""
        return self.argument + self.output - self.aliased + self.temporary

    def describe(self) -> str:
        """``9.0 GiB (arguments 0.1, outputs 0.1 of which 0.1 donated, temporaries 8.8)``."""
        gib = [v / _GIB for v in (self.own_bytes, self.argument, self.output, self.aliased, self.temporary)]
        return ("{:.1f} GiB (arguments {:.1f}, outputs {:.1f} of which {:.1f} donated, temporaries {:.1f})"
                .format(*gib))


def parse(text: str) -> list[Program]:
    """The programs of an analysis file, in compile order; a block with a size XLA did not know (``Unknown``)
    is left out."""
    programs: list[Program] = []
    fields: dict[str, Optional[int]] = {}
    for m in _LINE.finditer(text):
        key = _FIELDS.get(m["field"].strip())
        if key is None:
            continue
        if key == "argument":  # a block's first size
            fields = {}
        value = m["value"]
        fields[key] = round(float(value) * _GIB) if re.fullmatch(r"[0-9.]+", value) else None
        if key == "temporary" and len(fields) == len(_FIELDS) and None not in fields.values():
            programs.append(Program(**fields))  # type: ignore[arg-type]
    return programs


def analysis_file() -> Optional[str]:
    """The file torch_xla writes its analysis to, where the environment asks for it (read once by torch_xla,
    at start: set both variables before it starts)."""
    try:
        level = int(os.environ.get("PT_XLA_DEBUG_LEVEL", "0") or 0)
    except ValueError:
        return None
    path = os.environ.get("PT_XLA_DEBUG_FILE")
    return path if level >= 1 and path else None


def last_compiled() -> Optional[Program]:
    """The program torch_xla compiled last, from its analysis file; None where there is none to read."""
    path = analysis_file()
    if path is None or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        programs = parse(f.read())
    return programs[-1] if programs else None
