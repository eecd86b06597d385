"""Renders every figure the docs quote from the committed benchmark results, from the JSON.

README.md and the pages under docs/ quote the results committed in docs/benchmarks/
(results.json from `python -m bench`, host_time.json from `bench.host_time`, per_op.json
from `bench.per_op`, spmd.json from `bench.spmd --json` and `bench.llama_spmd --json`) in two forms, both written here:

- a generated region, a caption and its table, between two marker lines::

      <!-- generated: NAME -->
      ...
      <!-- end generated -->

  NAME is a key of REGIONS;
- a figure in prose, ``<!--fig:SPEC-->0.63x<!--/fig-->``, where SPEC is a path into a
  results file (see `figure`), e.g. ``host/mlp32x256/openxla_fused_step/host_ratio``;
  ``range:`` and a path with ``{a,b}`` alternatives, rendered as the lowest and highest
  value; ``ratio:PATH:PATH``; or ``@NAME``, a figure derived from several (DERIVED).

The result pages (docs/benchmarks/results.md, host_time.md, per_op.md) are the bench's own
renderings of their JSON, rewritten here too.

    python -m bench.tables           # rewrites them all from the JSON
    python -m bench.tables --check   # exit 1, naming each stale or unchecked figure

`--check` also fails on a figure typed by hand where the docs quote results: in a block
(paragraph, list item, or a paragraph ending with ':' and the block after it) that names a
results file or "the last full run", or that lies in a section holding a generated region,
every number must be generated, unless the block is labelled "measured separately" and
gives the measurement's command in a code span.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

from bench import ROOT
from bench.loops import LOOPS

RESULTS = ROOT / "docs" / "benchmarks"
UPSTREAM, FUSED_GRAD, FUSED_STEP, LAZY, COMPILE = (
    "openxla", "openxla_fused_grad", "openxla_fused_step", "lazy", "torch_xla.compile")
WORKLOADS = {"mlp32x256": "MLP 32x256", "resnet18": "ResNet-18", "gpt2-2L": "GPT-2 (2 layers)"}
MAIN_LOOPS = ("zero_grads", "set_to_none", "accumulate4", "eager_optimizer")
LOOP_NAMES = {
    "zero_grads": "`set_to_none=False`",
    "set_to_none": "`set_to_none=True`",
    "accumulate4": "4 micro-batches",
    "eager_optimizer": "eager optimizer",
}
EXECUTION_LOOP_NAMES = {
    "zero_grads": "`zero_grad(set_to_none=False)`, compiled optimizer",
    "set_to_none": "`zero_grad(set_to_none=True)`, compiled optimizer",
    "accumulate4": "4 micro-batches, compiled optimizer",
    "eager_optimizer": "eager optimizer + `torch_xla.sync()`",
}
MODE_NAMES = {LAZY: "LazyTensor", COMPILE: "`torch_xla.compile`"}


def mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode, f"`{mode}`")


class Data:
    """The committed results files, and lookups that fail (KeyError) on what they lack."""

    def __init__(self, root: Path = RESULTS):
        self.root = root
        self.results, self.host, self.per_op, self.spmd, self.accumulation = (
            json.loads((root / f"{name}.json").read_text())
            for name in ("results", "host_time", "per_op", "spmd", "accumulation"))

    def run(self, workload: str, loop: str, mode: str, micro: int | None = None) -> dict:
        """One configuration of results.json (``micro``: the micro-batch study's count)."""
        found = [r for r in self.results["results"]
                 if (r["workload"], r["loop"], r["mode"], r.get("micro")) == (workload, loop, mode, micro)]
        if len(found) != 1:
            raise KeyError(f"results.json: {len(found)} rows for {workload}/{loop}/{mode}/micro={micro}")
        return found[0]

    def host_row(self, workload: str, mode: str) -> dict:
        for w in self.host["workloads"]:
            if w["workload"] == workload:
                if mode not in w["rows"]:
                    raise KeyError(f"host_time.json: no mode {mode} on {workload}")
                return w["rows"][mode]
        raise KeyError(f"host_time.json: no workload {workload}")

    def per_op_run(self, functionalization: bool) -> dict:
        for r in self.per_op["runs"]:
            if r["functionalization"] is functionalization:
                return r
        raise KeyError(f"per_op.json: no run with functionalization {'on' if functionalization else 'off'}")

    def spmd_row(self, layout: str, loop: str) -> dict:
        for r in self.spmd["rows"]:
            if (r["layout"], r["loop"]) == (layout, LOOPS[loop].optimizer):
                return r
        raise KeyError(f"spmd.json: no row {layout}/{loop}")

    def accumulation_row(self, k: int, mode: str) -> dict:
        """A row of bench.accumulation's (K micro-batches, one mode)."""
        for r in self.accumulation["rows"]:
            if (r["micro"], r["mode"]) == (k, mode):
                return r
        raise KeyError(f"accumulation.json: no row K={k}/{mode}")

    def llama_row(self, devices: int, mesh: str, mode: str) -> dict:
        """A row of bench.llama_spmd's (``mesh``: fsdp or 2d, as its --mesh)."""
        for r in self.spmd["llama"]["rows"]:
            if (r["devices"], r["mesh_kind"], r["mode"]) == (devices, mesh, mode):
                return r
        raise KeyError(f"spmd.json: no llama row {devices}/{mesh}/{mode}")


# --- formatting ------------------------------------------------------------------------------


def num(v: float) -> str:
    """Three significant figures, as the bench's own pages print times: 0.95, 8.50, 96.3, 319."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def fmt(field: str, v) -> str:
    """A value as the docs quote it, by the name of its field."""
    if isinstance(v, str):
        return v
    if field in ("executions_per_step", "tensors", "steps") or isinstance(v, bool):
        return str(v)
    if "ratio" in field:
        return f"{v:.2f}x"
    if field.endswith("share"):
        return f"{100 * v:.0f}%"
    if field.endswith("_ms"):
        return f"{num(v)} ms"
    if field.endswith("_us") or field in ("embed", "sync"):
        return f"{v:.1f} µs"
    if field.endswith("_mb"):
        return f"{v:.1f} MB"
    if field.endswith("_s"):
        return f"{v:.2f} s"
    if field == "max_param_diff":
        return f"{v:.3g}"
    if field == "max_loss_diff":
        return f"{v:.1e}"
    return f"{v:g}"


def span(texts: list[str]) -> str:
    """``["0.66x", "0.86x"]`` -> ``0.66-0.86x``: the lowest and highest of formatted values (one unit)."""
    values = sorted(texts, key=lambda t: float(re.match(r"-?[\d.]+", t).group()))
    lo, hi = values[0], values[-1]
    if lo == hi:
        return lo
    unit = re.sub(r"^-?[\d.]+", "", hi)
    if not lo.endswith(unit):
        raise ValueError(f"a range of values with different units: {texts}")
    return f"{lo[: len(lo) - len(unit)]}-{hi}"


# --- figures in prose ------------------------------------------------------------------------


def _lookup(data: Data, parts: list[str]):
    """The value at a path: results/WORKLOAD/LOOP[xMICRO]/MODE/FIELD, host/WORKLOAD/MODE/FIELD,
    per_op/on|off/FIELD[/KEY...], spmd/LAYOUT/LOOP/FIELD[/KEY], llama/DEVICES/fsdp|2d/MODE/FIELD[/KEY],
    accumulation/K/MODE/FIELD (spaces in names written as '_')."""
    kind, *rest = parts
    if kind == "results":
        workload, loop, mode, field = rest
        loop, _, micro = loop.partition("x")
        row = data.run(workload, loop, mode, int(micro) if micro else None)
        keys = [field]
    elif kind == "host":
        workload, mode, field = rest
        row, keys = data.host_row(workload, mode), [field]
    elif kind == "per_op":
        which, *keys = rest
        row = data.per_op_run({"on": True, "off": False}[which])
    elif kind == "spmd":
        layout, loop, *keys = rest
        row = data.spmd_row(layout.replace("_", " "), loop)
    elif kind == "llama":
        devices, mesh, mode, *keys = rest
        row = data.llama_row(int(devices), mesh, mode)
    elif kind == "accumulation":
        k, mode, field = rest
        row, keys = data.accumulation_row(int(k), mode), [field]
    else:
        raise KeyError(f"unknown results file {kind!r}")
    value = row
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            raise KeyError(f"{'/'.join(parts)}: no {k!r}")
        value = value[k]
    return keys[0], value


def _expand(spec: str) -> list[list[str]]:
    """A path with ``{a,b}`` alternatives -> the segments of every path it spells."""
    m = re.search(r"\{([^{}]*)\}", spec)
    if not m:
        return [spec.split("/")]
    return [path for alt in m[1].split(",") for path in _expand(spec[: m.start()] + alt + spec[m.end():])]


def _functionalization_cost(data: Data) -> str:
    """How much dearer torch_xla's functionalization makes each per-parameter op (materializing aside)."""
    on, off = data.per_op_run(True)["op_us"], data.per_op_run(False)["op_us"]
    return span([f"{on[op] / off[op]:.1f}x" for op in on if op != "sync per pending tensor"])


def _fused_step_over_floor(data: Data, workload: str) -> str:
    """The fused step's host time per parameter tensor on a host_time.json workload, over per_op's floor."""
    row = data.host_row(workload, FUSED_STEP)
    return f"{row['host_ms'] * 1000 / row['tensors'] / data.per_op_run(True)['floor_us']:.2f}x"


# Figures derived from several values, by name (``<!--fig:@NAME-->``).
DERIVED: dict[str, Callable[[Data], str]] = {
    "functionalization-op-cost": _functionalization_cost,
    "fused-step-bank1000-over-floor": lambda data: _fused_step_over_floor(data, "bank1000"),
}


def figure(data: Data, spec: str) -> str:
    """The text of ``<!--fig:SPEC-->``: the value at a path (see `_lookup`; ``|FORMAT`` overrides how it
    is written); ``range:PATH``, the span of the values a path with ``{a,b}`` alternatives spells;
    ``ratio:PATH:PATH``, one value over another; ``@NAME``, a figure of DERIVED."""
    if spec.startswith("@"):
        if spec[1:] not in DERIVED:
            raise KeyError(f"unknown derived figure {spec!r}")
        return DERIVED[spec[1:]](data)
    spec, _, override = spec.partition("|")
    if spec.startswith("ratio:"):
        (_, a), (_, b) = (_lookup(data, p.split("/")) for p in spec.removeprefix("ratio:").split(":"))
        return format(a / b, override or ".2f") + ("" if override else "x")
    many = spec.startswith("range:")
    paths = _expand(spec.removeprefix("range:"))
    if not many and len(paths) != 1:
        raise KeyError(f"{spec}: alternatives need range:")
    texts = []
    for path in paths:
        field, value = _lookup(data, path)
        texts.append(format(value, override) if override else fmt(field, value))
    return span(texts) if many else texts[0]


# --- generated regions -----------------------------------------------------------------------


def _rel(doc: Path, target: Path) -> str:
    return Path(os.path.relpath(target, doc.parent)).as_posix()


def _machine(info: dict) -> str:
    return f"{info['cpu']}, {info['cores']} cores, PJRT_DEVICE={info['pjrt_device']}"


def executions(data: Data, doc: Path) -> list[str]:
    lines = [
        f"Executions per training step, {WORKLOADS['mlp32x256']} (32 layers of width 256), SGD with momentum, "
        f"{_machine(data.results['machine'])} ([results.json]({_rel(doc, data.root / 'results.json')})):",
        "",
        f"| loop | {' | '.join(mode_name(m) for m in (UPSTREAM, FUSED_GRAD, FUSED_STEP))} |",
        "|---|---|---|---|",
    ]
    for loop in MAIN_LOOPS:
        cells = [str(data.run("mlp32x256", loop, m)["executions_per_step"]) for m in (UPSTREAM, FUSED_GRAD, FUSED_STEP)]
        lines.append(f"| {EXECUTION_LOOP_NAMES[loop]} | {' | '.join(cells)} |")
    return lines


def _ratio(row: dict, field: str = "step_ms_ratio") -> str:
    v = row.get(field)
    return "—" if v is None else f"{v:.2f}x"


def headline(data: Data, doc: Path) -> list[str]:
    lines = [
        f"The last full run of `python -m bench` ({_machine(data.results['machine'])}; every mode in a process of "
        f"its own, their blocks of steps alternated; [all figures]({_rel(doc, data.root / 'results.md')})): "
        "median step time relative to upstream `openxla` (below 1: faster), and the device memory of the step's "
        "largest program relative to `openxla`'s; every loop but the eager optimizer's compiles the optimizer step:",
        "",
        "| workload | loop | executions per step (`openxla` / fused_grad / fused_step) | step time, "
        "`openxla_fused_grad` | step time, `openxla_fused_step` | `openxla_fused_step` vs LazyTensor "
        "| device memory, `openxla_fused_step` |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, loop in itertools.product(WORKLOADS, MAIN_LOOPS):
        up, fg, fs = (data.run(workload, loop, m) for m in (UPSTREAM, FUSED_GRAD, FUSED_STEP))
        execs = " / ".join(str(r["executions_per_step"]) for r in (up, fg, fs))
        lines.append(f"| {WORKLOADS[workload]} | {LOOP_NAMES[loop]} | {execs} | {_ratio(fg)} | {_ratio(fs)} | "
                     f"{_ratio(fs, 'step_ms_ratio_lazy')} | {_ratio(fs, 'device_peak_mb_ratio')} |")
    return lines


def bench_steps(data: Data, doc: Path) -> list[str]:
    modes = (FUSED_GRAD, FUSED_STEP, LAZY, COMPILE)
    lines = [
        "Median step time, ratio to `openxla` (below 1: faster); executions per step in brackets; "
        "LazyTensor and `torch_xla.compile` trace the optimizer with the step, so they have no "
        "eager-optimizer rows:",
        "",
        "| workload | loop | `openxla` ms | " + " | ".join(mode_name(m) for m in modes) + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, loop in itertools.product(WORKLOADS, MAIN_LOOPS):
        up = data.run(workload, loop, UPSTREAM)
        cells = []
        for m in modes:
            try:
                r = data.run(workload, loop, m)
            except KeyError:
                cells.append("—")
                continue
            cells.append(f"{_ratio(r)} ({r['executions_per_step']})")
        lines.append(f"| {WORKLOADS[workload]} | {LOOP_NAMES[loop]} | "
                     f"{num(up['step_ms'])} ({up['executions_per_step']}) | " + " | ".join(cells) + " |")
    return lines


def bench_scaling(data: Data, doc: Path) -> list[str]:
    lines = [
        "How the step grows with the parameter tensors (parameter banks, `set_to_none=False`) and with the "
        f"micro-batches per step ({WORKLOADS['mlp32x256']}): executions per step, step time ratio to `openxla`, "
        "and the end-of-backward callback of `openxla_fused_grad` (collecting the leaves and the one sync), "
        "per step and as a share of its step time:",
        "",
        "| workload | executions (`openxla` / fused_grad / fused_step) | `openxla` ms | `openxla_fused_grad` "
        "| `openxla_fused_step` | callback ms | callback share |",
        "|---|---|---|---|---|---|---|",
    ]
    cases = [(f"{w[4:]} parameter tensors", w, "zero_grads", None) for w in ("bank10", "bank100", "bank1000")]
    cases += [(f"{WORKLOADS['mlp32x256']}, {k} micro-batch{'es' if k > 1 else ''}", "mlp32x256", "accumulate4", k)
              for k in (1, 4, 16)]
    for name, workload, loop, micro in cases:
        up, fg, fs = (data.run(workload, loop, m, micro) for m in (UPSTREAM, FUSED_GRAD, FUSED_STEP))
        execs = " / ".join(str(r["executions_per_step"]) for r in (up, fg, fs))
        lines.append(f"| {name} | {execs} | {num(up['step_ms'])} | {_ratio(fg)} | {_ratio(fs)} | "
                     f"{fg['callback_ms']:.2f} | {fmt('callback_share', fg['callback_share'])} |")
    return lines


def bench_memory(data: Data, doc: Path) -> list[str]:
    lines = [
        "Device peak of the last full run, ratio to `openxla`:",
        "",
        "| workload | loop | `openxla` MB | `openxla_fused_grad` | `openxla_fused_step` | LazyTensor "
        "| donated MB (`openxla` / fused_step / LazyTensor) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, loop in itertools.product(WORKLOADS, ("zero_grads", "accumulate4", "eager_optimizer")):
        up, fg, fs = (data.run(workload, loop, m) for m in (UPSTREAM, FUSED_GRAD, FUSED_STEP))
        try:
            lazy = data.run(workload, loop, LAZY)
            lazy_ratio, lazy_donated = f"{lazy['device_peak_mb_ratio']:.3f}", f"{lazy['donated_mb']:.1f}"
        except KeyError:
            lazy_ratio = lazy_donated = "—"
        lines.append(f"| {WORKLOADS[workload]} | {LOOP_NAMES[loop]} | {up['device_peak_mb']:.1f} | "
                     f"{fg['device_peak_mb_ratio']:.3f} | {fs['device_peak_mb_ratio']:.3f} | {lazy_ratio} | "
                     f"{up['donated_mb']:.1f} / {fs['donated_mb']:.1f} / {lazy_donated} |")
    return lines


def host_time(data: Data, doc: Path) -> list[str]:
    c = data.host["counts"]
    lines = [
        f"The last full run ({_machine(data.host['machine'])}; {c['rounds']} rounds, modes alternated; "
        f"[host_time.md]({_rel(doc, data.root / 'host_time.md')})), milliseconds per step and ratios to "
        "`openxla` in the same run:",
        "",
        "| workload | mode | execs/step | host ms | host ratio | host CPU ms | host CPU ratio "
        "| device ms (sum / busy) | pipelined ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in data.host["workloads"]:
        workload = w["workload"]
        for mode, r in w["rows"].items():
            name = WORKLOADS.get(workload, workload)
            if "error" in r:
                lines.append(f"| {name} | {mode_name(mode)} | error: {r['error'][:60]} |" + " |" * 6)
                continue
            lines.append(
                f"| {name} | {mode_name(mode)} | {r['executions_per_step']} | {num(r['host_ms'])} | "
                f"{r['host_ratio']:.3f} | {num(r['host_cpu_ms'])} | {r['host_cpu_ratio']:.3f} | "
                f"{r['device_ms']:.1f} / {r['busy_ms']:.1f} | {r['pipelined_ratio']:.3f} |")
    return lines


def per_op_ops(data: Data, doc: Path) -> list[str]:
    on, off = data.per_op_run(True), data.per_op_run(False)
    names = {
        "zero_": "`zero_`", "accumulate": "accumulate (`add_`)", "param write-back": "parameter write-back "
        "(`detach().copy_`)", "state write-back": "state write-back (`copy_`)",
        "sync per pending tensor": "materializing a pending tensor",
    }
    lines = [
        f"Host microseconds per tensor ({data.per_op['tensors']} tensors) for the ops, per parameter tensor of a "
        f"{data.per_op['workload']} step for the steps ([per_op.md]({_rel(doc, data.root / 'per_op.md')})):",
        "",
        "| op | per parameter per step | functionalization on | off |",
        "|---|---|---|---|",
    ]
    for op, count in data.per_op["floor_counts"].items():
        lines.append(f"| {names.get(op, op)} | {count} | {on['op_us'][op]:.1f} | {off['op_us'][op]:.1f} |")
    lines.append(f"| **floor**: their sum | | **{on['floor_us']:.1f}** | {off['floor_us']:.1f} |")
    for mode, r in (("openxla", "openxla"), ("openxla_fused_step", "openxla_fused_step")):
        lines.append(f"| whole step, `{mode}` | | {on['step_us'][r]:.1f} | {off['step_us'][r]:.1f} |")
    lines.append(f"| floor / `openxla` step | | **{on['floor_ratio']:.2f}** | {off['floor_ratio']:.2f} |")
    return lines


def per_op_embed(data: Data, doc: Path) -> list[str]:
    on, off = data.per_op_run(True), data.per_op_run(False)
    lines = [
        "Host microseconds per tensor, functionalization on (off):",
        "",
        "| n | embedding | sync of its outputs |",
        "|---|---|---|",
    ]
    for n, a in on["embedded_us"].items():
        b = off["embedded_us"][n]
        lines.append(f"| {n} | {a['embed']:.1f} ({b['embed']:.1f}) | {a['sync']:.1f} ({b['sync']:.1f}) |")
    return lines


def spmd(data: Data, doc: Path) -> list[str]:
    rows = data.spmd["rows"]
    first = rows[0]
    lines = [
        f"The committed run ([spmd.json]({_rel(doc, data.root / 'spmd.json')}); {first['depth']}-layer MLP of width "
        f"{first['width']}, {first['steps']} timed steps per backend and row), `openxla` against "
        "`openxla_fused_grad`:",
        "",
        "| layout | loop | executions | `openxla` ms | `openxla_fused_grad` ms | ratio of medians | block ratio "
        "| CPU-time ratio | largest parameter difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, m = r["executions_per_step"], r["median_ms"]
        lines.append(
            f"| {r['layout']} | {r['loop'].replace('mark_step', '`mark_step`')} | {e[UPSTREAM]} → {e[FUSED_GRAD]} | "
            f"{m[UPSTREAM]:.1f} | {m[FUSED_GRAD]:.1f} | {r['ratio_to_openxla'][FUSED_GRAD]:.3f} | "
            f"{r['median_block_ratio_to_openxla'][FUSED_GRAD]:.3f} | {r['cpu_ratio_to_openxla'][FUSED_GRAD]:.3f} | "
            f"{r['max_param_diff']:.3g} |")
    return lines


def spmd_llama(data: Data, doc: Path) -> list[str]:
    """bench.llama_spmd's rows: per device count, mesh and mode, what a step costs after the warm-up."""
    llama = data.spmd["llama"]
    a = llama["settings"]
    lines = [
        f"The committed run ([spmd.json]({_rel(doc, data.root / 'spmd.json')}), `python -m bench.llama_spmd`): "
        f"Llama with hidden size {a['hidden']}, {a['layers']} layers, {a['heads']} heads ({a['kv_heads']} KV), "
        f"vocabulary {a['vocab']}, sequences of {a['seq']}, micro-batch {a['batch']}; {llama['steps']} optimizer steps "
        f"of {a['accum']} micro-batches each, the first {llama['warmup']} compiling; bf16 autocast, HF's non-reentrant "
        "gradient checkpointing (lazy SPMD: none, the same math), eager AdamW with a cosine schedule. Memory: the "
        "largest compiled program's own buffers per device (arguments + outputs - donated + temporaries), and the "
        "bytes it donates, from XLA's memory analysis:",
        "",
        "| devices | mesh (fsdp, model) | mode | executions per optimizer step | compiled after warm-up "
        "(XLA programs / dynamo frames) | max abs(loss - lazy SPMD) | largest program per device | of it donated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in llama["rows"]:
        c = r["compiled_after_warmup"]
        lines.append(
            f"| {r['devices']} | ({r['mesh'][0]}, {r['mesh'][1]}) | {mode_name(r['mode'])} | {r['executions_per_step']} "
            f"| {c['xla_programs']} / {c['dynamo_frames']} | {r['max_loss_diff']:.1e} | "
            f"{1024 * r['device_peak_mb']:.0f} KiB | {1024 * r['donated_mb']:.0f} KiB |")
    return lines


def accumulation(data: Data, doc: Path) -> list[str]:
    """bench.accumulation's run: per K, each mode's executions, XLA compile time and largest program."""
    rows = data.accumulation["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    lines = [
        f"The last full run of `python -m bench.accumulation` ({data.accumulation['workload']}; "
        f"[table]({_rel(doc, data.root / 'accumulation.md')}), [data]({_rel(doc, data.root / 'accumulation.json')})): "
        f"executions per optimizer step, XLA compile seconds, the largest compiled program:",
        "",
        "| K | " + " | ".join(mode_name(m) for m in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for k in dict.fromkeys(r["micro"] for r in rows):
        cells = []
        for m in modes:
            r = data.accumulation_row(k, m)
            cells.append(f"not run ({r['skipped']})" if "skipped" in r else
                         f"{r['executions_per_step']}, {r['xla_compile_s']:.1f} s, {r['device_peak_mb']:.0f} MB")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


REGIONS: dict[str, Callable[[Data, Path], list[str]]] = {
    "accumulation": accumulation,
    "executions": executions,
    "headline": headline,
    "bench-steps": bench_steps,
    "bench-scaling": bench_scaling,
    "bench-memory": bench_memory,
    "host-time": host_time,
    "per-op": per_op_ops,
    "per-op-embed": per_op_embed,
    "spmd": spmd,
    "spmd-llama": spmd_llama,
}

# --- rewriting the docs ----------------------------------------------------------------------

REGION = re.compile(r"^<!-- generated: (?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- end generated -->$", re.S | re.M)
FIG = re.compile(r"<!--fig:(?P<spec>[^>]*?)-->(?P<text>.*?)<!--/fig-->", re.S)


def docs(root: Path = ROOT) -> list[Path]:
    """Every page that may quote results: README.md and docs/**/*.md."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def render(text: str, doc: Path, data: Data) -> str:
    """``text`` with every generated region and figure rendered from ``data`` (KeyError: unknown or missing)."""

    def region(m: re.Match) -> str:
        name = m["name"]
        if name not in REGIONS:
            raise KeyError(f"{doc.name}: unknown generated region {name!r}")
        return f"<!-- generated: {name} -->\n\n" + "\n".join(REGIONS[name](data, doc)) + "\n\n<!-- end generated -->"

    def fig(m: re.Match) -> str:
        return f"<!--fig:{m['spec']}-->{figure(data, m['spec'])}<!--/fig-->"

    regions, figs = len(REGION.findall(text)), len(FIG.findall(text))
    if text.count("<!-- generated:") != regions or text.count("<!-- end generated -->") != regions:
        raise ValueError(f"{doc.name}: a generated region without its end marker, or one inside another")
    if text.count("<!--fig:") != figs or text.count("<!--/fig-->") != figs:
        raise ValueError(f"{doc.name}: a <!--fig:...--> without its <!--/fig-->")
    return FIG.sub(fig, REGION.sub(region, text))


def pages(data: Data) -> dict[str, str]:
    """The result pages, rendered by the bench's own writers (they import torch_xla)."""
    from bench.__main__ import markdown as results_md
    from bench.host_time import markdown as host_time_md
    from bench.per_op import markdown as per_op_md

    r = data.results
    return {
        "results.md": results_md(r["results"], r["machine"], r["quick"]),
        "host_time.md": host_time_md(data.host),
        "per_op.md": per_op_md(data.per_op),
    }


# --- figures typed by hand where the docs quote results --------------------------------------

CITES = re.compile(r"(results|host_time|per_op)\.(md|json)|spmd\.json|last full run", re.I)
MEASURED_SEPARATELY = re.compile(r"measured separately", re.I)
COMMAND = re.compile(r"`(?:[A-Z_]+=\S*\s+)*(?:python|bash|pytest)\b[^`]*`")
# A number, with its unit if any; not part of a name (ResNet-18, mlp32x256, v2.9.0, `code`).
NUMBER = re.compile(r"(?<![\w.\-/+=])\d+(?:[.,]\d+)*(?:\s?(?:x|ms|µs|s|MB|GB|GiB|%))?(?![\w.]\d|\w)")
# Numbers that name a configuration rather than quote a result: "32 layers", "10 and 100 tensors", ...
CONFIG = re.compile(
    r"(?:\s*(?:,|and|or|to)\s*\d+)*\s*(?:-layer|-core|-device|-tensor|layers?\b|cores?\b|micro-batch|parameter tensors"
    r"|tensors\b|gradients\b|parameters\b|devices?\b|steps?\b|blocks?\b|rounds\b|images\b|minutes?\b)")
# ... or that are not results: a target, an order of magnitude.
NOT_A_RESULT = re.compile(r"(?:target of|~)\s*$", re.I)
FENCE = re.compile(r"^```.*?^```$", re.S | re.M)
CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")


def _blocks(section: str) -> list[str]:
    """Paragraphs, list items and tables; a paragraph that ends with ':' goes with the block after it."""
    blocks: list[list[str]] = []
    fresh = True
    for line in section.split("\n"):
        if not line.strip():
            fresh = True
            continue
        if not (fresh or ITEM.match(line)):
            blocks[-1].append(line)
        elif fresh and blocks and blocks[-1][-1].rstrip().endswith(":"):
            blocks[-1].append(line)
        else:
            blocks.append([line])
        fresh = False
    return ["\n".join(b) for b in blocks]


def unchecked_figures(text: str) -> list[tuple[str, str]]:
    """(number, its block) for each number typed by hand in a block that quotes results."""
    text = FENCE.sub(lambda m: "\n" * m.group().count("\n"), text)
    found = []
    for section in re.split(r"(?=^#{1,6} )", text, flags=re.M):
        generated = bool(REGION.search(section))
        section = REGION.sub("", section)
        for block in _blocks(section):
            if not (generated or CITES.search(block)):
                continue
            if MEASURED_SEPARATELY.search(block) and COMMAND.search(block):
                continue
            prose = FIG.sub("", block)
            prose = CODE.sub("", LINK_TARGET.sub("]", prose))
            prose = re.sub(r"<!--.*?-->", "", prose, flags=re.S)
            for m in NUMBER.finditer(prose):
                if not (CONFIG.match(prose, m.end()) or NOT_A_RESULT.search(prose, 0, m.start())):
                    found.append((m.group(), block))
    return found


# --- command line ----------------------------------------------------------------------------


def check(root: Path = ROOT, with_pages: bool = True) -> list[str]:
    """What is stale or unchecked, one line each (empty: the docs quote the results exactly)."""
    data = Data(root / "docs" / "benchmarks")
    problems = []
    for doc in docs(root):
        text = doc.read_text()
        name = doc.relative_to(root)
        try:
            if render(text, doc, data) != text:
                problems.append(f"{name}: stale figures (python -m bench.tables rewrites them)")
        except (KeyError, ValueError) as e:
            problems.append(f"{name}: {e.args[0] if e.args else e}")
        for number, block in unchecked_figures(text):
            problems.append(f"{name}: {number!r} is typed by hand where the docs quote results: {block[:120]!r}")
    if with_pages:
        for page, rendered in pages(data).items():
            if (data.root / page).read_text() != rendered:
                problems.append(f"docs/benchmarks/{page}: not the rendering of its JSON")
    return problems


def write(root: Path = ROOT) -> list[Path]:
    """Rewrites what is stale; renders everything first, so that an error leaves every file as it was."""
    data = Data(root / "docs" / "benchmarks")
    rendered = {doc: render(doc.read_text(), doc, data) for doc in docs(root)}
    rendered.update({data.root / page: text for page, text in pages(data).items()})
    changed = [path for path, text in rendered.items() if path.read_text() != text]
    for path in changed:
        path.write_text(rendered[path])
    return changed


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is stale or unchecked")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.root)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    try:
        changed = write(args.root)
    except (KeyError, ValueError) as e:
        print(f"nothing rewritten: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"rewrote {path.relative_to(args.root)}")
    problems = check(args.root, with_pages=False)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
