"""Deferred graphs: an AOTAutograd graph run as one pending XLA node per call.

A :class:`DeferredGraph` is lowered once per input signature to one XLA
computation and embedded per call as a single lazy IR node
(``_xla_user_computation``), so its outputs are pending, not executed. What
happens to them is the caller's policy, passed in as ``on_pending`` (as
``aot_autograd`` takes its compilers): ``openxla_fused_grad``'s backward hands
them to the end-of-backward sync (:mod:`torch_xla_bridge.grad_sync`), so the
autograd engine's ``.grad`` accumulation lands in the same pending graph;
``openxla_fused_step`` leaves every graph pending until its step is cut
(:mod:`torch_xla_bridge.fused_step`).

Where deferring is impossible (double backward, CPU-fallback ops, in-place
input updates, host reads, torch_xla eager mode) a graph runs through the
unfused path instead (the caller's ``upstream_compiler``, e.g.
:func:`torch_xla_bridge.dynamo_bridge.compile_upstream`), correctly, with one
warning saying why. When to take it for a given call is the caller's
``upstream_reason``. This module imports no other stage of the package.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch_xla

from . import _private, counting, grad_sync, host_scalars
from .names import USER_COMPUTATION_NAME, VALIDATION_COUNTER

log = logging.getLogger(__name__)

Compiler = Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[[list], Any]]

# The unfused path, as the fallback warning names it.
UNFUSED_VIA = " through upstream openxla"
# What the fallback warning says a graph of each kind loses when it runs unfused.
UNFUSED_FORWARD = "it runs as an XLA execution of its own"
UNFUSED_BACKWARD = "gradients correct, but accumulated into .grad outside its execution"


def keep_pending(pending: list[torch.Tensor]) -> None:
    """``on_pending`` that leaves a call's outputs pending (something later syncs them)."""


def write_over(targets: Sequence[torch.Tensor]) -> None:
    """``before_update`` that lets a call write its inputs' new values over their old ones, as they are."""


@dataclasses.dataclass(frozen=True)
class Embedded:
    """One deferred call as it was embedded (what ``on_embedded`` is told).

    ``inputs``: what the computation was given, in its parameters' order;
    ``results``: its results; ``outs``: the graph's outputs (those results,
    or constants); ``written``: each input the call updates in place, with
    the new value it is about to take (one of ``outs``).
    """

    computation: Any
    inputs: Sequence[Any]
    results: Sequence[torch.Tensor]
    outs: Sequence[Any]
    written: Sequence[tuple[torch.Tensor, Any]] = ()


def forget_call(call: Embedded) -> None:
    """``on_embedded`` that keeps no record of a call."""


def eager_mode_reason() -> Optional[str]:
    """``upstream_reason`` of a forward: torch_xla's eager mode executes every op on its own."""
    if _private.is_eager_mode():
        return "torch_xla eager mode executes every op on its own"
    return None


def backward_reason() -> Optional[str]:
    """``upstream_reason`` of a backward: a pass that builds a graph, or eager mode."""
    if torch.is_grad_enabled() or _private.in_aot_double_backward():
        return "the backward pass builds a graph (create_graph=True)"
    if _private.is_eager_mode():
        return "torch_xla eager mode executes every accumulation on its own"
    return None


def off_device_reason(example_inputs: Sequence[Any]) -> Optional[str]:
    """Why a graph with inputs off the XLA device cannot be deferred, if it has any.

    0-dim CPU tensors (optimizer step counts, a tensor ``lr``) are host
    scalars, read as device data (:mod:`torch_xla_bridge.host_scalars`).
    """
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "xla" and not host_scalars.is_host_scalar(t):
            return (
                f"an input (shape {tuple(t.shape)}) is on {t.device}, not on an XLA device; move inputs "
                f"with `x.to(torch_xla.device())` to fuse it"
            )
    return None


def updated_inputs() -> Optional[tuple[int, ...]]:
    """While AOTAutograd compiles a graph: the positions of the inputs it writes into, None if unknown.

    Read from AOTAutograd's metadata for the graph being compiled.
    """
    meta = _private.aot_fw_metadata()
    if meta is None:
        return None
    return tuple(i for i, info in enumerate(meta.input_info) if info.mutates_data)


def updates_inputs(updated: Optional[tuple[int, ...]]) -> bool:
    """Whether an inference graph writes into one of its inputs (where unknown, assume it does).

    Such a graph is an optimizer step (it writes parameters and optimizer
    state) or another update of state (a cache's ``index_copy_``), which ends
    the step as upstream's execution would.
    """
    return updated is None or bool(updated)


class DeferredGraph:
    """Runs an AOTAutograd graph as one pending XLA node per call.

    Invariants: a given input signature is lowered at most once (the cache key
    is shapes, dtypes and non-tensor values; a graph whose example inputs are
    all static has one signature, so its key is empty); a call either embeds
    the graph, hands its pending outputs to ``on_pending`` and executes
    nothing else, or (when the graph cannot be lowered, or ``upstream_reason``
    gives a reason for this call) runs it through ``upstream_compiler``'s
    function, after one warning per graph saying why.

    ``before_update``: called with the inputs a deferred call updates in
    place, before their new values are written (the caller may keep their
    old buffers, which the step's execution donates).

    ``on_embedded``: called with each deferred call (:class:`Embedded`),
    before any input is written back, and for a backward after a zero-filled
    ``.grad`` was set aside (the caller may record the call, e.g. to fold the
    calls of several micro-batches into one loop).

    ``validate``: compile a new lowering whose inputs mix floating-point
    dtypes on its own at its first call (see :meth:`_validate`), for deferred
    work that runs inside a larger execution.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        backend: str,
        upstream_compiler: Compiler,
        kind: str = "forward",
        on_pending: Callable[[list[torch.Tensor]], None] = keep_pending,
        before_update: Callable[[Sequence[torch.Tensor]], None] = write_over,
        on_embedded: Callable[[Embedded], None] = forget_call,
        upstream_reason: Callable[[], Optional[str]] = eager_mode_reason,
        unfused_effect: str = UNFUSED_FORWARD,
        validate: bool = False,
    ) -> None:
        # Inputs the graph updates in place (AOTAutograd's trailing copy_ into an input, kept in
        # the graph): lowered as its last outputs, each written back into its input per call.
        self.gm, self._updated_positions = _updates_as_outputs(gm)
        self.example_inputs = example_inputs
        self.backend = backend
        self.kind = kind
        self.on_pending = on_pending
        self.before_update = before_update
        self.on_embedded = on_embedded
        self.upstream_reason = upstream_reason
        self.upstream_compiler = upstream_compiler
        self.unfused_effect = unfused_effect
        self.validate = validate
        self._signature = _static_signature if _is_static(example_inputs) else _full_signature
        # Per signature: the lowered graph, or why it cannot be lowered (so the
        # probe runs once per signature, not once per call).
        self._lowered: dict[_Signature, Union[_LoweredGraph, str]] = {}
        self._upstream: Optional[Callable[[list], Any]] = None
        # The nodes the probe found running through the CPU fallback, by name, for
        # upstream's partitioner to take instead of running the graph again to find them.
        self._fallback_nodes: Optional[frozenset[str]] = None
        # A graph with CPU outputs (a compiled optimizer's step counts): those come from the host.
        split = host_scalars.split(self.gm)
        self._split = split if isinstance(split, host_scalars.HostSplit) else None
        # What is lowered: the graph without its host outputs.
        self._device_gm = self._split.device_gm if self._split else self.gm
        self._static_reason = (
            off_device_reason(example_inputs) or (split if isinstance(split, str) else None)
            or _unfusable_graph_reason(self._device_gm)
        )
        self._random = _draws_random_numbers(self._device_gm)
        self._warned = False
        # AOTAutograd's calling convention: one list argument that we may clear.
        # An instance attribute, so that dynamo's `disable` wrapper copies it.
        self._boxed_call = True

    def __call__(self, args: list) -> Any:
        if not self._updated_positions:
            return self._call(args)
        # The updated inputs, before a call clears ``args``.
        targets = [args[i] for i in self._updated_positions]
        outs = list(self._call(args, targets))
        return outs[:len(outs) - len(targets)]

    def _call(self, args: list, targets: Sequence[torch.Tensor] = ()) -> Any:
        reason = self._static_reason or self.upstream_reason()
        if reason is None:
            key = self._signature(args)
            lowered = self._lowered.get(key)
            new = lowered is None
            if new:
                lowered = self._lowered[key] = self._lower(args)
            if isinstance(lowered, str):
                reason = lowered
            else:
                host = self._split.host_values(args) if self._split else None
                outs, pending, inputs = lowered(args)
                # Inside torch_xla.compile(full_graph=True) even compiling on its own counts as an
                # execution: the function's sync compiles the graph, and raises there.
                if new and self.validate and _mixed_float_dtypes(args) and _private.execution_allowed():
                    self._validate(key, pending, args)
                args.clear()
                if self.kind == "backward":
                    grad_sync.store_like_a_first_gradient(outs)
                if self._split:
                    outs = self._split.merge(outs, host)
                self.on_embedded(Embedded(
                    lowered.computation, inputs, pending, outs, tuple(zip(targets, outs[len(outs) - len(targets):])),
                ))
                del inputs
                self.before_update(targets)
                _write_back(targets, outs[len(outs) - len(targets):], in_place=True)
                self.on_pending(pending)
                return outs
        outs = self._run_upstream(args, reason)
        # Unfused: copied back after its execution, as AOTAutograd would have.
        _write_back(targets, outs[len(outs) - len(targets):], in_place=False)
        return outs

    def _validate(self, key: _Signature, pending: list[torch.Tensor], args: Sequence[Any]) -> None:
        """Compiles this call's pending outputs without executing them; raises what XLA rejects.

        Deferred work runs later, inside an execution that also updates
        parameters, ``.grad`` and optimizer state; torch_xla drops the IR of
        every tensor it syncs before compiling, so a graph rejected there
        would leave them without values. What XLA rejects in a graph that
        dynamo and AOTAutograd traced is mixed precision that torch_xla
        lowers without converting (an f64 batch into an f32 model: XLA's HLO
        verifier refuses the dot), so only a lowering whose inputs mix
        floating-point dtypes is compiled on its own first (once per input
        signature, at warm-up): it raises at this call instead, with nothing
        else changed; the signature is not cached, so a corrected input goes
        on training. Compiling every lowering that way doubled the compile
        time of a first step (measured: 9.5 s against 4.0 s of XLA compile
        time for a 16-layer MLP with AdamW) for graphs with one dtype, which
        XLA compiles as the step's whole execution anyway.
        """
        counting.bump(VALIDATION_COUNTER)
        try:
            _private.warm_up_cache(pending, [])
        except Exception as e:
            del self._lowered[key]
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in args if isinstance(a, torch.Tensor))
            raise RuntimeError(
                f"{self.backend}: XLA cannot compile this {self.kind} graph for its inputs ({shapes}): {e}\n"
                f"Check the inputs' dtypes and shapes against the model's (e.g. `x.float()` for an f32 "
                f"model). Nothing ran: parameters, .grad and optimizer state are as before this call."
            ) from e

    def _run_upstream(self, args: list, reason: str) -> Any:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.backend}: this {self.kind} graph runs unfused{UNFUSED_VIA} ({self.unfused_effect}): {reason}"
            )
        if self._upstream is None:
            # Upstream's bridge partitions the graph module in place; keep ours
            # pristine for lowering later calls (e.g. after one create_graph=True pass).
            self._upstream = self.upstream_compiler(copy.deepcopy(self.gm), self.example_inputs)
        if self._fallback_nodes is not None:
            # Its first call partitions the graph (upstream compiles on first call).
            known, self._fallback_nodes = self._fallback_nodes, None
            with _private.upstream_unsupported_nodes(known):
                return self._upstream(args)
        return self._upstream(args)

    def _lower(self, args: Sequence[Any]) -> Union[_LoweredGraph, str]:
        """Lowers the graph for the signature of ``args``, or returns why it cannot be."""
        reason = self._probe(args)
        if reason is not None:
            return reason
        # Random ops derive their seeds from the device's base seed (not the running
        # one); its device data handle identifies the parameter it becomes.
        seed_at_trace = (
            _private.buffer_handles([_private.base_seed_tensor(str(torch_xla.device()))])[0] if self._random else 0
        )
        with torch.no_grad(), _private.eager_mode_context(False):
            placeholders, packs = _placeholders(args)
            traced = self._device_gm(*_fresh_handles(placeholders))
            traced = list(traced) if isinstance(traced, (list, tuple)) else [traced]
            out_tensors: list[torch.Tensor] = []
            outputs: list[tuple[bool, Any]] = []
            for o in traced:
                if isinstance(o, torch.Tensor):
                    outputs.append((True, len(out_tensors)))
                    out_tensors.append(o)
                else:
                    outputs.append((False, o))
            ctx = _private.LoweringContext("FusedGradGraph")
            ctx.build(out_tensors)
            computation = _private.computation_from_module_proto(USER_COMPUTATION_NAME, ctx.hlo())
            # Every device-data leaf of the traced graph is an HLO parameter:
            # our placeholders, and constants the trace created (hoisted).
            params = ctx.device_parameter_id_tensor_mapping()
            sources: list[Union[int, torch.Tensor, None]] = [None] * len(params)
            for i, p in enumerate(placeholders):
                if isinstance(p, torch.Tensor):
                    pid = ctx.tensor_parameter_id(p)
                    if pid >= 0:
                        sources[pid] = i
            for pack in packs:
                pid = ctx.tensor_parameter_id(pack.placeholder)
                if pid >= 0:
                    sources[pid] = pack.source
            for pid, t in params.items():
                if sources[pid] is None:
                    sources[pid] = t
            seed = None
            if self._random:
                pid = _seed_parameter(params, sources, seed_at_trace)
                if pid is None:
                    return "it draws random numbers, and the seed they draw from was not found among its parameters"
                seed = (pid, str(params[pid].device))
        log.debug(
            "lowered %s graph: %d parameters (%d hoisted constants), %d outputs",
            self.kind,
            len(sources),
            sum(not isinstance(s, int) for s in sources),
            len(out_tensors),
        )
        donors = tuple(
            i for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.device.type == "xla" and _private.get_buffer_donation(a)
        )
        return _LoweredGraph(computation, tuple(sources), tuple(outputs), seed, donors)

    def _probe(self, args: Sequence[Any]) -> Optional[str]:
        """Traces the graph once on the real inputs; returns why it cannot be lowered, if so.

        Placeholder tensors hold no data, and an op that needs data (a CPU
        fallback, a host read) would abort the process on them, so this
        lazy trace on real data must come first. It executes nothing unless
        such an op is present.
        """
        fallbacks_before = counting.fallback_counts()
        # Executions are recorded when they finish: let earlier asynchronous
        # ones land first, or they would be counted as ours.
        executions_before = counting.executions(wait=True)
        with torch.no_grad(), _private.eager_mode_context(False):
            # Fresh handles only where needed: syncing a clone allocates a buffer of its own,
            # so an op that reads its data (a CPU fallback) would execute a copy first.
            # Host scalars as device values, as the lowered graph reads them.
            args = [a.to(torch_xla.device()) if host_scalars.is_host_scalar(a) else a for a in args]
            outs = self._device_gm(*(_fresh_handles(args) if _writes_into_inputs(self._device_gm) else args))
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        del outs
        fallbacks = sorted(op for op, n in counting.fallback_counts().items() if n > fallbacks_before.get(op, 0))
        if fallbacks:
            self._fallback_nodes = _nodes_running(self.gm, fallbacks)
            return f"it contains ops without an XLA lowering (CPU fallback): {', '.join(fallbacks)}"
        if counting.executions(wait=False) != executions_before:
            return "it reads tensor values on the host while tracing"
        non_xla = [o for o in flat if isinstance(o, torch.Tensor) and o.device.type != "xla"]
        if non_xla:
            return f"it produces a tensor on {non_xla[0].device}"
        return None


def _updates_as_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, tuple[int, ...]]:
    """``gm`` with its in-place updates of inputs moved out, and the positions of the inputs they update.

    An update is AOTAutograd's ``copy_(input, new value)`` that ends a graph
    compiled with ``keep_inference_input_mutations``; a read of its result
    (the graph returns the input) reads the new value. The returned graph
    computes the same and returns each new value
    after its own outputs, in the order of the positions; the caller writes
    them back (AOTAutograd copies whole values of the same shape and dtype).
    ``gm`` itself where it has none.
    """
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    copies = [
        n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
        if _input_behind(n.args[0]) in placeholders
    ]
    if not copies:
        return gm, ()
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    by_name = {n.name: n for n in new.graph.nodes}
    output = new.graph.output_node()
    values = [by_name[n.args[1].name] for n in copies]
    for n in copies:
        # A graph that returns the updated input (``a += 1; return a``) returns its new value.
        by_name[n.name].replace_all_uses_with(by_name[n.args[1].name])
    (outs,) = output.args
    output.args = ((*outs, *values),)
    for n in copies:
        new.graph.erase_node(by_name[n.name])
    new.recompile()
    return new, tuple(placeholders[_input_behind(n.args[0])] for n in copies)


def _input_behind(node: Any) -> Any:
    """The node whose tensor ``node`` is: through ops that return their first argument itself
    (``xla::dynamo_set_buffer_donor_``, which marks an input for donation)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RETURNS_ITS_INPUT:
        node = node.args[0]
    return node


# Ops that return their first argument itself (their schema does not say so).
_RETURNS_ITS_INPUT = frozenset({torch.ops.xla.dynamo_set_buffer_donor_.default})


def _write_back(targets: Sequence[torch.Tensor], values: Sequence[Any], in_place: bool) -> None:
    """Writes each new value into its target. ``in_place``: an XLA target takes its pending value as
    an in-place update would (no op), so the step's execution donates the target's buffer to it;
    otherwise, and for a host scalar (a CPU step count), the value is copied."""
    for target, value in zip(targets, values):
        if in_place and target.device.type == "xla":
            _private.update_in_place(target, value)
        else:
            with torch.no_grad():
                target.detach().copy_(value)


def _nodes_running(gm: torch.fx.GraphModule, ops: Sequence[str]) -> Optional[frozenset[str]]:
    """The names of ``gm``'s nodes that call one of ``ops`` (``aten::name``); None unless each op has one.

    An op that ran through the fallback without a node of its own (called
    by another op's lowering) leaves the nodes to upstream's collector.
    """
    found = {
        n.name: n.target.name() for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.name() in ops
    }
    return frozenset(found) if set(found.values()) == set(ops) else None


@dataclasses.dataclass(frozen=True)
class _LoweredGraph:
    """One graph lowered for one input signature.

    ``sources[k]`` feeds HLO parameter ``k``: an index into the runtime
    arguments, host scalars packed into one vector (:class:`_Packed`), or a
    constant tensor the lowering hoisted into a parameter.
    ``outputs[j]`` is an index into the computation's results, or the
    graph's non-tensor output itself (``None``, a Python number).
    ``seed``: for a graph that draws random numbers, the parameter that takes
    the device's RNG seed, and that device; fed a fresh seed on every call.
    ``donors``: the runtime arguments whose buffers were marked for donation
    when it was lowered (by the user, or by the graph's own
    ``torch.ops.xla.dynamo_set_buffer_donor_``, which the lowered computation
    never runs again); marked again on every call, as upstream's cached graph
    donates them on every call. Otherwise the execution after the first, whose
    donation cleared the mark, would key a second compilation on its absence.
    """

    computation: Any
    sources: tuple[Union[int, _Packed, torch.Tensor], ...]
    outputs: tuple[tuple[bool, Any], ...]
    seed: Optional[tuple[int, str]] = None
    donors: tuple[int, ...] = ()

    def __call__(self, args: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
        """Embeds one call: the graph's outputs, the computation's results and the inputs it was given."""
        for i in self.donors:
            if not _private.get_buffer_donation(args[i]):
                _private.set_buffer_donation(args[i], True)  # False, and no mark, for a pending tensor
        inputs = [args[s] if type(s) is int else s.value(args) if type(s) is _Packed else s for s in self.sources]
        if self.seed is not None:
            inputs[self.seed[0]] = _next_seed(self.seed[1])
        results = _private.user_computation(USER_COMPUTATION_NAME, inputs, self.computation)
        outs = [results[v] if is_tensor else v for is_tensor, v in self.outputs]
        return outs, results, inputs


@dataclasses.dataclass(frozen=True)
class _Packed:
    """An HLO parameter fed by the host scalars at ``positions`` of the runtime arguments (one dtype).

    Stacked on the host and transferred as one vector: one transfer per call
    and dtype, not one per scalar (a compiled AdamW has a step count per
    parameter).
    """

    positions: tuple[int, ...]
    device: str

    def value(self, args: Sequence[Any]) -> torch.Tensor:
        return torch.stack([args[i] for i in self.positions]).to(self.device)


@dataclasses.dataclass(frozen=True)
class _Pack:
    """At lowering: the placeholder vector standing for a :class:`_Packed` group."""

    placeholder: torch.Tensor
    source: _Packed


def _placeholders(args: Sequence[Any]) -> tuple[list[Any], list[_Pack]]:
    """Data-less device tensors standing for ``args`` while lowering, and the host-scalar packs among them.

    Each tensor gets a placeholder of its shape and dtype, except host scalars
    (:func:`host_scalars.is_host_scalar`): those of one dtype become elements
    of one placeholder vector, so the lowered graph reads them as data.
    """
    placeholders = [
        None if host_scalars.is_host_scalar(a) else
        _private.create_placeholder_tensor(a.shape, a.dtype) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, a in enumerate(args):
        if host_scalars.is_host_scalar(a):
            by_dtype.setdefault(a.dtype, []).append(i)
    device = str(torch_xla.device())
    packs = []
    for dtype, positions in by_dtype.items():
        vector = _private.create_placeholder_tensor((len(positions),), dtype)
        for j, i in enumerate(positions):
            placeholders[i] = vector[j]
        packs.append(_Pack(vector, _Packed(tuple(positions), device)))
    return placeholders, packs


def _mixed_float_dtypes(args: Sequence[Any]) -> bool:
    """Whether the tensors among ``args`` have more than one floating-point dtype (see ``_validate``)."""
    return len({a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point}) > 1


def _next_seed(device: str) -> torch.Tensor:
    """The device's RNG seed as a tensor; advances the RNG state, as upstream's bridge does per call."""
    seed = _private.base_seed_tensor(device)
    _private.advance_rng_seed(device)
    return seed


def _seed_parameter(params: dict[int, torch.Tensor], sources: Sequence[Any], seed_at_trace: int) -> Optional[int]:
    """The hoisted parameter that holds the RNG seed the trace drew from, if exactly one does.

    Random ops derive their seeds from one 0-dim int64 device-data value, the
    device's base seed when they were traced. It is found by its device data
    handle (``seed_at_trace``), not by its value: reading values back would
    be a transfer from the device, which upstream's bridge never makes when
    it seeds a graph (its tests assert that).
    """
    found = [
        pid for pid, t in params.items()
        if type(sources[pid]) is not int and t.dtype == torch.int64 and t.dim() == 0
        and _private.buffer_handles([t])[0] == seed_at_trace
    ]
    return found[0] if len(found) == 1 else None


_Signature = tuple[Any, ...]


def _full_signature(args: Sequence[Any]) -> _Signature:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)


def _static_signature(args: Sequence[Any]) -> _Signature:
    return ()


def _is_static(example_inputs: Sequence[Any]) -> bool:
    """True if AOTAutograd can only ever call the graph with the traced shapes and dtypes."""
    for a in example_inputs:
        if isinstance(a, torch.Tensor):
            if any(not isinstance(d, int) for d in a.shape):
                return False
        elif not isinstance(a, (int, float, bool, type(None))):  # a SymInt, SymFloat, ...
            return False
    return True


def _fresh_handles(args: Sequence[Any]) -> list[Any]:
    """``args`` with each tensor replaced by a new tensor on the same data (no op, no execution).

    torch_xla's ``aten.copy`` (the functional op AOTAutograd writes for
    ``copy_``) updates its first argument in place. Tracing a graph on the
    caller's tensors would then change them: a real input would take the
    copied value (the probe), and a placeholder would hold IR instead of its
    data, so the lowering could not map it to its HLO parameter and would
    feed the empty placeholder as a constant (a crash inside PJRT's execute).
    """
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _writes_into_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether tracing ``gm`` would update its arguments (see :func:`_fresh_handles`)."""
    return bool(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default))


def _draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    return any(
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
        for node in gm.graph.nodes
    )


def _unfusable_graph_reason(gm: torch.fx.GraphModule) -> Optional[str]:
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._schema.is_mutable:
            return f"it updates a tensor in place ({node.target})"
        if node.target is torch.ops.aten._local_scalar_dense.default:
            return f"it reads a tensor value on the host ({node.target})"
    return None
