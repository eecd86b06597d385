"""What a pending step changes, kept so that a step XLA refuses leaves the training state as it was.

Until a step's execution runs, every tensor it writes (parameters, ``.grad``,
optimizer state, buffers a forward updates) holds pending IR, and its value
before the step lives only as a device buffer inside that IR. If XLA refuses
the step (out of memory while compiling or preparing the program, or any
error raised before the execution consumed its inputs), those tensors would
keep the IR of a program that cannot run: every later read or step would run
it again. So a :class:`Record` keeps, per pending step, the value each written
tensor had when the step first wrote it (its inner lazy tensor: the same
buffer, no copy, still donated by the step's execution), and
:meth:`Record.restore` puts them back where the step's cut fails.

Invariants: a record lives on its step and dies with it at the step barrier;
it holds the written tensors weakly and their old values strongly; only
values with no pending IR are held (a held pending value would be one more
output of the step), and one is put back only if no execution launched since
it was kept (that execution may have donated its buffer).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from . import _private, counting, grad_sync, names, program_memory

log = logging.getLogger(__name__)

# XLA's and PJRT's words for a program that does not fit in device memory.
_OUT_OF_MEMORY = re.compile(r"out of memory|RESOURCE_EXHAUSTED|Resource exhausted", re.IGNORECASE)
_BYTES = re.compile(r"allocating (\d+) bytes")


@dataclasses.dataclass
class _Value:
    """A tensor's value before the step: ``inner`` (no pending IR), kept after ``launches`` launches."""

    tensor: weakref.ref[torch.Tensor]
    inner: torch.Tensor
    launches: int


@dataclasses.dataclass
class _Grad:
    """A parameter's ``.grad`` before the step: the tensor it held (None for none) and, if it held one
    with no pending IR, that tensor's value."""

    param: weakref.ref[torch.Tensor]
    grad: Optional[torch.Tensor]
    value: Optional[_Value]
    # It held pending zeros (``zero_grad(set_to_none=False)``): made again, not kept.
    zeros: bool = False


class Record:
    """The values a pending step's writes replace, first write per tensor (by identity)."""

    __slots__ = ("_values", "_grads", "_states", "_rng", "_unkept")

    def __init__(self, rng: bool = True) -> None:
        """``rng``: also keep the RNG seed now (where the record begins with the step's first forward)."""
        self._values: dict[int, _Value] = {}
        self._grads: dict[int, _Grad] = {}
        # Optimizer state per parameter that had none when the step began (its first step creates it).
        self._states: list[tuple[weakref.ref[torch.optim.Optimizer], weakref.ref[torch.Tensor]]] = []
        self._rng: Optional[int] = _private.rng_seed() if rng and _private.runtime_initialized() else None
        self._unkept: set[str] = set()

    def _value(self, t: torch.Tensor, pending: bool) -> Optional[_Value]:
        if pending:
            return None
        return _Value(weakref.ref(t), _private.inner_value(t), counting.step_launches())

    def values(self, tensors: Iterable[torch.Tensor], what: str) -> None:
        """Keeps the current values of ``tensors`` (XLA ones, first time each), about to be written in place."""
        new = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_xla and id(t) not in self._values]
        if not new:
            return
        for t, pending in zip(new, _private.need_materialization([_private.inner_value(t) for t in new])):
            kept = self._value(t, pending)
            if kept is None:
                self._unkept.add(what)
            else:
                self._values[id(t)] = kept

    def grads(self, params: Iterable[torch.Tensor]) -> None:
        """Keeps the ``.grad`` of ``params`` (XLA leaves that require grad, first time each), before a backward."""
        new = [p for p in params if isinstance(p, torch.Tensor) and p.is_xla and p.requires_grad and p.is_leaf
               and id(p) not in self._grads]
        if not new:
            return
        with_grad = [p for p in new if p.grad is not None]
        pending = dict(zip(map(id, with_grad),
                           _private.need_materialization([_private.inner_value(p.grad) for p in with_grad])))
        pending_grads = [p.grad for p in with_grad if pending[id(p)]]
        zero_fill = dict(zip(map(id, pending_grads), grad_sync.zero_fills(pending_grads)))
        for p in new:
            value = None if p.grad is None else self._value(p.grad, pending[id(p)])
            zeros = zero_fill.get(id(p.grad), False)
            if p.grad is not None and value is None and not zeros:
                self._unkept.add(".grad")
            self._grads[id(p)] = _Grad(weakref.ref(p), p.grad, value, zeros)

    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before an optimizer's step: its parameters and state, and which parameters have no state yet."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.values(params, "parameters")
        for p in params:
            state = optimizer.state.get(p)
            if state:
                self.values([t for t in state.values() if isinstance(t, torch.Tensor)], "optimizer state")
            elif p.grad is not None:
                self._states.append((weakref.ref(optimizer), weakref.ref(p)))

    def written(self) -> list[torch.Tensor]:
        """The tensors the step wrote that are alive (their values now are the step's)."""
        written = [t for t in (v.tensor() for v in self._values.values()) if t is not None]
        written += [p.grad for p in (g.param() for g in self._grads.values()) if p is not None and p.grad is not None]
        return written

    def kept(self) -> str:
        """What this record puts back, for the error."""
        if self._rng is not None:
            return "the parameters, .grad, optimizer state, buffers and RNG state"
        return ("the parameters, .grad and optimizer state (not what a forward that executed on its own "
                "wrote: BatchNorm statistics, the RNG seed it drew)")

    def restore(self, launches: int) -> list[str]:
        """Puts every kept value back, where the refused execution was the first after ``launches``
        launches; returns what could not be put back (kinds of state, for the error)."""
        lost = set(self._unkept)
        back: list[torch.Tensor] = []
        for kept in self._values.values():
            t = kept.tensor()
            if t is None:
                continue
            if kept.launches != launches:
                lost.add("tensors written before an earlier execution of the step")
                continue
            _private.restore_value(t, kept.inner)
            back.append(t)
        for g in self._grads.values():
            p = g.param()
            if p is None:
                continue
            if g.zeros:
                p.grad = g.grad
                _private.restore_value(g.grad, _private.inner_value(torch.zeros_like(g.grad)))
                back.append(g.grad)
                continue
            if g.grad is not None and g.value is None:
                # Its pending value (not zeros) cannot be kept without making it an output of the step.
                p.grad = None
                continue
            if g.value is not None and g.value.launches != launches:
                lost.add(".grad")
                continue
            p.grad = g.grad
            if g.grad is not None:
                _private.restore_value(g.grad, g.value.inner)
                back.append(g.grad)
        for opt_ref, p_ref in self._states:
            optimizer, p = opt_ref(), p_ref()
            if optimizer is not None and p is not None:
                optimizer.state.pop(p, None)
        _private.settle(back)
        if self._rng is not None:
            _private.set_rng_seed(self._rng)
        return sorted(lost)


def guarded(sync: Callable[[], None], written: Callable[[], Sequence[torch.Tensor]],
            refused: Callable[[RuntimeError, int, bool], None]) -> None:
    """Runs ``sync``; where XLA refuses it, calls ``refused(error, launches before it, compiled)`` (which raises).

    Refused as it compiles (XLA:TPU's out of memory), ``sync`` raises
    (``compiled`` False: everything still holds its IR). Refused as its
    execution is prepared (PJRT allocates the program's buffers then, after the
    asynchronous launch; what it writes then holds the error), ``sync``
    returns: so the first execution of a program it compiled is waited for
    and checked on ``written()`` (``compiled`` True; not under SPMD, see
    :func:`first_execution_error`); a program run before is not, and the step
    stays asynchronous.
    """
    compiles, launches = counting.counter(names.UNCACHED_COMPILE_COUNTER), counting.step_launches()
    try:
        sync()
    except RuntimeError as error:
        refused(error, launches, False)
        raise
    if counting.counter(names.UNCACHED_COMPILE_COUNTER) > compiles:
        error = first_execution_error(written())
        if error is not None:
            refused(error, launches, True)


def first_execution_error(tensors: Sequence[torch.Tensor]) -> Optional[RuntimeError]:
    """The error the execution that wrote ``tensors`` failed with, if it failed: waits for the device, then
    reads the smallest of them (a transfer, no execution).

    PJRT allocates a program's buffers as it prepares an execution, after the
    asynchronous launch, so a program that does not fit fails there and its
    outputs hold the error. For a program's first execution only: the wait
    costs the step's asynchrony.
    """
    if not tensors or xr.is_spmd():
        # Under SPMD torch_xla 2.9 crashes the process reading a buffer whose execution failed (a segfault
        # in .cpu() and _get_local_shards alike), so nothing is read there: XLA:TPU refuses a program too
        # big as it compiles it, which the sync raises.
        return None
    xm.wait_device_ops()
    try:
        min(tensors, key=torch.Tensor.numel).detach().to("cpu")
    except RuntimeError as error:
        return error
    return None


def drop_refused_outputs() -> int:
    """Every live tensor whose pending IR calls a graph of this package takes NaN (float) or 0 as its value.

    Where XLA refuses a step as it compiles it, nothing ran, so the step's
    other results (its loss, a sum of losses, a loss divided by K) still hold
    the step's IR: kept alive (by a caught exception's traceback, a list of
    losses, a notebook's last traceback) the next step barrier would compile
    them, and fail, again. Called only then, after the state is put back: it
    walks the garbage collector's objects once. Returns how many were dropped.
    """
    live = [t for t in _private.live_objects(torch.Tensor) if t.is_xla]
    if not live:
        return 0
    inner = [_private.inner_value(t) for t in live]
    pending = [t for t, i, p in zip(live, inner, _private.need_materialization(inner)) if p]
    refused = [t for t in pending if names.USER_COMPUTATION_NAME in _private.ir_text([_private.inner_value(t)])]
    for t in refused:
        fill = float("nan") if t.dtype.is_floating_point or t.dtype.is_complex else 0
        _private.restore_value(t, _private.inner_value(torch.full_like(t.detach(), fill)))
    _private.settle(refused)
    return len(refused)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether XLA's error says the program does not fit in device memory."""
    return bool(_OUT_OF_MEMORY.search(str(error)))


def refused_step_error(error: RuntimeError, backend: str, kept: str, lost: list[str], compiled: bool) -> RuntimeError:
    """The error a refused step raises: what happened, how much memory its program needs, what was put back,
    what to try, XLA's own message.

    Out of memory, it holds " out of memory." as CUDA's does, so that tools that retry at a smaller
    batch (accelerate's ``find_executable_batch_size``, Trainer's ``auto_find_batch_size``) see it.
    ``compiled``: the refused program compiled (refused as its execution was prepared), so XLA's
    accounting of it is the last in torch_xla's analysis file, where there is one
    (:mod:`.program_memory`); refused as it compiles, XLA's own message says what it needs.
    """
    state = (f"{kept} are as they were before the step" if not lost
             else f"{kept} are as they were before the step, except {', '.join(lost)} (see docs/guide.md)")
    if is_out_of_memory(error):
        needed = _BYTES.search(str(error))
        size = f" (XLA tried to allocate {int(needed[1]) / 2**30:.1f} GiB)" if needed else ""
        program = program_memory.last_compiled() if compiled else None
        if program is not None:
            analysis = f" XLA's accounting of the step's program: {program.describe()}."
        elif compiled:
            analysis = (" For XLA's accounting of the program's memory, set PT_XLA_DEBUG_LEVEL=1 and "
                        "PT_XLA_DEBUG_FILE before torch_xla starts (or run under python -m torch_xla_bridge.explain).")
        else:
            analysis = ""
        head = (f"{backend}: the training step ran out of memory. XLA refused it while compiling or preparing "
                f"it{size}: nothing of it ran, and {state}.{analysis} Try a smaller batch, gradient accumulation, "
                f"activation checkpointing, or sharding the step over more devices.")
    else:
        head = f"{backend}: XLA refused the training step before running it; nothing of it ran, and {state}."
    return RuntimeError(f"{head}\nXLA said: {error}")
