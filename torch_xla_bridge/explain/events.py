"""The raw facts the recorder captures: one plain dataclass per observation.

The recorder (:mod:`.recorder`) only observes; :func:`.build.build` turns the
list of events into an :class:`~.report.ExecutionReport`. Invariants:

- Events are appended in the order they happened; an event's ``counters``
  are the torch_xla counter increments since the previous look, and its
  ``executions`` the XLA executions since then (one entry per execution).
- Every field is plain data (str, int, bool, lists, dicts, None), so an event
  list round-trips through :func:`to_dicts` / :func:`from_dicts` and JSON.
- This module imports neither torch nor torch_xla.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

# The torch_xla._XLAC entry points through which torch_xla's Python code executes.
RUN_CACHED_GRAPH = "_run_cached_graph"  # a graph compiled by the dynamo bridge
SYNC_MULTI = "_xla_sync_multi"  # a sync of the given tensors
STEP_MARKER = "_xla_step_marker"  # xm.mark_step() / torch_xla.sync(): every live tensor
ENTRY_POINTS = (RUN_CACHED_GRAPH, SYNC_MULTI, STEP_MARKER)


@dataclasses.dataclass
class XlaExecution:
    """One execution as measured: torch_xla's analysis of it (None where off) or the entry point's arguments."""

    graph_hash: Optional[str] = None
    inputs: Optional[int] = None
    outputs: Optional[int] = None
    torch_xla_cause: Optional[str] = None  # the analysis's "Execution Cause"; None: no analysis record
    frame: str = ""  # the user frame the analysis names (executions outside entry points)


@dataclasses.dataclass
class Gap:
    """Executions no wrapped entry point made since the last look (value reads, ``.cpu()``, ...)."""

    executions: list[XlaExecution] = dataclasses.field(default_factory=list)
    # Leaves whose .grad, pending after the last backward, no longer is (looked at only when something ran).
    materialized: list[str] = dataclasses.field(default_factory=list)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    at_exit: bool = False  # the last look, when the explainer exits


@dataclasses.dataclass
class CallStarted:
    """A wrapped entry point is about to run: what was true just before it."""

    entry: str  # one of ENTRY_POINTS
    # Increments since the last look: the core bumps its signal counters
    # (names.SYNC_COUNTER, STEP_COUNTER, OPTIMIZER_SYNC_COUNTER, INPUT_SYNC_COUNTER, FORWARD_ALONE_COUNTER)
    # immediately before the call they announce.
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    in_backward: bool = False  # inside an autograd engine pass
    in_optimizer: bool = False  # called below a frame in torch/optim
    in_upstream_bridge: bool = False  # called below torch_xla/_dynamo/dynamo_bridge.py
    frame: str = ""  # the user's frame ("" if none)
    synced: int = 0  # _xla_sync_multi: tensors passed
    pending: int = 0  # _xla_sync_multi: of those, holding pending IR
    grads: list[str] = dataclasses.field(default_factory=list)  # leaves whose pending .grad is among them
    # Of those, leaves whose .grad was changed in place since the backward pass (clipped, scaled).
    changed_grads: list[str] = dataclasses.field(default_factory=list)
    ir: Optional[str] = None  # pending IR of the synced tensors


@dataclasses.dataclass
class CallReturned:
    """The wrapped entry point returned (or raised): what it executed."""

    entry: str
    executions: list[XlaExecution] = dataclasses.field(default_factory=list)
    materialized: list[str] = dataclasses.field(default_factory=list)  # as in Gap
    counters: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class OptimizerStepped:
    """``count`` optimizer steps returned since the last look (the global post-hook fired)."""

    count: int = 1


@dataclasses.dataclass
class BackwardStarted:
    """``torch.autograd.backward`` was called."""

    frame: str = ""
    # A compiled graph's backward node is in the pass (False: only eager, lazily
    # traced ops, whose .grad hold the whole forward and backward as pending IR).
    compiled: bool = True


@dataclasses.dataclass
class BackwardEnded:
    """The backward pass returned; ``pending_grads``: leaves it fed whose ``.grad`` holds pending IR."""

    pending_grads: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EqualLeaves:
    """At the first backward: groups of leaves it feeds that are separate tensors with equal, non-constant values.

    Weights tied on the CPU (an embedding and an LM head) that ``model.to(device)``
    replaced one by one, so that they now train apart.
    """

    groups: list[list[str]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DynamoGaveUp:
    """Dynamo stopped compiling ``function`` (its recompile limit): from now on it runs eagerly wherever no
    earlier compilation's guards hold."""

    function: str = ""  # as dynamo names it: "'step' (.../adam.py:213)"
    limit: str = ""  # "recompile_limit=8"
    guard: str = ""  # the guard that failed last
    backend: str = ""  # the backend it was compiled with
    optimizer: bool = False  # the function is an optimizer's step


@dataclasses.dataclass
class ManualSteps:
    """The first ``Explainer.step()``: from here on only StepMarked ends a step."""


@dataclasses.dataclass
class StepMarked:
    """``Explainer.step()``: the current step ends here."""


@dataclasses.dataclass
class Stopped:
    """``steps=N`` stopped the explained code when step N+1 opened."""

    steps: int


@dataclasses.dataclass
class Finished:
    """The explainer exited; ``execute_time``: torch_xla's own count of executions over the whole span."""

    raised: bool = False  # the explained code raised (StopExplain included)
    execute_time: int = 0


Event = Union[
    Gap, CallStarted, CallReturned, OptimizerStepped, BackwardStarted, BackwardEnded, EqualLeaves,
    DynamoGaveUp, ManualSteps, StepMarked, Stopped, Finished,
]
_TYPES: dict[str, type] = {t.__name__: t for t in Event.__args__}  # type: ignore[attr-defined]


def to_dict(event: Event) -> dict[str, Any]:
    """``{"event": <class name>, **fields}``: plain data, JSON-ready."""
    return {"event": type(event).__name__, **dataclasses.asdict(event)}


def from_dict(data: dict[str, Any]) -> Event:
    """The inverse of :func:`to_dict`."""
    fields = dict(data)
    cls = _TYPES[fields.pop("event")]
    if "executions" in fields:
        fields["executions"] = [XlaExecution(**x) for x in fields["executions"]]
    return cls(**fields)


def to_dicts(events: list[Event]) -> list[dict[str, Any]]:
    return [to_dict(e) for e in events]


def from_dicts(data: list[dict[str, Any]]) -> list[Event]:
    return [from_dict(d) for d in data]
