"""The JAX reference step for bench.host_time: the MLP's training step under `jax.jit`, timed as the torch modes are.

Runs in whichever interpreter has jax (bench.host_time starts it as a
subprocess, so that jax never shares a process with torch_xla) and prints
one JSON line. It imports nothing from this repository.

    /path/to/jax-python bench/jax_step.py '{"depth": 32, "width": 256, "batch": 64}'

The step matches bench/models.py's `mlp(depth, width)` with the `zero_grads`
loop: Linear+ReLU layers, a 10-way linear head, cross-entropy, SGD with
momentum 0.9 and lr 1e-3; parameters and momentum buffers are donated.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

LR, MOMENTUM = 1e-3, 0.9


def init(key: jax.Array, depth: int, width: int) -> list[tuple[jax.Array, jax.Array]]:
    """torch.nn.Linear's default init: uniform in ±1/sqrt(fan_in) for weight and bias."""
    params = []
    for fan_out in [width] * depth + [10]:
        key, kw, kb = jax.random.split(key, 3)
        bound = 1.0 / width**0.5
        params.append((jax.random.uniform(kw, (width, fan_out), minval=-bound, maxval=bound),
                       jax.random.uniform(kb, (fan_out,), minval=-bound, maxval=bound)))
    return params


def loss_fn(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    logp = jax.nn.log_softmax(x @ w + b)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def sgd_step(params: list, momentum: list, x: jax.Array, y: jax.Array) -> tuple[list, list, jax.Array]:
    """One training step; torch's SGD: buf = momentum * buf + grad, p -= lr * buf."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    momentum = jax.tree_util.tree_map(lambda m, g: MOMENTUM * m + g, momentum, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - LR * m, params, momentum)
    return params, momentum, loss


def main(cfg: dict) -> dict:
    depth, width, batch = cfg.get("depth", 32), cfg.get("width", 256), cfg.get("batch", 64)
    rounds, per_round, block = cfg.get("rounds", 10), cfg.get("steps", 5), cfg.get("block", 5)
    key = jax.random.PRNGKey(0)
    params = init(key, depth, width)
    momentum = jax.tree_util.tree_map(jnp.zeros_like, params)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    y = jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, 10)
    # Donated: the step updates parameters and momentum in place, as torch's optimizer does.
    step = jax.jit(sgd_step, donate_argnums=(0, 1))
    for _ in range(cfg.get("warmup", 3)):
        params, momentum, loss = step(params, momentum, x, y)
    loss.block_until_ready()
    host, wall, pipelined = [], [], []
    for _ in range(rounds):
        for _ in range(per_round):
            # Device idle at the start: the previous step's outputs are ready.
            jax.block_until_ready((params, momentum))
            t0 = time.perf_counter()
            params, momentum, loss = step(params, momentum, x, y)
            t1 = time.perf_counter()
            jax.block_until_ready((params, momentum, loss))
            t2 = time.perf_counter()
            host.append(t1 - t0)
            wall.append(t2 - t0)
        jax.block_until_ready((params, momentum))
        t0 = time.perf_counter()
        for _ in range(block):
            params, momentum, loss = step(params, momentum, x, y)
        jax.block_until_ready((params, momentum, loss))
        pipelined.append((time.perf_counter() - t0) / block)
    return dict(
        jax=jax.__version__, backend=jax.default_backend(), tensors=2 * len(params),
        host_ms=1e3 * statistics.median(host), sync_ms=1e3 * statistics.median(wall),
        pipelined_ms=1e3 * statistics.median(pipelined), executions_per_step=1,
        final_loss=float(loss),
    )


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})))
