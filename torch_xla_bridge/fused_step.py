"""The fused training step of ``openxla_fused_step``: one XLA execution per step.

Every graph this backend compiles is deferred (:class:`~torch_xla_bridge.deferred.DeferredGraph`): the
forward's outputs, the saved activations included, are pending outputs of one
embedded computation; the backward consumes them as another; the autograd
engine's ``.grad`` accumulation and an eager optimizer's updates are lazy ops
on top. Nothing executes until the step is cut, and then everything pending
runs as one XLA execution, cached after warm-up.

The step is cut (torch_xla's step barrier, which materializes every live tensor):

- when an optimizer step ends, eager (a global optimizer step post-hook) or
  compiled with this backend (the graph that updates its inputs joins the
  step, then cuts it; after each such graph, where dynamo splits an optimizer
  step into several), so ``loss.item()`` after ``optimizer.step()`` and a model
  read after training execute nothing;
- at ``torch_xla.sync()`` / ``xm.mark_step()``, as with any lazy tensor;
- before a forward whose parameters hold pending updates (e.g. parameters
  updated by hand, no sync): the previous step is synced first, so one step
  never grows into the next;
- where dynamo runs part of the loop eagerly (it gave up on a function at its
  ``recompile_limit``, a disabled block, a graph break it cannot resume): an
  eager optimizer step whose parameters are trained with this backend still
  ends the step (:mod:`.dynamo_fallback`), also where dynamo compiled the
  optimizer's wrapper and runs the step itself eagerly.

A compiled optimizer step writes its new parameters and state into them as
in-place updates before it cuts (AOTAutograd keeps the updates in the graph,
``keep_inference_input_mutations``, and :class:`DeferredGraph` writes them
back), so the step's execution donates their old buffers to their new values,
as it does for an eager optimizer's updates.

A graph that needs no backward and updates none of its inputs (an evaluation
forward, a checkpointed block's forward under ``no_grad``) joins an open step;
outside one it executes its own outputs at once, as upstream does.

A read of a value (``.item()``, ``.cpu()``, ``print``) executes what that value
needs. A read between a forward and the step's cut computes the forward twice
(once for the read, once in the step); a graph where that is seen is switched
to ``openxla_fused_grad`` behaviour (its forward executes on its own), with one
warning saying where (between forward and backward, or before the cut). A step
cut between a forward and its backward (another model's optimizer step in a GAN)
materializes the forward's outputs and costs nothing twice: it is not such a read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import (_private, accumulation, counting, deferred, dynamo_bridge, dynamo_fallback, grad_sync, in_flight,
               optimizer_sync, rollback)
from .deferred import DeferredGraph
from .dynamo_bridge import boxed
from .names import FORWARD_ALONE_COUNTER, FRESH_STATE_COUNTER, STEP_BACKEND_NAME, STEP_COUNTER

log = logging.getLogger(__name__)


# Set while a replayed step's capture traces the step (replay.py): its caller cuts the step after it.
_cut_by_caller: contextvars.ContextVar[bool] = contextvars.ContextVar("cut_by_caller", default=False)


@contextlib.contextmanager
def cut_by_caller() -> Iterator[None]:
    """Within it, :func:`end_step` leaves the step pending: the caller cuts it (a capture traces the whole step
    as one program, and anything else that executes inside it tells a step that is not one)."""
    token = _cut_by_caller.set(True)
    try:
        yield
    finally:
        _cut_by_caller.reset(token)


def end_step() -> None:
    """Cuts the step: everything pending on the device runs as one execution (asynchronously).

    Inside ``torch_xla.compile(fn, full_graph=True)`` no execution is allowed
    until ``fn`` returns, when torch_xla syncs: that sync is the cut, so this
    one is left to it and the step stays pending (one execution per call of ``fn``).
    Inside :func:`cut_by_caller` too.
    """
    if not _private.execution_allowed():
        log.debug("inside torch_xla.compile(full_graph=True): the step is cut by its sync when the function returns")
        return
    if _cut_by_caller.get():
        log.debug("a replayed step's capture: its caller cuts the step")
        return
    counting.bump(STEP_COUNTER)
    step = next(iter(_open), None)
    # The cut can come from inside a user's profiler trace (xp.Trace around the step):
    # keep its IR scope, as upstream's bridge never resets one.
    if step is None:
        torch_xla.sync(reset_scope=False)
    else:
        rollback.guarded(lambda: torch_xla.sync(reset_scope=False), step.rollback.written,
                         functools.partial(_refused, step))


def _refused(step: "_Step", error: RuntimeError, launches: int, compiled: bool) -> None:
    """XLA refused ``step`` (made after ``launches`` launches) before running it: what the step wrote takes
    back its value from before the step, so that no read or later step runs it again, and the error says
    so. Where the program never compiled, the step's other results are dropped too
    (:func:`rollback.drop_refused_outputs`)."""
    _open.discard(step)
    lost = step.abandon(launches)
    if not compiled:
        dropped = rollback.drop_refused_outputs()
        log.debug("refused step: %d of its results still alive dropped", dropped)
    raise rollback.refused_step_error(error, STEP_BACKEND_NAME, step.rollback.kept(), lost, compiled) from error


@dataclasses.dataclass
class _Pair:
    """State shared by the forward and backward graphs of one AOTAutograd compilation.

    ``launches_at_forward`` / ``forward_outputs``: :func:`counting.launches`
    right after the latest deferred forward, and its pending outputs (weakly).
    If, at the backward, an execution ran since then and some of those
    outputs are still pending, a read executed part of the forward, and the
    step will compute it again. ``launches_at_backward``: launches right
    after the step's first backward; more than one execution between it and
    the step's cut means a read there. ``unfused_reason``: set once either
    was seen; the forward then executes its outputs at once instead.
    """

    launches_at_forward: Optional[int] = None
    forward_outputs: list[weakref.ref[torch.Tensor]] = dataclasses.field(default_factory=list)
    launches_at_backward: Optional[int] = None
    unfused_reason: Optional[str] = None

    def unfuse(self, reason: str) -> None:
        """Switches the forward to executing on its own; warns once."""
        if self.unfused_reason is not None:
            return
        self.unfused_reason = reason
        warnings.warn(
            f"{STEP_BACKEND_NAME}: {reason}, which computes the forward twice; from now on this graph's "
            f"forward executes on its own (openxla_fused_grad behaviour), backward, accumulation and "
            f"optimizer stay fused. Read values (e.g. loss.item()) after the optimizer step or "
            f"torch_xla.sync() to keep one execution per step."
        )

    def forward_was_read(self) -> bool:
        """At the backward: an execution since the forward left some of its outputs pending."""
        if self.launches_at_forward is None or counting.step_launches() == self.launches_at_forward:
            return False
        alive = [t for t in (r() for r in self.forward_outputs) if t is not None]
        # A step cut materializes every live output; a read materializes only what it reads.
        return bool(alive) and any(_private.need_materialization(alive))

    def at_step_end(self) -> None:
        """At the step's cut: the cut is one execution; any other since the backward was a read."""
        if self.launches_at_backward is not None and counting.step_launches() - self.launches_at_backward > 1:
            self.unfuse("a value was read (an XLA execution ran) between its backward and the end of the step")
        self.launches_at_backward = None

    def check_uncut_step(self) -> None:
        """At the next forward: the previous step ran, but was never cut (no step closure ran)."""
        if self.launches_at_backward is not None and counting.step_launches() > self.launches_at_backward:
            self.unfuse(
                "the step after its backward was executed by something other than torch_xla.sync() or a "
                "graph of this backend (e.g. an optimizer compiled with another backend, or a read)"
            )
        self.launches_at_backward = None

    # --- the forward's and the backward's policies ---

    def before_forward(self, args: list) -> None:
        """Parameters never carry a previous step's IR into a forward; an uncut step is noticed."""
        if _pending_parameters(args):
            log.debug("parameters hold pending updates at a forward: syncing the previous step first")
            end_step()
        self.check_uncut_step()
        # Before the step's first backward writes any .grad (and the forward draws a seed).
        _current_step().rollback.grads(a for a in args if isinstance(a, torch.Tensor))

    def forward_pending(self, pending: list[torch.Tensor]) -> None:
        """``on_pending`` of the forward: join the step, or (unfused) execute at once.

        Unfused, it executes on its own, or, where a step holds work (the
        previous micro-batch's backward, a step a read left uncut), as that
        step's cut: a sync of these outputs alone would donate the buffers of
        the state the forward writes (BatchNorm's statistics), which the
        step's pending IR may still read, and the step would grow by a
        backward per call where nothing else cuts it. Either is one execution.
        """
        if self.unfused_reason is not None:
            if _open_step() is not None:
                end_step()
                return
            counting.bump(FORWARD_ALONE_COUNTER)
            grad_sync.sync(pending, fresh=True)
            return
        _current_step().forwards[id(self)] = self
        self.launches_at_forward = counting.step_launches()
        self.forward_outputs = [weakref.ref(t) for t in pending]

    def forward_embedded(self, call: deferred.Embedded) -> None:
        """``on_embedded`` of the forward: recorded for folding (not where it executes on its own)."""
        if self.unfused_reason is None:
            _current_step().accumulation.record_forward(call)

    def backward_embedded(self, call: deferred.Embedded) -> None:
        """``on_embedded`` of the backward: recorded for folding, as its forward was."""
        if self.unfused_reason is None:
            _current_step().accumulation.record_backward(call)

    def before_backward(self) -> None:
        if self.forward_was_read():
            self.unfuse("a value was read (an XLA execution ran) between its forward and backward")
        self.launches_at_forward = None
        self.forward_outputs = []

    def after_backward(self) -> None:
        """The step's first backward of this pair: watch for reads until the cut."""
        if self.unfused_reason is None and self.launches_at_backward is None:
            self.launches_at_backward = counting.step_launches()
            _current_step().pairs[id(self)] = self


class _Step:
    """A step of this backend that is pending: graphs deferred since the last cut.

    Strongly referenced only by its step closure, which torch_xla runs and
    drops at the next step barrier (``torch_xla.sync()``, our cuts): so
    :data:`_open` holds it while the step is pending, and nothing of it
    outlives the cut. A step that an exception abandoned before any backward
    joined it (forwards whose outputs all died or were read) holds no work:
    :func:`_open_step` closes it, so that it draws no later no-backward graph in.
    """

    __slots__ = ("pairs", "forwards", "joined", "accumulation", "rollback", "__weakref__")

    def __init__(self) -> None:
        # Pairs whose backward joined this step, by identity.
        self.pairs: dict[int, _Pair] = {}
        # Pairs whose forward joined it (their latest forward's outputs: _Pair.forward_outputs).
        self.forwards: dict[int, _Pair] = {}
        # What else was left pending in it before any backward joined (the state a forward
        # writes, a no-backward graph's outputs), weakly.
        self.joined: list[weakref.ref[torch.Tensor]] = []
        # Its embedded calls by micro-batch; alike micro-batches are folded into one loop.
        self.accumulation = accumulation.Accumulation()
        # The values its writes replace, put back if XLA refuses it.
        self.rollback = rollback.Record()

    def join(self, pending: Sequence[torch.Tensor]) -> None:
        self.joined.extend(weakref.ref(t) for t in pending)

    def holds_work(self) -> bool:
        """A backward joined, or something that joined is alive and still pending.

        Before a backward, at most a forward's outputs and what a few graphs
        wrote are walked: this runs where a graph may join the step.
        """
        if self.pairs:
            return True
        refs = [*self.joined, *(r for pair in self.forwards.values() for r in pair.forward_outputs)]
        alive = [t for t in (r() for r in refs) if t is not None]
        return bool(alive) and any(_private.need_materialization(alive))

    def at_step_end(self) -> None:
        for pair in self.pairs.values():
            pair.at_step_end()

    def abandon(self, launches: int) -> list[str]:
        """XLA refused this step's cut, made after ``launches`` launches: its writes are undone
        (:meth:`rollback.Record.restore`), and its pairs watch no more for reads in it. Returns what
        could not be put back."""
        for pair in self.pairs.values():
            pair.launches_at_backward = None
        return self.rollback.restore(launches)


# The pending step, if any (at most one member; see _Step).
_open: weakref.WeakSet[_Step] = weakref.WeakSet()


def _open_step() -> Optional[_Step]:
    """The pending step, if it holds work; one that holds none is closed (its step closure,
    still queued, finds no pair at the next barrier)."""
    for step in list(_open):
        if step.holds_work():
            return step
        log.debug("the open step holds no pending work (abandoned before its backward): closed")
        _open.discard(step)
    return None


def _current_step() -> _Step:
    """The pending step, opened (its step closure queued) if there is none.

    For a graph that joins it: a step abandoned with no work left is as good
    as a new one (its closure runs at the same barrier), so no liveness is
    checked on this hot path (once per forward and per backward).
    """
    for step in _open:
        return step
    step = _Step()
    _open.add(step)
    _private.add_step_closure(step.at_step_end)
    return step


@torch._dynamo.disable
def _cut_after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: an optimizer step ends the pending step of this backend.

    Cuts when the optimizer's update is pending (it ran eagerly) and either a
    step of this backend is pending, or its parameters are trained with this
    backend although no graph of it ran (dynamo runs the forward eagerly:
    :mod:`.dynamo_fallback`): the step is cut here all the same. A no-op otherwise: a compiled optimizer step of
    this backend cut the step in its own graph, and optimizers trained with
    other backends, or none, are not affected. Disabled for dynamo, so it runs when the step ends
    even where dynamo compiled the optimizer's wrapper but runs the step
    itself eagerly (it gave up on the step).
    """
    if _open_step() is None and dynamo_fallback.trained_with(optimizer) != STEP_BACKEND_NAME:
        return
    # An update compiled with another backend executed it and the step's pending work with it:
    # the next forward notices (_Pair.check_uncut_step), as without this hook.
    if optimizer_sync.update_pending(optimizer):
        end_step()


def _create_state_before_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: an optimizer's first step in a step of this backend
    finds its state created, as data.

    An eager step: the optimizer's own ``_init_group`` creates it (as dynamo
    does before it traces a compiled step), so it is exactly what the step
    would create; its constants are then materialized
    (:func:`_materialize_constant`), so the first step's graph is the
    second's. A compiled step: dynamo creates the state of every optimizer
    but SGD's, whose momentum buffers the hook creates while dynamo traces it
    (:func:`_zero_momentum_buffers`), so the first trace is the second's.
    """
    if torch.compiler.is_compiling():
        _private.at_trace_time(_create_momentum_buffers_at_trace_time)
        return
    _finish_accumulation()
    step = _open_step()
    if step is not None:
        step.rollback.optimizer(optimizer)
    _create_state(optimizer)
    if step is not None or dynamo_fallback.trained_with(optimizer) == STEP_BACKEND_NAME:
        in_flight.keep_optimizer_update(optimizer)


def _finish_accumulation() -> None:
    """Where an optimizer step begins: the pending step's micro-batches are all in (see
    :meth:`accumulation.Accumulation.finish`)."""
    step = _open_step()
    if step is not None:
        step.accumulation.finish()


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates and materializes ``optimizer``'s state, once per optimizer (``_state_created``).

    Nothing with no step of this backend pending, once every parameter with
    a gradient has state, and for an optimizer without ``_init_group(group, *lists)``.
    """
    if optimizer in _state_created or _open_step() is None:
        return
    _state_created.add(optimizer)
    fresh = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None and p not in optimizer.state]
    if not fresh:
        return
    with torch.no_grad():
        if not _private.init_optimizer_state(optimizer):
            return
        if type(optimizer) is torch.optim.SGD:
            for group in optimizer.param_groups:
                _zero_momentum_buffers(optimizer, group)
    state = [(p, t) for p in fresh for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    # Under SPMD the fresh state is constant IR with no sharding: executed on its own it came out replicated,
    # every device holding all of (e.g.) AdamW's moments of FSDP-sharded parameters. Laid out as their parameter.
    grad_sync.keep_param_shardings([(p, t) for p, t in state if t.shape == p.shape])
    _materialize_constant([t for _, t in state])


def _create_momentum_buffers_at_trace_time(ctx: Any) -> None:
    # Run by dynamo while it traces the pre-hook, before SGD's _init_group reads the buffers;
    # other optimizers' state dynamo creates (their _init_group, eagerly) and materializes.
    optimizer = _private.traced_object(ctx, "optimizer")
    if type(optimizer) is torch.optim.SGD:
        _create_state(optimizer)


def _zero_momentum_buffers(optimizer: torch.optim.SGD, group: dict) -> None:
    """Gives SGD's parameters a zero momentum buffer before its first step, where that changes no value.

    SGD creates the buffer in its first step as a copy of the gradient, and
    from the second on computes ``buf * momentum + (1 - dampening) * grad``, a
    different graph. With dampening 0 the second formula on a zero buffer is
    the copy, exactly (``0 * m + g == g``), so the first step computes it too.
    """
    if group["momentum"] == 0 or group["dampening"] != 0:
        return
    for p in group["params"]:
        if p.grad is not None and "momentum_buffer" not in optimizer.state[p]:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


# Optimizers whose state the pre-hook created (or found), by identity: it runs once per optimizer.
_state_created: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


_optimizer_hooks: list[torch.utils.hooks.RemovableHandle] = []


def register_optimizer_hooks() -> None:
    """Registers :func:`_create_state_before_first_step` and :func:`_cut_after_optimizer_step` once per process."""
    if not _optimizer_hooks:
        _optimizer_hooks.append(register_optimizer_step_pre_hook(_create_state_before_first_step))
        _optimizer_hooks.append(register_optimizer_step_post_hook(_cut_after_optimizer_step))


def _inputs_at(args: Sequence[Any], positions: Sequence[int]) -> list[torch.Tensor]:
    """The tensors among ``args`` at ``positions`` (an AOTAutograd graph's updated inputs)."""
    return [args[i] for i in positions if i < len(args) and isinstance(args[i], torch.Tensor)]


def _pending_parameters(args: Sequence[Any]) -> bool:
    # Parameters only: a checkpointed block's recomputation gets its input as a
    # detached leaf that requires grad and is pending, which is no update.
    params = [a for a in args if isinstance(a, torch.nn.Parameter)]
    return any(_private.need_materialization(params)) if params else False


def _in_training(args: Sequence[Any]) -> bool:
    """An input other than a parameter requires grad: the caller differentiates through it.

    So a graph compiled without a backward (its forward ran under no_grad) is
    part of a training step: a checkpointed block, whose backward recomputes it.
    """
    return any(isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, torch.nn.Parameter) for a in args)


class _FreshState:
    """Gives the inputs a graph writes into that are still constants buffers of their own, before it reads them.

    State enters the first step as constant IR: buffers an optimizer just
    created (zeros), a 0-d tensor moved to the device with value 0 or 1
    (torch_xla's special scalars: BatchNorm's ``num_batches_tracked``). At
    every later step it is device data, the previous step's output. Embedded
    as constants, it made the first step's graph differ from the second's, so
    the whole step compiled twice; materialized here (one small execution,
    counted as FRESH_STATE_COUNTER, at the first step only), both trace one
    graph. Inputs that are pending with data behind them are this step's work
    and stay pending; constants that are not state (a fresh ``torch.zeros``
    input every step) are never written by the graph and stay constants.

    Checked at the graph's first call where executions are allowed, and not
    after: from then on its state is its own earlier output, and telling
    constants from this step's pending work walks the pending IR (a second
    micro-batch's BatchNorm statistics hold the whole first micro-batch:
    8 ms per ResNet-18 micro-batch, 7,800 tensors created).

    Not for a compiled optimizer step under SPMD (``optimizer_step``): zeros
    executed on their own carry no sharding and come out replicated, every
    device holding all of (e.g.) AdamW's moments of sharded parameters; left
    to the step's execution, the partitioner lays them out as the parameters
    they are computed with. The first step then compiles a graph of its own.
    (An eager optimizer's fresh state gets its parameter's sharding in
    :func:`_create_state`, where the parameter is known.)
    """

    def __init__(self, updated: Optional[tuple[int, ...]], optimizer_step: bool = False) -> None:
        self.updated = updated or ()
        self.optimizer_step = optimizer_step

    def __call__(self, args: Sequence[Any]) -> None:
        if self.updated and _private.execution_allowed():
            updated, self.updated = self.updated, ()
            if self.optimizer_step and xr.is_spmd():
                return
            _materialize_constant(_inputs_at(args, updated))


def _materialize_constant(tensors: Sequence[torch.Tensor]) -> None:
    """Executes those of ``tensors`` whose pending IR is made of constants only, in one execution.

    Not inside ``torch_xla.compile(full_graph=True)``, where no execution is
    allowed (the graphs then differ between first and second step, as before).
    """
    xla = [t for t in tensors if t.device.type == "xla"]
    if not xla or not _private.execution_allowed():
        return
    constants = [
        t for t, pending in zip(xla, _private.need_materialization(xla))
        if pending and not _private.reads_device_data([t])
    ]
    if constants:
        counting.bump(FRESH_STATE_COUNTER)
        grad_sync.sync(constants)


def _before_update(targets: Sequence[torch.Tensor]) -> None:
    """``before_update`` of this backend's graphs: the buffers the step donates are held past its launch
    (:mod:`.in_flight`), and the values they replace kept in case XLA refuses the step (:mod:`.rollback`)."""
    in_flight.keep(targets)
    _current_step().rollback.values(targets, "state written in place")


def _end_step_then(pending: list[torch.Tensor]) -> None:
    """``on_pending`` of a graph that updates its inputs: its work is part of the step, which it ends."""
    end_step()


def _pending_xla_inputs(args: Sequence[Any]) -> list[torch.Tensor]:
    """The XLA tensors among ``args`` that hold pending IR."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "xla"]
    return [t for t, p in zip(tensors, _private.need_materialization(tensors)) if p] if tensors else []


def _compile_upstream_after_cut(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
    """The upstream path for a no-backward graph: the step is cut first, so that upstream's
    own input sync finds nothing left to run."""
    compiled = dynamo_bridge.compile_upstream(gm, example_inputs)

    def run_after_cut(args: list) -> Any:
        end_step()
        return compiled(args)

    return boxed(run_after_cut)


def compilers() -> dict[str, deferred.Compiler]:
    """The forward, backward and inference compilers for one AOTAutograd compilation.

    Invariants: a training forward is computed once per call, in the step's
    one execution, or (after a read between forward and cut was seen) in an
    execution of its own right away; a backward is synced by the step's cut,
    never at the end of its pass; a graph that updates its inputs in place (a
    compiled ``optimizer.step``) makes exactly one :func:`end_step` per call,
    after its own work joined the step (fused) or before it runs (upstream
    path); any other no-backward graph joins a pending step, or, with none
    pending, executes its own outputs (and nothing else) at once; one whose
    inputs carry autograd history opens the step (see :func:`_in_training`).
    """
    register_optimizer_hooks()
    pair = _Pair()

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
        updated = deferred.updated_inputs() or ()
        fresh_state = _FreshState(updated)
        graph = DeferredGraph(
            gm, example_inputs, backend=STEP_BACKEND_NAME, upstream_compiler=dynamo_bridge.compile_upstream,
            on_pending=pair.forward_pending, before_update=_before_update, on_embedded=pair.forward_embedded,
            validate=True,
            unfused_effect="it executes on its own; backward, accumulation and optimizer stay fused",
        )

        def step_forward(args: list) -> Any:
            pair.before_forward(args)
            fresh_state(args)
            written = _inputs_at(args, updated)  # before the call clears args
            outs = graph(args)
            if written and pair.unfused_reason is None:
                _current_step().join(written)  # state the forward writes (BatchNorm's statistics)
            return outs

        return boxed(step_forward)

    def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
        graph = DeferredGraph(
            gm, example_inputs, backend=STEP_BACKEND_NAME, upstream_compiler=dynamo_bridge.compile_upstream,
            kind="backward", upstream_reason=deferred.backward_reason, on_embedded=pair.backward_embedded,
            unfused_effect=deferred.UNFUSED_BACKWARD, validate=True,
        )

        def step_backward(args: list) -> Any:
            pair.before_backward()
            outs = graph(args)
            pair.after_backward()
            return outs

        return boxed(step_backward)

    def inference_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
        common = dict(backend=STEP_BACKEND_NAME, kind="no-backward", validate=True,
                      upstream_compiler=_compile_upstream_after_cut,
                      unfused_effect="the step is synced before it, and it executes on its own")
        updated = deferred.updated_inputs()
        if deferred.updates_inputs(updated):
            update = DeferredGraph(gm, example_inputs, on_pending=_end_step_then, before_update=_before_update,
                                   **common)
            fresh_state = _FreshState(updated, optimizer_step=True)

            def update_state(args: list) -> Any:
                _finish_accumulation()
                fresh_state(args)
                return update(args)

            return boxed(update_state)
        # This call's step (None: outside one) and, outside one, its pending inputs, executed with
        # its outputs (as upstream syncs them before its graph, but in the same execution), so no
        # later read recomputes them.
        call: dict[str, Any] = {"step": None, "pending_inputs": []}

        def join_step_or_sync(pending: list[torch.Tensor]) -> None:
            """``on_pending``: join the call's step, else execute the outputs and pending inputs at once."""
            if call["step"] is None:
                counting.bump(FORWARD_ALONE_COUNTER)
                grad_sync.sync([*pending, *call["pending_inputs"]], fresh=True)
            else:
                call["step"].join(pending)

        graph = DeferredGraph(gm, example_inputs, on_pending=join_step_or_sync, **common)

        def join_step(args: list) -> Any:
            # A graph in training opens the step (a checkpointed block: nothing else pending yet).
            step = call["step"] = _current_step() if _in_training(args) else _open_step()
            call["pending_inputs"] = [] if step is not None else _pending_xla_inputs(args)
            try:
                return graph(args)
            finally:
                call["step"], call["pending_inputs"] = None, []

        return boxed(join_step)

    return dict(fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=inference_compiler)
