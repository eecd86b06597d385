"""The execution report and the autograd graph dump on known cases."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm

from limits import HANG_TIMEOUT_S
import torch_xla_bridge
from torch_xla_bridge import names
from torch_xla_bridge.explain import Cause, autograd_graph, explain, format_text, print_report, run_script
from torch_xla_bridge.explain import events as ev
from torch_xla_bridge.explain import recorder
from torch_xla_bridge.explain.__main__ import parse_args
from torch_xla_bridge.explain.build import COUNTED, build
from torch_xla_bridge.explain.report import predict
from xla_helpers import FUSED, FUSED_STEP, UPSTREAM, TinyTransformer, device, executions, mlp, mlp_task, train

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "original_report.py"
USER_LOOPS = ROOT / "test" / "user_loops.py"
ADAMW = ROOT / "test" / "compiled_adamw.py"
F_, B, O = Cause.FORWARD, Cause.BACKWARD, Cause.OPTIMIZER


@pytest.fixture(autouse=True)
def no_pending_work():
    """Earlier tests may leave live tensors with pending IR; the first sync would run them."""
    torch_xla.sync()
    xm.wait_device_ops()


def causes(step):
    return [e.cause for e in step.executions]


def all_executions(report):
    return [e for s in report.steps for e in s.executions]


def test_upstream_loop_explained_as_input_sync_and_gradient_accumulation():
    with explain() as ex:
        run = train(mlp_task(), UPSTREAM, steps=3, set_to_none=False)
    report = ex.report
    # Steps end where the training loop's own phases say, and nothing is missed.
    assert [s.total for s in report.steps] == [r.total for r in run.steps]
    assert report.total == report.metrics["ExecuteTime"]
    assert causes(report.steps[-1]) == [F_, Cause.INPUT_SYNC, B, Cause.GRAD_ACCUMULATION, O]
    assert len(report.steps[-1].pending_grads) == 6  # every parameter of the MLP
    syncs = [e for e in all_executions(report) if e.entry == "_xla_sync_multi"]
    assert len(syncs) == report.metrics["DynamoSyncInputExecuteTime"]
    assert "aten::add" in syncs[-1].ir  # the accumulation AccumulateGrad left pending
    assert report.verdict().startswith(
        "5 executions per step (steps 2-3); 2 avoidable: input sync, gradient accumulation"
    )


def test_fused_loop_has_nothing_avoidable_and_steps_stop_on_request():
    with explain(steps=3) as ex:
        train(mlp_task(), FUSED, steps=6, set_to_none=False)
    report = ex.report
    assert report.stopped_after == 3 and len(report.steps) == 3
    assert report.total == report.metrics["ExecuteTime"]
    for step in report.steps[1:]:
        assert causes(step) == [F_, B, O]
        assert step.pending_grads == []
    assert not any(e.avoidable for e in all_executions(report))
    backward = [e for e in all_executions(report) if e.cause is B]
    assert len(backward) == report.metrics["OpenxlaFusedGradSync"] == 3
    assert report.verdict().startswith(
        "3 executions per step (steps 2-3); none avoidable (forward, backward, optimizer); "
        "predicted per step: openxla_fused_grad 3, openxla_fused_step >=1 (estimate: "
    )


def test_original_report_under_the_fused_backend_shows_nothing_avoidable():
    explainer, status = run_script(str(EXAMPLE), ["--backend", FUSED, "--iters", "4"])
    report = explainer.report
    assert status == 0 and len(report.steps) == 4
    assert all(causes(step) == [F_, B, O] for step in report.steps)
    assert all(step.pending_grads == [] for step in report.steps)  # data.grad too: its read executes nothing
    assert report.total == report.metrics["ExecuteTime"] == 12
    text = format_text(report)
    assert text.count("deferred backward + .grad accumulation:") == 4
    # Its data.grad read executed nothing here; under openxla_fused_step it does: the count is only a bound.
    assert (
        "verdict: 3 executions per step (steps 2-4); none avoidable (forward, backward, optimizer); "
        "predicted per step: openxla_fused_grad 3, openxla_fused_step >=1 (estimate: "
    ) in text
    rich_out = io.StringIO()
    print_report(report, file=rich_out)
    assert "step 4: 3 executions" in rich_out.getvalue() and "none avoidable" in rich_out.getvalue()


def test_fused_step_backend_is_one_cut_per_step():
    if not (Path(torch_xla_bridge.__file__).parent / "fused_step.py").exists():
        pytest.skip("no openxla_fused_step backend in this tree")
    with explain() as ex:
        run = train(mlp_task(), "openxla_fused_step", steps=3, set_to_none=False)
    report = ex.report
    assert [s.total for s in report.steps] == [r.total for r in run.steps]
    assert causes(report.steps[-1]) == [Cause.MARK_STEP]
    assert "openxla_fused_step cuts the step" in report.steps[-1].executions[0].detail
    assert report.total == report.metrics["ExecuteTime"]


def test_mark_step_after_an_eager_optimizer_ends_the_step():
    with explain() as ex:
        run = train(mlp_task(), UPSTREAM, steps=3, compiled_optimizer=False)
    report = ex.report
    assert [s.total for s in report.steps] == [r.total for r in run.steps]
    assert causes(report.steps[-1]) == [F_, Cause.INPUT_SYNC, B, Cause.MARK_STEP]
    assert report.total == report.metrics["ExecuteTime"]


def test_lazy_loop_read_before_backward_opens_the_next_step():
    model = mlp().to(device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    with explain(steps=3) as ex:
        for _ in range(5):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.item()  # executes the forward: the first execution of its step
            loss.backward()
            opt.step()
            xm.mark_step()
    report = ex.report
    assert [causes(s) for s in report.steps[:3]] == [[Cause.OTHER, Cause.MARK_STEP]] * 3
    # Stopped when step 4 began: its first execution is listed, as an incomplete step.
    assert [causes(s) for s in report.steps[3:]] == [[Cause.OTHER]] and not report.steps[3].complete
    assert report.total == report.metrics["ExecuteTime"] == 7


def test_manual_step_boundaries():
    model = mlp().to(device())
    compiled = torch.compile(model, backend=FUSED)
    x = torch.randn(8, 16).to(device())
    with explain(steps=2) as ex, torch.no_grad():
        for _ in range(4):
            compiled(x)
            ex.step()
    assert [causes(s) for s in ex.report.steps] == [[F_], [F_]]
    assert ex.report.stopped_after == 2


def test_value_read_outside_entry_points_is_listed():
    x = torch.randn(4, 4).to(device())
    with explain() as ex:
        (x * 2).sum().item()  # lazy: executes in torch_xla's C++, no Python entry point
    (step,) = ex.report.steps
    assert step.complete is False
    assert [e.cause for e in step.executions] == [Cause.OTHER]
    assert ex.report.total == ex.report.metrics["ExecuteTime"] == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="steps must be a positive"):
        explain(steps=0)
    with explain():
        with pytest.raises(RuntimeError, match="already active"):
            explain().__enter__()
    script = str(EXAMPLE)
    args = parse_args(["--json", "r.json", script, "--steps", "3", "--lr", "0.1", "--", "--steps", "9"])
    assert (args.script, args.steps, args.json) == (script, 3, "r.json")
    assert args.script_args == ["--lr", "0.1", "--steps", "9"]
    for argv in (["--steps", "2"], ["missing.py"], [script, "--steps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    # After the script path, --help is the script's.
    assert parse_args([script, "--help"]).script_args == ["--help"]
    assert parse_args(["--steps", "2", script, "-h"]).script_args == ["-h"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_options_and_exits_0(flag):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-m", "torch_xla_bridge.explain", flag], env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m torch_xla_bridge.explain")
    for option in ("--steps N", "--json PATH", "--graph PATH", "train.py"):
        assert option in proc.stdout


def test_cli_explains_the_original_report(tmp_path):
    out_json, out_dot = tmp_path / "report.json", tmp_path / "graph.dot"
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("PT_XLA_DEBUG_FILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch_xla_bridge.explain", str(EXAMPLE), "--steps", "3",
         "--json", str(out_json), "--graph", str(out_dot), "--backend", "openxla"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["analysis"] is True and report["stopped_after"] == 3
    assert report["total_executions"] == report["metrics"]["ExecuteTime"]
    steady = report["steps"][-1]
    assert [e["cause"] for e in steady["executions"]] == [
        "forward", "input sync", "backward", ".grad read", "gradient accumulation", "optimizer"
    ]
    # torch_xla's analysis gives every execution a hash and counts; the read its frame.
    assert all(e["graph_hash"] and e["inputs"] is not None for e in steady["executions"])
    read_line = EXAMPLE.read_text().splitlines().index("        data_grad = data.grad.cpu()  # the read that the original report saw execute") + 1
    assert steady["executions"][3]["frame"].endswith(f"original_report.py:{read_line} in main")
    assert "verdict: 6 executions per step (steps 2-3); 3 avoidable" in " ".join(proc.stdout.split())
    contributors = [leaf["contributors"] for leaf in report["autograd_graph"]["leaves"]]
    assert contributors == [[{"node": "CompiledFunctionBackward", "edges": 1}]] * 7
    dot = out_dot.read_text()
    assert dot.count("AccumulateGrad") == 7 and "CompiledFunctionBackward" in dot
    assert (tmp_path / "graph.png").exists() == (shutil.which("dot") is not None)


_SPMD_SCRIPT = """
import numpy as np, torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
xr.use_spmd()  # first, as SPMD scripts begin: nothing may have started the runtime before
import torch_xla_bridge
model = torch.nn.Linear(8, 8).to(torch_xla.device())
mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4, 1), ("fsdp", "model"))
xs.mark_sharding(model.weight, mesh, ("fsdp", None))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
fwd = torch.compile(model, backend="openxla_fused_step")
for _ in range(3):
    x = torch.randn(8, 8).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("fsdp", None))
    opt.zero_grad()
    fwd(x).sum().backward()
    opt.step()
"""


def test_cli_explains_an_spmd_script(tmp_path):
    """A script that switches SPMD on at its start: the explainer starts no runtime before it (waiting
    for the device did, in single-device mode, and the script's first device then failed)."""
    script, out_json = tmp_path / "train_spmd.py", tmp_path / "report.json"
    script.write_text(_SPMD_SCRIPT)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("PT_XLA_DEBUG_FILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch_xla_bridge.explain", str(script), "--json", str(out_json)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert [len(s["executions"]) for s in report["steps"]] == [1, 1, 1]
    assert report["total_executions"] == 3
    assert all(e["cause"] == "mark_step" for s in report["steps"] for e in s["executions"])


def test_tied_weights_show_two_contributors():
    torch.manual_seed(0)
    model = TinyTransformer()
    tokens = torch.randint(0, 32, (2, 8))
    loss = F.cross_entropy(model(tokens).reshape(-1, 32), tokens.reshape(-1))
    graph = autograd_graph(loss, model)
    params = dict(model.named_parameters())
    assert sorted(leaf.name for leaf in graph.leaves) == sorted(params)
    assert sorted(graph.contributors("embed.weight")) == ["EmbeddingBackward0", "TBackward0"]
    assert len(graph.contributors("norm.weight")) == 1
    assert "embed.weight [32x16]: 2 contributors" in graph.text()
    assert graph.dot().count("fillcolor=orange") == 1  # only the tied weight


def test_compiled_graph_is_the_single_contributor():
    model = mlp().to(device())
    compiled = torch.compile(model, backend=FUSED)
    loss = F.mse_loss(compiled(torch.randn(8, 16).to(device())), torch.randn(8, 4).to(device()))
    graph = autograd_graph(loss, model)
    assert [graph.contributors(n) for n in dict(model.named_parameters())] == [["CompiledFunctionBackward"]] * 6


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed (apt-get install graphviz)")
def test_autograd_graph_renders_png(tmp_path):
    model = mlp()
    graph = autograd_graph(F.mse_loss(model(torch.randn(2, 16)), torch.randn(2, 4)), model)
    path = graph.render(str(tmp_path / "g.png"))
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fresh_inputs_loop(backend: str, steps: int = 3) -> list[int]:
    """Batches drawn on the device (pending inputs), zero_grad(set_to_none=False), compiled SGD."""
    torch.manual_seed(0)
    model = mlp().to(device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = torch.compile(lambda x, y: F.mse_loss(model(x), y), backend=backend)
    step = torch.compile(opt.step, backend=backend)
    per_step = []
    for _ in range(steps):
        before = executions()
        opt.zero_grad(set_to_none=False)
        fwd(torch.randn(8, 16, device=device()), torch.randn(8, 4, device=device())).backward()
        step()
        per_step.append(executions() - before)
    return per_step


def test_verdict_predicts_what_each_backend_runs():
    """The forward's input sync stays under openxla_fused_grad; the prediction matches each backend's run."""
    with explain() as ex:
        ran = _fresh_inputs_loop(UPSTREAM)
    report = ex.report
    assert report.steps[-1].total == ran[-1] == 6
    first_sync = report.steps[-1].executions[0]
    assert first_sync.cause is Cause.INPUT_SYNC and not first_sync.in_backward and not first_sync.avoidable
    fused_grad, fused_step = _fresh_inputs_loop(FUSED)[-1], _fresh_inputs_loop(FUSED_STEP)[-1]
    assert (fused_grad, fused_step) == (4, 1)
    assert report.verdict().endswith(
        f"predicted per step: openxla_fused_grad {fused_grad}, openxla_fused_step {fused_step}"
    )


def test_recorded_events_rebuild_the_report_after_a_json_round_trip():
    """The report is a function of the events alone, and the events are plain data."""
    with explain(steps=2) as ex:
        train(mlp_task(), UPSTREAM, steps=4, set_to_none=False)
    stored = json.loads(json.dumps(ev.to_dicts(ex.events)))
    assert build(ev.from_dicts(stored)).to_dict() == ex.report.to_dict()
    assert ev.Stopped(2) in ex.events and ex.events[-1] == ev.Finished(raised=True, execute_time=ex.report.total)
    # Upstream's input syncs are told by the counter its bridge bumps right before each.
    syncs = [e for e in ex.events if isinstance(e, ev.CallStarted) and e.entry == ev.SYNC_MULTI]
    assert syncs and all(e.counters.get(names.INPUT_SYNC_COUNTER) == 1 for e in syncs)


def test_fused_step_forward_executed_on_its_own_is_told_by_its_counter():
    """After a read between forward and backward, openxla_fused_step runs the forward on its own."""
    torch.manual_seed(0)
    model = mlp().to(device())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend=FUSED_STEP)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    with pytest.warns(UserWarning, match=FUSED_STEP), explain() as ex:
        for _ in range(4):
            loss = F.mse_loss(compiled(x), y)
            loss.item()  # the read that unfuses the forward
            loss.backward()
            opt.step()
            opt.zero_grad()
            xm.mark_step()
    report = ex.report
    assert report.total == report.metrics["ExecuteTime"]
    alone = [e for e in all_executions(report) if e.detail.startswith("forward executed on its own")]
    assert [e.cause for e in alone] == [F_] * 3  # steps 2-4; step 1 read the deferred forward
    assert [causes(s)[0] for s in report.steps[1:]] == [F_] * 3
    assert report.metrics[names.FORWARD_ALONE_COUNTER] == 3


def test_a_counter_cleared_by_the_bridge_still_counts_its_bumps(monkeypatch):
    """Upstream's bridge clears all counters while it compiles: a drop restarts the count from zero."""
    ex = recorder.Explainer()
    ex._counters = dict.fromkeys(COUNTED, 5)
    now = {names.INPUT_SYNC_COUNTER: 1, names.SYNC_COUNTER: 7, names.STEP_COUNTER: 0}
    monkeypatch.setattr(recorder.counting, "counter", lambda name: now.get(name, 5))
    assert ex._counter_increments() == {names.INPUT_SYNC_COUNTER: 1, names.SYNC_COUNTER: 2}
    assert ex._counter_increments() == {}  # the new values are the baseline


# --- one explained run per (script, backend), shared by the tests below ---------------

ITERATIONS = 5
# name: (script, its arguments before the backend's); user_loops' loops run 5 iterations.
SCRIPTS = {
    "original_report": (EXAMPLE, ["--iters", str(ITERATIONS), "--backend"]),
    "compiled_adamw": (ADAMW, ["--iters", str(ITERATIONS), "--backend"]),
    "compiled_adamw_eager_forward": (ADAMW, ["--iters", str(ITERATIONS), "--eager-forward", "--backend"]),
    "clip_compiled_optimizer": (USER_LOOPS, ["clip_compiled_optimizer"]),
    "item_after_eager_step": (USER_LOOPS, ["item_after_eager_step"]),
}


@pytest.fixture(scope="module")
def explained():
    """``explained(script, backend)``: the report of that script run under explain, made once per module."""
    reports = {}

    def run(script: str, backend: str):
        if (script, backend) not in reports:
            torch._dynamo.reset()
            path, args = SCRIPTS[script]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the fallback warnings the loops are known to give
                explainer, status = run_script(str(path), [*args, backend])
            assert status == 0
            reports[script, backend] = explainer.report
        return reports[script, backend]

    return run


@pytest.mark.parametrize("backend", [UPSTREAM, FUSED_STEP])
@pytest.mark.parametrize("script", ["compiled_adamw", "compiled_adamw_eager_forward"])
def test_a_compiled_optimizer_step_split_by_dynamo_is_one_step(explained, script, backend):
    """N iterations of a loop whose compiled AdamW step dynamo splits into graphs: N steps."""
    report = explained(script, backend)
    assert len(report.steps) == ITERATIONS
    assert all(s.complete and s.optimizer_steps == 1 and s.backward_passes == 1 for s in report.steps)
    assert report.total == report.metrics["ExecuteTime"]
    if backend == UPSTREAM:  # the case: the step ran as several graphs (fused, they would execute nothing)
        assert min(sum(e.cause is O for e in s.executions) for s in report.steps[1:]) > 1
    assert len({s.total for s in report.steps[1:]}) == 1  # the same work every steady step


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_predictions_equal_what_the_fused_backends_measure(explained, script):
    """Each step's prediction under openxla against the same step measured under each fused backend.

    Steps 3 to N-1: steps 1 and 2 compile (on different steps in different
    backends), the last also holds what the script ran after training.
    """
    upstream = explained(script, UPSTREAM)
    measured = {backend: explained(script, backend) for backend in (FUSED, FUSED_STEP)}
    assert all(len(r.steps) == len(upstream.steps) for r in measured.values())
    compared = 0
    for i in range(2, len(upstream.steps) - 1):
        for p in predict(upstream.steps[i]):
            total = measured[p.backend].steps[i].total
            if p.exact:
                assert p.low == total, (p.backend, i, str(p))
            else:
                assert p.low <= total and (p.high is None or total <= p.high), (p.backend, i, str(p))
                assert "(estimate: " in str(p)
            compared += 1
    assert compared == 2 * (len(upstream.steps) - 3)
    # The verdict states the prediction of a steady step.
    assert str(predict(upstream.steps[2])[1]) in upstream.verdict()


def test_grad_left_pending_is_flagged_only_where_it_costs_an_execution(explained):
    """openxla_fused_step's cut runs the pending .grad with the step: by design, not flagged; openxla's sync is."""
    fused_step = explained("compiled_adamw_eager_forward", FUSED_STEP)
    upstream = explained("compiled_adamw_eager_forward", UPSTREAM)
    params = 6
    assert all(s.pending_grads == [] and len(s.grads_in_cut) == params for s in fused_step.steps)
    assert "pending IR left on .grad" not in format_text(fused_step)
    assert all(len(s.pending_grads) == params and s.grads_in_cut == [] for s in upstream.steps)
    assert "pending IR left on .grad after backward: 6 leaves" in format_text(upstream)
    # A read of a pending .grad before the cut costs an execution under openxla_fused_step too.
    original = explained("original_report", FUSED_STEP)
    assert all(s.pending_grads == ["tensor0"] for s in original.steps)


# --- the samples shown in docs/explain.md ---------------------------------------------

_PROMPT = "$ PJRT_DEVICE=CPU python -m torch_xla_bridge.explain "


def _samples() -> list[tuple[str, str, list[str]]]:
    """(file, command's arguments, the lines shown after its `...`) of every explain sample in the docs."""
    samples = []
    for doc in ("README.md", "docs/explain.md"):  # README.md: none now, but one added there is checked too
        for block in re.findall(r"```text\n(.*?)```", (ROOT / doc).read_text(), flags=re.S):
            lines = block.rstrip("\n").split("\n")
            if lines[0].startswith(_PROMPT):
                assert lines[1] == "...", f"{doc}: a sample shows the end of the output, after `...`"
                samples.append((doc, lines[0][len(_PROMPT):], lines[2:]))
    return samples


@pytest.fixture(scope="module")
def sample_output():
    """``sample_output(args)``: stdout of the command shown, run once from the repository root."""
    outputs = {}
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for name in ("PT_XLA_DEBUG_FILE", "PT_XLA_DEBUG_LEVEL", "COLUMNS"):  # the CLI's defaults, its table width
        env.pop(name, None)

    def run(args: str) -> list[str]:
        if args not in outputs:
            proc = subprocess.run(
                [sys.executable, "-m", "torch_xla_bridge.explain", *args.split()],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            outputs[args] = [line.rstrip() for line in proc.stdout.splitlines()]
        return outputs[args]

    return run


def test_the_docs_show_explain_samples():
    docs = {doc for doc, _, _ in _samples()}
    assert docs == {"docs/explain.md"} and len(_samples()) >= 2
    page = (ROOT / "docs/explain.md").read_text()
    section = page[page.index("## Command line") : page.index("## Python")]
    # The samples are rich tables: the section that shows them names the extra that prints them so.
    assert section.count(_PROMPT) == len(_samples()) and "pip install -e .[explain]" in section


@pytest.mark.parametrize("doc, args, shown", _samples(), ids=[s[1] for s in _samples()])
def test_doc_samples_are_the_tools_current_output(sample_output, doc, args, shown):
    """What the docs show after `...` is the end of what the command prints now, but for graph hashes:
    torch_xla's hash of a graph is the same in every run of the same script on one machine, not across
    machines (measured: every hash of the original-report sample differed between two 2-core Xeon
    machines with the same packages), so a hash cell only has to be a hash."""
    pytest.importorskip("rich", reason="the samples are rich tables (the explain extra)")
    out = sample_output(args)
    assert [_HASH_CELL.sub("│ <hash> │", line) for line in out[-len(shown):]] == [
        _HASH_CELL.sub("│ <hash> │", line) for line in shown
    ], f"{doc}: the sample for `{args}` is not the current output"


_HASH_CELL = re.compile(r"│ [0-9a-f]{12} │")
