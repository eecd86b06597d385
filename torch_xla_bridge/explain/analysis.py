"""Reading torch_xla's own execution analysis (``PT_XLA_DEBUG_LEVEL``).

With ``PT_XLA_DEBUG_LEVEL`` >= 1 torch_xla's C++ runtime writes, for every
execution, a block like::

    Execution Analysis: Execution Cause
    Execution Analysis:   dynamo is executing a compiled program
    Execution Analysis: Graph Info:
    Execution Analysis:   Graph Hash: 91a99b2adc5da49cf24a34ecb6064b74
    Execution Analysis:   Number of Graph Inputs: 8
    Execution Analysis:   Number of Graph Outputs: 6
    Execution Analysis: Python Frame Triggered Execution:
    Execution Analysis:   optimized_mod (.../dynamo_bridge.py:552)
    Execution Analysis: ------------------------------------------------

to ``PT_XLA_DEBUG_FILE`` (stderr when unset). It is written synchronously when
the execution is launched, so after an entry point returns its blocks are in the
file. The runtime reads both variables once, when torch_xla first needs them:
they must be set before torch_xla runs anything (the CLI does so).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from .. import program_memory

_PREFIX = "Execution Analysis: "
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


@dataclasses.dataclass(frozen=True)
class AnalysisRecord:
    """One execution as torch_xla's analysis describes it."""

    cause: str
    graph_hash: Optional[str]
    inputs: Optional[int]
    outputs: Optional[int]
    frames: tuple[tuple[str, str, int], ...]  # (function, file, line), innermost first


def enabled() -> bool:
    """True if the environment asks torch_xla to write its analysis to a file we can read."""
    return program_memory.analysis_file() is not None


class AnalysisLog:
    """Incremental reader of the execution-analysis blocks appended to one file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0
        self._partial = ""

    def read_new(self) -> list[AnalysisRecord]:
        """The execution records completed since the last call, in execution order."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "r", errors="replace") as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        text = self._partial + text
        lines = text.split("\n")
        # A block is complete at its dashed line; keep the rest for the next call.
        end = max((i for i, l in enumerate(lines) if l.startswith(_PREFIX + "---")), default=-1)
        self._partial = "\n".join(lines[end + 1 :])
        return parse(lines[: end + 1])


def parse(lines: list[str]) -> list[AnalysisRecord]:
    """Parses complete execution-analysis blocks (other debug output is skipped)."""
    records: list[AnalysisRecord] = []
    block: Optional[dict] = None
    section = ""
    for raw in lines:
        if not raw.startswith(_PREFIX):
            continue
        line = raw[len(_PREFIX) :]
        body = line.strip()
        if body == "Execution Cause":
            block = {"cause": "", "hash": None, "inputs": None, "outputs": None, "frames": []}
            section = "cause"
        elif block is None:
            continue
        elif body.startswith("---"):
            records.append(
                AnalysisRecord(block["cause"], block["hash"], block["inputs"], block["outputs"], tuple(block["frames"]))
            )
            block, section = None, ""
        elif body.startswith("Graph Info"):
            section = "graph"
        elif body.startswith("Python Frame Triggered Execution"):
            section = "frames"
        elif section == "cause" and body:
            block["cause"] = f"{block['cause']} {body}".strip()
        elif section == "graph" and ":" in body:
            key, _, value = body.partition(":")
            value = value.strip()
            if key == "Graph Hash":
                block["hash"] = value
            elif key == "Number of Graph Inputs":
                block["inputs"] = int(value)
            elif key == "Number of Graph Outputs":
                block["outputs"] = int(value)
        elif section == "frames":
            m = _FRAME.match(body)
            if m:
                block["frames"].append((m["func"], m["file"], int(m["line"])))
    return records
