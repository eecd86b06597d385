"""Device memory a training run needs, from XLA's own accounting of each program it compiles.

PJRT CPU has no allocator statistics (``xm.get_memory_info`` is unsupported
there), so this reads what every device has: XLA's ``CompiledMemoryStats``
of each compiled program, which torch_xla's post-compilation analysis
(``PT_XLA_DEBUG_LEVEL=1``, written to ``PT_XLA_DEBUG_FILE``) prints in GB
with 6 decimals (1 KiB resolution): argument, output, aliased (inputs
donated to outputs) and temporary bytes. It is printed at compile time only,
so steady steps pay nothing for it.

While a program runs, its own buffers take ``argument + output - aliased +
temporary`` bytes. ``device_peak_mb`` is the largest of these over every
program the run compiled (first steps included), with the aliased (donated)
bytes of that program. It counts a program's own buffers only: buffers that
stay on the device beside it without being its arguments (``.grad`` and
momentum during upstream's forward) are not in it, so for a mode that runs
several programs per step it is a lower bound of the peak, and for one that
runs the whole step as one program (its state among the arguments) it is
the peak.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from torch_xla_bridge.program_memory import Program


def __getattr__(name: str) -> Any:
    """``Program`` and ``parse`` live in the package (torch_xla_bridge/program_memory.py), imported on first use:
    importing the package starts torch_xla, and :func:`enable` must run before that."""
    if name in ("Program", "parse"):
        from torch_xla_bridge import program_memory

        return getattr(program_memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enable() -> Optional[Path]:
    """Turns torch_xla's post-compilation analysis on, into a fresh file; call before torch_xla is imported.

    None (nothing changed) where the environment already sets either
    variable: the user's analysis is left as it is.
    """
    if "PT_XLA_DEBUG_LEVEL" in os.environ or "PT_XLA_DEBUG_FILE" in os.environ:
        return None
    fd, name = tempfile.mkstemp(prefix="bench-xla-analysis-", suffix=".txt")
    os.close(fd)
    os.environ["PT_XLA_DEBUG_LEVEL"] = "1"
    os.environ["PT_XLA_DEBUG_FILE"] = name
    return Path(name)


def summary(programs: list[Program]) -> dict[str, Optional[float]]:
    """``device_peak_mb`` (see the module), the bytes donated in that program, and how many programs were compiled."""
    if not programs:
        return dict(device_peak_mb=None, donated_mb=None, programs_compiled=0)
    peak = max(programs, key=lambda p: p.own_bytes)
    return dict(device_peak_mb=peak.own_bytes / 2**20, donated_mb=peak.aliased / 2**20, programs_compiled=len(programs))
