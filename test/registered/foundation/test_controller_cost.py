"""benchmark/spec/controller_cost.py: the shape policy controller's work per decode step,
counted in function calls (exact, whatever the host), so a change that makes every step dearer
for the scheduler's host loop shows here rather than only in a GPU run's noise."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "spec"))
import controller_cost  # noqa: E402

# A settled four-shape policy at bs 48 made 183 calls a step (243 tracing) before choose()
# scored each shape once a decision and shapes became tuples; 77 (120) after; 90 (138) with
# contexts reported; 102 (147) with prices carried to the batch's context (ContextSlope).
MAX_CALLS_PER_STEP = 110
MAX_CALLS_PER_TRACED_STEP = 150


def test_a_settled_step_stays_cheap():
    cost = controller_cost.measure(bs=48, steps=500, trace=False)
    assert 0 < cost.calls_per_step <= MAX_CALLS_PER_STEP, cost
    # The run is the case measured: the policy settled on the cheapest shape per token.
    steps = cost.steps_by_shape
    assert max(steps, key=steps.get) == "1,3,4", steps


def test_a_traced_step_stays_cheap():
    cost = controller_cost.measure(bs=48, steps=500, trace=True)
    assert 0 < cost.calls_per_step <= MAX_CALLS_PER_TRACED_STEP, cost


def test_the_script_prints_both_rows(capsys):
    assert controller_cost.main(["--bs", "4", "--steps", "200"]) == 0
    out = capsys.readouterr().out
    assert "trace off:" in out and "trace on :" in out, out
