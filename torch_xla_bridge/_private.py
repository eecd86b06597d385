"""Every private torch and torch_xla API the package relies on: one place, checked at import.

The package is written against torch and torch_xla as pinned in
:mod:`torch_xla_bridge.names`. Their underscored APIs can change in any
release, so each one is bound here (and nowhere else), and a missing one
fails this module's import with an ImportError naming the version the
package needs, instead of failing mid-training with an AttributeError.

torch's extension points for compilers (``torch._decomp``'s decompositions in
``decompositions.py``, ``torch._ops.OpOverload`` as the type of a graph's ops,
``torch._dynamo.backends``) are used where they are, as torch's own backends
use them; this module holds the rest.

Imported when a graph is compiled, never by registration (``backend.py``
imports it lazily): torch_xla reads its environment variables when first
imported. torch_xla missing is no error here; ``backend.require_torch_xla``
reports it, naming the install command.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch._functorch._aot_autograd.runtime_wrappers as _aot_runtime
import torch.utils._python_dispatch  # noqa: F401  (bound below)
from torch._dynamo import compiled_autograd as _compiled_autograd

from .names import TORCH_VERSION, TORCH_XLA_INSTALL, TORCH_XLA_VERSION


def _missing(owner: str, version: str, found: str, what: str) -> ImportError:
    return ImportError(
        f"torch_xla_bridge needs {owner}=={version} (found {found}): {what}. "
        f"Install the pinned releases: `pip install torch=={TORCH_VERSION}` and `{TORCH_XLA_INSTALL}`."
    )


def _bind(owner_name: str, version: str, found: str, obj: Any, path: str) -> Any:
    """``obj.<path>`` (dotted), or an ImportError naming the release it is written against."""
    for part in path.split("."):
        if not hasattr(obj, part):
            raise _missing(owner_name, version, found, f"{path} is missing")
        obj = getattr(obj, part)
    return obj


def _torch(path: str, obj: Any = torch) -> Any:
    return _bind("torch", TORCH_VERSION, torch.__version__, obj, path)


# --- torch: the autograd engine -----------------------------------------------

AccumulateGrad: type = _torch("_C._functions.AccumulateGrad")
current_graph_task_id: Callable[[], int] = _torch("_C._current_graph_task_id")
current_autograd_node: Callable[[], Optional[torch.autograd.graph.Node]] = _torch("_C._current_autograd_node")
# Inside a backward pass: whether the engine runs this node in it (an AccumulateGrad node
# does not under torch.autograd.grad, nor for leaves left out of backward(inputs=...)).
will_engine_execute_node: Callable[[torch.autograd.graph.Node], bool] = _torch("_C._will_engine_execute_node")
queue_engine_callback: Callable[[Callable[[], None]], None] = _torch("autograd.Variable._execution_engine.queue_callback")


# --- torch: dispatch modes ---------------------------------------------------------

# A mode sees each aten op below autograd (replay's host tape records host math on tensor hyperparameters).
TorchDispatchMode: type = _torch("utils._python_dispatch.TorchDispatchMode")

_T = TypeVar("_T")


def live_objects(cls: type[_T]) -> list[_T]:
    """Every object the garbage collector tracks that is a ``cls`` (walks all of them: not for a hot path).

    Weak proxies are left out: ``isinstance`` sees through one, and its referent may die before it is
    read (a ReferenceError, seen depending on test order). ``isinstance`` on some objects warns (a
    deprecated alias's ``__class__``, e.g. ``torch.distributed.reduce_op``): silenced, as the walk is ours.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if type(o) not in weakref.ProxyTypes and isinstance(o, cls)]


# --- torch: functionalization (torch_xla's tensors are functional wrappers) --------

_is_functional: Callable[[torch.Tensor], bool] = _torch("_is_functional_tensor")
_from_functional: Callable[[torch.Tensor], torch.Tensor] = _torch("_from_functional_tensor")
_functionalize_replace: Callable[[torch.Tensor, torch.Tensor], None] = _torch("_functionalize_replace")
_functionalize_commit_update: Callable[[torch.Tensor], None] = _torch("_functionalize_commit_update")
_propagate_xla_data: Callable[[torch.Tensor, torch.Tensor], None] = _torch("_propagate_xla_data")
_functionalize_sync: Callable[[torch.Tensor], None] = _torch("_functionalize_sync")


def inner_value(t: torch.Tensor) -> torch.Tensor:
    """The lazy tensor behind ``t`` now (its functional wrapper's current value); ``t`` itself where
    functionalization is off. Kept alive, it keeps that value's device buffer alive after ``t`` moves on."""
    return _from_functional(t) if _is_functional(t) else t


def take_value(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` takes ``src``'s value as its own: the same device tensor behind both, no op in the graph.

    Unlike ``dst.copy_(src)``, which keeps ``dst``'s lazy tensor (and its
    id) and gives it ``src``'s IR, ``dst`` then wraps ``src``'s lazy tensor,
    as if it had been created where ``src`` was; torch_xla syncs live tensors
    in id order, so a graph's outputs keep the order ``src`` had. Views of
    ``dst`` see the new value. A plain ``copy_`` where functionalization is off.
    """
    if _is_functional(dst) and _is_functional(src):
        restore_value(dst, _from_functional(src))
    else:
        dst.copy_(src)


def restore_value(dst: torch.Tensor, inner: torch.Tensor) -> None:
    """``dst`` takes ``inner``, a lazy tensor (:func:`inner_value`: one it held before, or another's), as its
    value, as if never written since; :func:`take_value` with the lazy tensor itself."""
    if _is_functional(dst):
        _functionalize_replace(dst, inner)
        _functionalize_commit_update(dst)
    else:
        dst.copy_(inner)


def settle(tensors: Sequence[torch.Tensor]) -> None:
    """Applies the value each of ``tensors`` took (:func:`take_value`) to its functional storage now, so
    the lazy tensor it held before is released (until then the storage keeps it as its base, and a step
    barrier syncs it: the IR that computed the old value would run in the step)."""
    for t in tensors:
        if _is_functional(t):
            _functionalize_sync(t)


def update_in_place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` takes ``src``'s value (:func:`take_value`) as an in-place update of ``dst`` would:
    the next sync donates ``dst``'s current buffer to the new value (torch_xla's alias id)."""
    if _is_functional(dst) and _is_functional(src):
        _propagate_xla_data(_from_functional(dst), _from_functional(src))
    take_value(dst, src)


# --- torch: optimizers ----------------------------------------------------------

_torch("optim.SGD._init_group")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Creates ``optimizer``'s state for its parameters with a gradient, as its first step would.

    Calls its ``_init_group(group, *lists)`` per group with fresh lists, as
    dynamo does before tracing a compiled optimizer step. False (nothing done)
    for an optimizer without one of that form.
    """
    lists = _init_group_lists(type(optimizer))
    if lists is None:
        return False
    for group in optimizer.param_groups:
        optimizer._init_group(group, *([] for _ in range(lists)))
    return True


@functools.lru_cache(maxsize=None)
def _init_group_lists(cls: type) -> Optional[int]:
    """How many list arguments ``cls._init_group(group, *lists)`` takes (SGD 3, Adam 6); None without one."""
    init = getattr(cls, "_init_group", None)
    if init is None:
        return None
    params = list(inspect.signature(init).parameters.values())[2:]  # after self, group
    if not params or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.default is not p.empty
                         for p in params):
        return None
    return len(params)


# --- torch: dynamo and AOTAutograd ----------------------------------------------

def in_compiled_autograd_region() -> bool:
    """True while compiled autograd traces (or runs) a backward graph."""
    return bool(_compiled_autograd.in_compiled_autograd_region)


_torch("in_compiled_autograd_region", _compiled_autograd)
_TracingContext = _torch("_guards.TracingContext")


# Inside a compiler AOTAutograd calls, its FakeTensorMode is active: real tensors made there need it off.
fake_mode_off: Callable[[], Any] = _torch("_subclasses.fake_tensor.unset_fake_temporarily")


def aot_fw_metadata() -> Any:
    """AOTAutograd's ``ViewAndMutationMeta`` for the graph being compiled, if it is available."""
    return getattr(_TracingContext.try_get(), "fw_metadata", None)


_guard_failures: dict = _torch("_dynamo.utils.guard_failures")
_InstructionTranslator = _torch("_dynamo.symbolic_convert.InstructionTranslator")


_comptime: Callable[..., None] = _torch("_dynamo.comptime.comptime")
_torch("_dynamo.comptime.ComptimeVar._i_will_not_complain_if_bc_breaks_VariableTracker")


def at_trace_time(fn: Callable[[Any], None]) -> None:
    """While dynamo traces the caller: calls ``fn(ctx)`` now, in Python, recording nothing in the graph.

    ``fn`` must be a module-level function (dynamo drops a nested one's
    closure); it reads the caller's locals with :func:`traced_object`.
    """
    _comptime(fn)


def traced_object(ctx: Any, local: str) -> Any:
    """In :func:`at_trace_time`'s ``fn``: the Python object behind the local ``local`` of at_trace_time's caller.

    For an object dynamo tracks by identity (an optimizer, a module): its
    VariableTracker's ``value``.
    """
    return ctx.get_local(local, stacklevel=1)._i_will_not_complain_if_bc_breaks_VariableTracker().value


def last_guard_failure() -> Optional[str]:
    """While dynamo compiles a frame: why its previous compilation's guards failed, if this is a recompile."""
    try:
        code = _InstructionTranslator.current_tx().f_code
    except AttributeError:  # not inside dynamo's tracing of a frame
        return None
    reasons = _guard_failures.get(code)
    return reasons[-1] if reasons else None


# --- torch: dynamo giving up on a frame ------------------------------------------

# The logger of dynamo's "hit config.recompile_limit" warning, the only report of a give-up that
# names the function, the limit and the last guard failure; its args are those, in that order.
DYNAMO_FRAME_LOGGER = "torch._dynamo.convert_frame"
_RECOMPILE_LIMIT_MESSAGE = "torch._dynamo hit config."
# dynamo's compile of one frame, whose frame holds the compiled frame's locals and the backend.
_dynamo_compile_code: types.CodeType = _torch("_dynamo.convert_frame._compile").__code__
if not {"locals", "compiler_fn"} <= set(_dynamo_compile_code.co_varnames):
    raise _missing("torch", TORCH_VERSION, torch.__version__, "torch._dynamo.convert_frame._compile's locals changed")


def recompile_limit_hit(record: logging.LogRecord) -> Optional[tuple[str, Any, str, str]]:
    """(limit's config name, its value, the function, the last guard failure) if ``record`` is dynamo's
    warning that it stops compiling a function, else None."""
    msg, args = record.msg, record.args
    if not (isinstance(msg, str) and msg.startswith(_RECOMPILE_LIMIT_MESSAGE)) or not isinstance(args, tuple):
        return None
    if len(args) < 4:
        return None
    limit, value, function, reason = args[:4]
    return str(limit), value, str(function), str(reason)


def frame_being_compiled() -> tuple[dict[str, Any], str]:
    """Inside dynamo's compile of a frame: that frame's locals and the backend's name; ({}, "") elsewhere."""
    f: Optional[types.FrameType] = sys._getframe(1)
    while f is not None:
        if f.f_code is _dynamo_compile_code:
            local = f.f_locals
            return dict(local.get("locals") or {}), str(getattr(local.get("compiler_fn"), "__name__", ""))
        f = f.f_back
    return {}, ""


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _double_backward_forward_code() -> types.CodeType:
    """The code of AOTAutograd's ``CompiledFunctionBackward.forward(double_ctx, *unused_args)``.

    AOTAutograd runs a backward for ``create_graph=True`` from the forward of
    that autograd.Function, where grad mode is off, so grad mode cannot tell
    such a call from a plain backward; that function's frame on the stack
    can. Found by identity of its code object (a constant nested in
    ``AOTDispatchAutograd``), so a change in torch fails here, at import.
    """
    found = {
        code
        for fn in vars(_aot_runtime.AOTDispatchAutograd).values()
        if isinstance(fn, (staticmethod, classmethod, types.FunctionType))
        for code in _code_objects(getattr(fn, "__func__", fn).__code__)
        if code.co_name == "forward" and code.co_varnames[:1] == ("double_ctx",)
    }
    if len(found) != 1:
        raise ImportError(
            f"AOTAutograd's CompiledFunctionBackward.forward(double_ctx, ...) was found {len(found)} times, "
            f"not once, in torch {torch.__version__}; this code is written against torch {TORCH_VERSION}"
        )
    return found.pop()


_DOUBLE_BACKWARD_FORWARD = _double_backward_forward_code()


def in_aot_double_backward(max_depth: int = 12) -> bool:
    """True when AOTAutograd runs the calling backward graph for ``create_graph=True``."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is _DOUBLE_BACKWARD_FORWARD:
            return True
        frame = frame.f_back
    return False


# --- torch_xla ------------------------------------------------------------------

try:
    import torch_xla
except ImportError as e:  # registration works without it; see backend.require_torch_xla
    torch_xla = None
    TORCH_XLA_IMPORT_ERROR: Optional[ImportError] = e
else:
    TORCH_XLA_IMPORT_ERROR = None
    import torch_xla._dynamo.dynamo_bridge as _upstream_bridge
    import torch_xla.core.xla_builder as _xb
    import torch_xla.core.xla_model as _xm
    import torch_xla.experimental.eager as _eager
    import torch_xla.runtime as _xr
    import torch_xla.utils.buffer_donor_context  # noqa: F401  (bound below)
    from torch_xla._dynamo import config as dynamo_config

    def _xla(path: str, obj: Any = torch_xla) -> Any:
        return _bind("torch_xla", TORCH_XLA_VERSION, torch_xla.__version__, obj, path)

    XLAC = _XLAC = _xla("_XLAC")
    # Called as XLAC._xla_sync_multi, looked up per call: the explain tool wraps it while it records.
    _xla("_xla_sync_multi", _XLAC)
    # Lazy tensors: pending IR, counters.
    need_materialization: Callable[[list], list[bool]] = _xla("_check_tensor_need_materialization", _XLAC)
    increment_counter: Callable[[str, int], None] = _xla("_xla_increment_counter", _XLAC)
    graph_hash: Callable[[list], bytes] = _xla("_get_graph_hash", _XLAC)
    _debug_info: Callable[[torch.Tensor], str] = _xla("_get_xla_tensor_debug_info", _XLAC)
    # The pending IR of tensors as text (walks all of it).
    ir_text: Callable[[list], str] = _xla("_get_xla_tensors_text", _XLAC)

    _device_data_nodes = _xla("_get_tensors_xla_device_data_node", _XLAC)

    def reads_device_data(tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the pending IR of ``tensors`` reads device data (a buffer, or a scalar uploaded as one).

        ``_get_tensors_xla_device_data_node`` takes each buffer's handle: under SPMD that crashes
        torch_xla 2.9 on a result still in flight (see ``buffer_handles``), so there the IR's text is
        read instead (slower: it formats every node; this runs per step on small graphs, constants
        and zero fills). Without SPMD a placeholder's handle is its address: safe to take.
        """
        tensors = list(tensors)
        if _xr.is_spmd():
            return "xla::device_data(" in ir_text(tensors)
        return bool(_device_data_nodes(tensors)[0])

    def ir_root(t: torch.Tensor) -> Optional[str]:
        """The root node of ``t``'s pending IR as torch_xla prints it (op, shape, attributes); None without IR.

        Reads the root only: microseconds however large the graph, where
        ``reads_device_data`` and ``graph_hash`` walk all of it.
        """
        for line in _debug_info(t).splitlines():
            if line.startswith("IR: "):
                root = line[len("IR: "):]
                return None if root == "None" else root.split("] ", 1)[-1]  # after the scope, "[...] "
        return None
    # Whether the PJRT runtime is up: before, nothing ran, and waiting for the device would start it
    # (before a script's xr.use_spmd(), which must come first).
    runtime_initialized: Callable[[], bool] = _xla("_xla_runtime_is_initialized", _XLAC)
    # False inside torch_xla.compile(full_graph=True): any execution there raises.
    execution_allowed: Callable[[], bool] = _xla("_get_allow_execution", _XLAC)
    warm_up_cache: Callable[[list, list], None] = _xla("_xla_warm_up_cache", _XLAC)
    _tensors_handle = _xla("_get_tensors_handle", _XLAC)
    _is_placeholder = _xla("_is_placecholder", _XLAC)
    # The unique id of the lazy tensor behind a tensor now (a functional in-place op makes a new one).
    tensor_id: Callable[[torch.Tensor], int] = _xla("_xla_get_tensor_id", _XLAC)
    # A device buffer's donation flag (torch.ops.xla.dynamo_set_buffer_donor_ sets it).
    get_buffer_donation: Callable[[torch.Tensor], bool] = _xla("_get_buffer_donation", _XLAC)
    set_buffer_donation: Callable[[torch.Tensor, bool], bool] = _xla("_set_buffer_donation", _XLAC)
    # Embedding a lowered graph: placeholders, lowering, one user computation per call.
    user_computation: Callable[[str, list, Any], list] = _xla("_xla_user_computation", _XLAC)
    LoweringContext: type = _xla("lowering.LoweringContext", _XLAC)
    create_placeholder_tensor: Callable[..., torch.Tensor] = _xla("create_placeholder_tensor", _xb)
    # Building XLA computations by hand (the accumulation loop).
    xla_builder = _xb
    _xla("Op.mkwhile", _xb)
    _xla("Op.call", _xb)
    computation_from_module_proto: Callable[[str, bytes], Any] = _xla("computation_from_module_proto", _xb)
    eager_mode_context: Callable[[bool], Any] = _xla("eager_mode_context", _eager)
    is_eager_mode: Callable[[], bool] = _xla("is_eager_mode", _eager)
    # Random numbers.
    base_seed_tensor: Callable[[str], torch.Tensor] = _xla("_get_base_seed_as_tensor", _XLAC)
    _get_rng_seed = _xla("_xla_get_rng_seed", _XLAC)
    # SPMD.
    sharding_spec: Callable[[torch.Tensor], str] = _xla("_get_xla_sharding_spec", _XLAC)
    sharding_specs: Callable[[list], list[str]] = _xla("_get_xla_sharding_specs", _XLAC)
    op_sharding: Callable[[torch.Tensor], Any] = _xla("_get_xla_op_sharding", _XLAC)
    mark_sharding: Callable[[torch.Tensor, Any], None] = _xla("_xla_mark_sharding", _XLAC)
    _xla("skip_input_data_check", dynamo_config)
    # Upstream's CPU-fallback partitioner looks its node collector up in its module per call.
    _xla("_dynamo.dynamo_bridge.partition_fx_graph_for_cpu_fallback")
    _xla("UnsupportedNodesCollector", _upstream_bridge)
    _xla("GraphInputMatcher.__call__", _upstream_bridge)
    # The attributes graph_inputs_matched_by_buffer's matcher rewrites, as upstream's __init__ sets them.
    for _attribute in ("graph_input_xla_values", "arg_idxs"):
        if _attribute not in _upstream_bridge.GraphInputMatcher.__init__.__code__.co_names:
            raise _missing("torch_xla", TORCH_XLA_VERSION, torch_xla.__version__,
                           f"GraphInputMatcher sets no {_attribute}")

    def buffer_handles(tensors: Sequence[torch.Tensor]) -> list[int]:
        """The device buffer behind each data tensor (equal handles: one buffer); waits for results in flight.

        A result whose execution is still being launched holds a placeholder: PJRT's handle is then the
        placeholder's address (another number once the buffer is assigned), and under SPMD torch_xla 2.9
        reads the first of its shards, which a placeholder does not have yet (a crash, seen as a segfault
        under load). Callers read handles at trace time only, so the wait is not paid per step.
        """
        tensors = list(tensors)
        if any(map(_is_placeholder, tensors)):
            _xm.wait_device_ops()
        return _tensors_handle(tensors)

    def rng_seed() -> int:
        """The default device's RNG seed now (host side: reading it runs nothing)."""
        return _get_rng_seed()

    def set_rng_seed(seed: int) -> None:
        """Sets the default device's RNG seed (as ``xm.set_rng_state``)."""
        _xm.set_rng_state(seed)

    def advance_rng_seed(device: str) -> None:
        """Advances the device's RNG seed as a step barrier does (and as upstream's bridge does per call).

        The formula is the lazy graph executor's (C++, not exposed to Python).
        """
        _xm.set_rng_state((1012031 + _get_rng_seed() * 7012063) % 18446744073709551615, device)

    # Replaying a captured step (replay.py), as upstream's bridge replays an inference graph.
    _xla("_run_cached_graph", _XLAC)

    def run_cached_graph(graph_hash: bytes, inputs: list) -> list:
        """Runs a program cached by :func:`cache_program` on ``inputs`` (looked up per call: the explain tool
        wraps it while it records)."""
        return XLAC._run_cached_graph(graph_hash, inputs)
    _alias_with_buffer_donor_config = _xla("utils.buffer_donor_context.alias_with_buffer_donor_config")
    _device_context = _xla("_get_device_context", _xm)

    def program_inputs(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        """The inputs of the program computing ``tensors``' pending IR, in program order: the lazy tensor id
        each input's buffer was made for, and its device data."""
        _xm.wait_device_ops()  # no input is a placeholder still in flight (see buffer_handles)
        ids, values = _device_data_nodes(list(tensors))
        return list(ids), list(values)

    def cache_program(tensors: Sequence[torch.Tensor]) -> bytes:
        """Compiles (or finds compiled) the program computing ``tensors``' pending IR without running it, its
        inputs whose buffers are marked donors (:data:`set_buffer_donation`) donated to its outputs; returns
        its hash, for :data:`run_cached_graph`."""
        tensors = list(tensors)
        with _alias_with_buffer_donor_config():
            program = graph_hash(tensors)
            warm_up_cache(tensors, [])
        return program

    _own_closures: "weakref.WeakSet[Callable[[], Any]]" = weakref.WeakSet()

    def add_step_closure(fn: Callable[[], None]) -> None:
        """``xm.add_step_closure(fn)``, remembered as this package's own (:func:`is_own_step_closure`)."""
        _xm.add_step_closure(fn)
        _own_closures.add(step_closures()[-1])

    def is_own_step_closure(closure: Callable[[], Any]) -> bool:
        """Whether a pending step closure was added by this package (a replayed step's capture tells the
        user's, which only a traced step runs, from its own)."""
        return closure in _own_closures

    def step_closures() -> list:
        """The default device's pending step closures (``xm.add_step_closure``), as torch_xla keeps them."""
        context = _device_context()
        if getattr(context, "step_closures", None) is None:
            context.step_closures = []
        return context.step_closures

    def holds_lazy_tensor(t: torch.Tensor) -> bool:
        """Whether ``t`` (an XLA tensor) wraps a lazy tensor now (not a fake or an undefined one)."""
        try:
            tensor_id(inner_value(t))
        except RuntimeError:
            return False
        return True


_matching_by_buffer = threading.local()


@contextlib.contextmanager
def graph_inputs_matched_by_buffer() -> Iterator[None]:
    """Graphs upstream's bridge traces within this scope (this thread) match their inputs to arguments by buffer.

    The bridge's ``GraphInputMatcher`` maps each device-data input of a
    traced graph to the argument whose tensor id is recorded on its buffer,
    and binds an input it cannot map as a constant (the buffer at the
    trace). Under SPMD a buffer records a fresh id every time its tensor's
    IR is taken, so an argument that an earlier graph (or a retrace) read
    first is frozen: a batch read by two graphs, the parameters of a
    checkpointed backward (upstream/bugs/spmd_checkpoint_stale_backward.py).
    A matcher made here maps, at its first call (the trace's own call, with
    the same buffers), every input it bound as a constant whose buffer is
    one of the arguments' to that argument. Matchers made outside the
    scope (upstream ``openxla`` itself) are untouched.
    """
    _install_buffer_matcher()
    previous = getattr(_matching_by_buffer, "active", False)
    _matching_by_buffer.active = True
    try:
        yield
    finally:
        _matching_by_buffer.active = previous


@functools.lru_cache(maxsize=None)
def _install_buffer_matcher() -> None:
    """Puts :class:`BufferMatcher` in upstream's bridge, where ``extract_graph_helper`` looks the class up per trace."""
    matcher = _upstream_bridge.GraphInputMatcher

    class BufferMatcher(matcher):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._by_buffer = getattr(_matching_by_buffer, "active", False)

        def __call__(self, args: list) -> Any:
            if self._by_buffer:
                self._by_buffer = False
                self._map_constants_to_arguments(args)
            return super().__call__(args)

        def _map_constants_to_arguments(self, args: list) -> None:
            tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "xla"]
            ready = [(i, a) for (i, a), pending in zip(tensors, need_materialization([a for _, a in tensors]))
                     if not pending]
            buffers = dict(zip(buffer_handles([a for _, a in ready]), (i for i, _ in ready)))
            for k, (value, index) in enumerate(zip(self.graph_input_xla_values, self.arg_idxs)):
                if index is not None or value is None or need_materialization([value])[0]:
                    continue
                arg = buffers.get(buffer_handles([value])[0])
                if arg is not None:
                    self.arg_idxs[k] = arg
                    self.graph_input_xla_values[k] = None

    _upstream_bridge.GraphInputMatcher = BufferMatcher


@contextlib.contextmanager
def upstream_unsupported_nodes(names: frozenset[str]) -> Iterator[None]:
    """Upstream's CPU-fallback partitioner takes the nodes named ``names`` as unsupported, without running the graph.

    Its collector finds them by running the graph node by node, which
    executes each fallback op's pending input; a caller that has run
    the graph already and knows the nodes saves that execution.
    """
    collector = _upstream_bridge.UnsupportedNodesCollector

    class KnownNodes(collector):  # type: ignore[misc, valid-type]
        def run(self, *args: Any, **kwargs: Any) -> None:
            pass

        def get_unsupported_nodes(self) -> list[torch.fx.Node]:
            return [n for n in self.module.graph.nodes if n.name in names]

    _upstream_bridge.UnsupportedNodesCollector = KnownNodes
    try:
        yield
    finally:
        _upstream_bridge.UnsupportedNodesCollector = collector
