"""The training loops the benchmarks run: one table, from which the worker, step_time, spmd and the plan take theirs.

Every loop but one trains with SGD (momentum); what sets the loops apart is how
the gradients are cleared, how many micro-batches accumulate into one step, and
whether the optimizer step is compiled with the backend or runs eagerly and
is followed by a sync. The one, ``scheduled_adamw``, is bench.host_time's: a
learning rate that changes every step, as a scheduler sets it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Loop:
    """One training loop of the benchmarks."""

    name: str  # the key in configurations and results.json
    set_to_none: bool  # optimizer.zero_grad(set_to_none=...)
    micro: int  # micro-batches per step (a configuration's "micro" overrides it)
    compiled_optimizer: bool  # optimizer.step compiled with the backend; otherwise eager + torch_xla.sync()
    label: str  # how reports (bench.step_time, upstream/measure.py) name it
    # AdamW(capturable=True) with a tensor lr that a LambdaLR sets after every step, instead of SGD. Not in
    # the full benchmark's plan (its tables compare SGD loops); bench.host_time runs it by name.
    scheduled: bool = False

    @property
    def optimizer(self) -> str:
        """The optimizer half of the label, as bench.spmd names its loops (all with set_to_none=False)."""
        return "compiled optimizer" if self.compiled_optimizer else "eager optimizer + mark_step"


# In the order the full benchmark runs them.
LOOPS: dict[str, Loop] = {
    lp.name: lp
    for lp in (
        Loop("set_to_none", True, 1, True, "set_to_none=True, compiled optimizer"),
        Loop("zero_grads", False, 1, True, "set_to_none=False, compiled optimizer"),
        Loop("accumulate4", False, 4, True, "set_to_none=False, compiled optimizer, 4 micro-batches"),
        Loop("eager_optimizer", False, 1, False, "eager optimizer + mark_step"),
        Loop("scheduled_adamw", False, 1, False,
             "AdamW(capturable=True), a tensor lr a LambdaLR sets every step, eager optimizer + mark_step",
             scheduled=True),
    )
}

# The single-batch loops bench.step_time times, in its order.
STEP_TIME_LOOPS = ("zero_grads", "set_to_none", "eager_optimizer")
# The loops bench.spmd times (both with set_to_none=False), in its order.
SPMD_LOOPS = ("zero_grads", "eager_optimizer")


def traced_equivalent(name: str) -> str:
    """The loop that differs from ``name`` only in compiling its optimizer step.

    LazyTensor and ``torch_xla.compile`` always trace the optimizer with the
    step, so this loop's rows are their reference for an eager-optimizer loop.
    """
    lp = LOOPS[name]
    return next(
        other.name for other in LOOPS.values()
        if other.compiled_optimizer and (other.set_to_none, other.micro) == (lp.set_to_none, lp.micro)
    )
