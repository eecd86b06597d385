"""`python -m bench.accumulation` measures what it says, for the fused step and for torch_xla's While loop.

Two configurations at K=3 on a tiny MLP, each in its own process as the
benchmark runs them: executions per optimizer step as each mode guarantees
(one for the fused step; torch_xla's `gradient_accumulation` syncs the host
after its loop, then the optimizer executes: two), the compile, memory and
resident-state figures present and positive, and the table rendering them.
"""

from __future__ import annotations

from bench.accumulation import markdown, run_one

WORKLOAD = "mlp2x16"


def test_rows_for_the_fused_step_and_torch_xla_while_loop() -> None:
    rows = [run_one(WORKLOAD, mode, 3, steps=2, warmup=2) for mode in ("openxla_fused_step", "gradient_accumulation")]
    assert [r.get("error") for r in rows] == [None, None]
    assert [r["executions_per_step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["micro"] == 3
        assert r["xla_compile_s"] > 0 and r["first_two_s"] > 0 and r["step_ms"] > 0
        assert r["device_peak_mb"] > 0
        # 3 layers of 16x16 + bias (2 hidden, 1 to 10 classes): parameters, gradients and momentum.
        params = (2 * (16 * 16 + 16) + (16 * 10 + 10)) * 4 / 2**20
        assert abs(r["resident_mb"] - 3 * params) < 1e-9
    table = markdown(rows, WORKLOAD)
    assert "| 3 | openxla_fused_step | 1 |" in table and "| 3 | gradient_accumulation | 2 |" in table
