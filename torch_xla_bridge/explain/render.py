"""Printing an :class:`~.report.ExecutionReport` (and an autograd graph) for a terminal.

With ``rich`` installed (the ``explain`` extra) each step is a rich table;
without it, the same columns as plain text.
"""

from __future__ import annotations

import shutil
import sys
from typing import IO, Optional

from ..names import COMPILE_COUNTERS, INPUT_SYNC_COUNTER, SYNC_COUNTER
from .grad_graph import GradGraph
from .report import ExecutionReport, Step

COLUMNS = ("#", "cause", "what", "graph hash", "in", "out", "triggered at")
# Counters shown under the table: input syncs, fused backward syncs, UncachedCompile.
_FOOTER_COUNTERS = (INPUT_SYNC_COUNTER, SYNC_COUNTER, COMPILE_COUNTERS[0])


def _cells(i: int, e) -> tuple[str, ...]:
    return (
        str(i),
        e.cause.value + (" *" if e.avoidable else ""),
        e.detail,
        (e.graph_hash or "-")[:12],
        "-" if e.inputs is None else str(e.inputs),
        "-" if e.outputs is None else str(e.outputs),
        e.frame or "-",
    )


def _step_title(step: Step) -> str:
    title = f"step {step.number}: {step.total} execution{'' if step.total == 1 else 's'}"
    if step.avoidable:
        title += f", {len(step.avoidable)} avoidable (*)"
    if not step.complete:
        title += " (incomplete)"
    return title


def _dynamo_lines(step: Step) -> list[str]:
    """Where dynamo gave up on a function: in the step it did, and where it runs eagerly from then on."""
    lines = [f"dynamo stopped compiling {g}" for g in step.dynamo_gave_up]
    if step.dynamo_eager and not step.dynamo_gave_up:
        lines.append(f"dynamo fallback: runs eagerly where no compilation fits: {', '.join(step.dynamo_eager)}")
    return lines


def _pending_line(step: Step) -> Optional[str]:
    if not step.pending_grads:
        return None
    names = ", ".join(step.pending_grads[:6]) + (", ..." if len(step.pending_grads) > 6 else "")
    n = len(step.pending_grads)
    return f"pending IR left on .grad after backward: {n} lea{'f' if n == 1 else 'ves'} ({names})"


def untied_line(group: list[str]) -> str:
    """What a group of equal, separate leaves most likely is, and the fix that keeps them tied on XLA."""
    return (
        f"untied weights? {' and '.join(group)} hold equal values but are separate tensors, so they train "
        f"apart: model.to(device) replaces each parameter on its own and unties weights tied on the CPU. "
        f"Tie them again after the move (e.g. `model.lm_head.weight = model.wte.weight`), or call "
        f"`torch.__future__.set_swap_module_params_on_conversion(True)` before it"
    )


def _footer(report: ExecutionReport) -> list[str]:
    m = report.metrics
    lines = [
        f"total {report.total} executions; torch_xla ExecuteTime counted {m.get('ExecuteTime', 0)}; "
        + ", ".join(f"{c} +{m.get(c, 0)}" for c in _FOOTER_COUNTERS)
        + ("" if report.analysis else "; torch_xla execution analysis off (hashes of syncs, value-read frames unknown)")
    ]
    if report.stopped_after is not None:
        lines.append(f"stopped after {report.stopped_after} steps")
    lines += [untied_line(group) for group in report.equal_leaves]
    lines.append(f"verdict: {report.verdict()}")
    return lines


def format_text(report: ExecutionReport, graph: Optional[GradGraph] = None) -> str:
    """The report as plain text."""
    out = []
    for step in report.steps:
        rows = [COLUMNS] + [_cells(i, e) for i, e in enumerate(step.executions, 1)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
        out.append(_step_title(step))
        for r in rows:
            out.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
        pending = _pending_line(step)
        if pending:
            out.append("  " + pending)
        out += ["  " + line for line in _dynamo_lines(step)]
        out.append("")
    if graph is not None:
        out += [graph.text(), ""]
    out += _footer(report)
    return "\n".join(out) + "\n"


def print_report(report: ExecutionReport, graph: Optional[GradGraph] = None, file: Optional[IO[str]] = None) -> None:
    """Prints the report, as rich tables when ``rich`` is importable."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        file.write(format_text(report, graph))
        return
    width = None if file.isatty() else max(140, shutil.get_terminal_size((140, 24)).columns)
    console = Console(file=file, width=width, highlight=False)
    for step in report.steps:
        table = Table(title=_step_title(step), title_justify="left", show_lines=False)
        for col in COLUMNS:
            table.add_column(col, overflow="fold", no_wrap=col in ("#", "in", "out", "graph hash"))
        for i, e in enumerate(step.executions, 1):
            style = "bold red" if e.avoidable else None
            table.add_row(*_cells(i, e), style=style)
        console.print(table)
        pending = _pending_line(step)
        if pending:
            console.print(pending, style="yellow", markup=False, soft_wrap=True)
        for line in _dynamo_lines(step):
            console.print(line, style="yellow", markup=False, soft_wrap=True)
    if graph is not None:
        console.print(graph.text(), markup=False)
    for line in _footer(report):
        console.print(line, markup=False, soft_wrap=True)
