"""TAN figures are written (smoke test on a tiny grid)."""

from __future__ import annotations

from dpfy.accounting import tan
from dpfy.planning import plan
from dpfy.report import plots_tan


def test_figures_are_written(tmp_path):
    wall = plots_tan.privacy_wall(
        tmp_path / "wall.png", target_epsilons=(2.0,), steps=(100, 1000),
        noise_multipliers=[0.3, 1.0, 3.0],
    )
    fit = tan.fit_batch_scaling([32, 64, 128], [90.0, 89.5, 89.4])
    scaling = plots_tan.batch_scaling(fit, tmp_path / "fit.png", reference_batch=512,
                                      reference_values=[89.0])
    p = plan(1000, 2.0, 1e-6, max_steps=100, runner_ups=1)
    options = plots_tan.plan_options(p, tmp_path / "plan.png")
    for path in (wall, scaling, options):
        assert path.exists() and path.stat().st_size > 5_000
