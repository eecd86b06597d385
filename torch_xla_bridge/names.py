"""Names and pins: the one home of every string the package and its users agree on.

A leaf module: it imports nothing, so registration, mechanisms, the explain
tool, benchmarks, tests, examples and ``setup.py`` (which reads it without
importing the package) all take their names from here.
"""

# Backends this package registers, and the upstream backend they extend.
BACKEND_NAME = "openxla_fused_grad"
STEP_BACKEND_NAME = "openxla_fused_step"
UPSTREAM_BACKEND_NAME = "openxla"
BACKEND_NAMES = (BACKEND_NAME, STEP_BACKEND_NAME)

# The releases the package is written against (private APIs included, see _private.py).
TORCH_VERSION = "2.9.0"
TORCH_XLA_VERSION = "2.9.0"
TORCH_XLA_INSTALL = f"pip install torch_xla=={TORCH_XLA_VERSION}"

# torch_xla counters this package bumps (shown by metrics_report()):
SYNC_COUNTER = "OpenxlaFusedGradSync"  # every end-of-backward sync of openxla_fused_grad
STEP_COUNTER = "OpenxlaFusedStepSync"  # every step openxla_fused_step cuts
# Every step barrier openxla_fused_grad makes after an eager optimizer step (optimizer_sync.py).
OPTIMIZER_SYNC_COUNTER = "OpenxlaFusedGradOptimizerSync"
# Every graph of openxla_fused_step that executes on its own: a forward after a read between
# forward and cut, or a no-backward graph while no step is open.
FORWARD_ALONE_COUNTER = "OpenxlaFusedStepForwardAlone"
# Every execution of openxla_fused_step that gives state still held as constants (fresh optimizer
# buffers, BatchNorm's 0-d counter) buffers of its own before the first step reads them.
FRESH_STATE_COUNTER = "OpenxlaFusedStepFreshState"
# Every time dynamo gave up on a function compiled with one of the backends (recompile_limit):
# from then on it runs eagerly (dynamo_fallback.py).
DYNAMO_GAVE_UP_COUNTER = "OpenxlaFusedDynamoGaveUp"
# Every compile that only validates a new lowering: it shows in UncachedCompile but launches nothing.
VALIDATION_COUNTER = "OpenxlaFusedValidationCompile"

# torch_xla's own counters and metrics that the package reads, or bumps as upstream does:
INPUT_SYNC_COUNTER = "DynamoSyncInputExecuteTime"  # a graph's pending inputs synced before it runs
UNCACHED_COMPILE_COUNTER = "UncachedCompile"  # a sync that compiled a new program
COMPILE_COUNTERS = (UNCACHED_COMPILE_COUNTER, "CachedCompile")  # one per sync of a non-empty graph
# Executions: single-device programs, and (under SPMD) replicated ones.
EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")

# The name of the XLA computation a deferred graph is embedded as.
USER_COMPUTATION_NAME = "xla::torch_xla_bridge_graph"
# The name of the While loop that a step's alike micro-batches are folded into (accumulation.py).
ACCUMULATION_LOOP_NAME = "xla::torch_xla_bridge_accumulation"
# Every fold of openxla_fused_step's micro-batches into one loop (one per backward from the second on).
FOLD_COUNTER = "OpenxlaFusedStepFold"
# Every replay of a captured step, and every capture (replay.py).
REPLAY_COUNTER = "OpenxlaFusedStepReplay"
REPLAY_CAPTURE_COUNTER = "OpenxlaFusedStepReplayCapture"
# Each time a replayed step packs the state it writes into flat buffers (after a capture), and each time it
# unpacks it (before it is traced again): one execution each.
REPLAY_PACK_COUNTER = "OpenxlaFusedStepReplayPack"
REPLAY_UNPACK_COUNTER = "OpenxlaFusedStepReplayUnpack"
# Bumped before each execution of a capture's check of its packed program against the traced call.
REPLAY_CHECK_COUNTER = "OpenxlaFusedStepReplayCheck"
# Why a replayed step was traced again: the counter bumped for each cause, and what its warning and explain say.
RETRACE_ARGUMENTS = "OpenxlaFusedStepRetraceArguments"
RETRACE_MODULES = "OpenxlaFusedStepRetraceModules"
RETRACE_TRAINING = "OpenxlaFusedStepRetraceTraining"
RETRACE_OPTIMIZER = "OpenxlaFusedStepRetraceOptimizer"
RETRACE_REQUIRES_GRAD = "OpenxlaFusedStepRetraceRequiresGrad"
RETRACE_GRAD = "OpenxlaFusedStepRetraceGrad"
RETRACE_STATE = "OpenxlaFusedStepRetraceState"
RETRACE_FREED = "OpenxlaFusedStepRetraceFreed"
REPLAY_RETRACE_CAUSES = {
    RETRACE_ARGUMENTS: "its arguments changed (a new shape, dtype, sharding or non-tensor value)",
    RETRACE_MODULES: "a parameter, buffer or submodule of the model was registered, replaced or set to None",
    RETRACE_TRAINING: "a module's training flag changed (model.train() / model.eval())",
    RETRACE_OPTIMIZER: "an optimizer's parameters or hyperparameters changed (e.g. a scheduler's lr: each new "
    "value is a new capture; a tensor lr, lr=torch.tensor(...), read as a tensor (Adam/AdamW with "
    "capturable=True) is a program input instead)",
    RETRACE_REQUIRES_GRAD: "a parameter was replaced, or its requires_grad toggled",
    RETRACE_GRAD: "a parameter's .grad was set to None or replaced outside the step",
    RETRACE_STATE: "an optimizer's state was replaced outside the step (e.g. load_state_dict)",
    RETRACE_FREED: "a tensor the step reads or writes was freed",
}
# The name of the program a captured step replays (its traced program, its state packed in flat buffers).
REPLAY_PROGRAM_NAME = "xla::torch_xla_bridge_replayed_step"
# Every optimizer step whose micro-batches openxla_fused_step could not fold (it warned why, once per cause).
UNFOLDED_COUNTER = "OpenxlaFusedStepUnfolded"
