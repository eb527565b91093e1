"""The autotuner's acceptance on the example GPT (specs/autotune.md §Measured): every ZeRO stage x
micro-batch {1, 2, 4, 8, 16} x offload {none, cpu} (35 candidates) as 2-rank jobs, two rounds, the
step-time model's out-of-sample prediction of each, and the model_based tuner's choice against the
grid's (both two rounds). About 16 minutes on the 2-core machine: `-m slow`."""

import json
import os
import statistics

import pytest

from fnzero.cli._main import main as cli
from fnzero.config._parse import read_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
SPACE = ["--world", "2", "--stages", "0,1,2,3", "--micro-batch-sizes", "1,2,4,8,16", "--offload", "none,cpu"]


def _tune(tmp_path, name, **block):
    raw, _ = read_source(os.path.join(ROOT, "examples", "configs", "zero3.json"))
    raw["autotuning"] = {"enabled": True, "start_profile_step": 3, "end_profile_step": 33,
                         "results_dir": str(tmp_path / name), "exps_dir": str(tmp_path / f"{name}_exps"), **block}
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(raw))
    assert cli(["autotune", *SPACE, "--rounds", "2", SCRIPT, "--config", str(cfg), "--checkpoint-dir", ""]) == 0
    return {r["name"]: r for r in json.loads((tmp_path / name / "autotune_results.json").read_text())}


@pytest.mark.slow
def test_example_gpt_every_candidate_predicted_out_of_sample_and_the_model_based_choice(tmp_path, capsys):
    grid = _tune(tmp_path, "grid", tuner_early_stopping=100)
    assert len(grid) == 35 and all(r["status"] == "ok" and len(r["job_step_times_s"]) == 2 for r in grid.values())
    errors = {n: r["prediction_error"] for n, r in grid.items()}  # each from the model fitted to the other 34
    with capsys.disabled():
        print("\n" + "\n".join(f"{n}: measured {r['step_time_s'] * 1e3:.1f} ms (jobs "
                               f"{', '.join(f'{t * 1e3:.1f}' for t in r['job_step_times_s'])}), predicted "
                               f"{r['predicted_step_s'] * 1e3:.1f} ms ({100 * errors[n]:+.1f}%)"
                               for n, r in sorted(grid.items())))
    # Every candidate within 20 % (specs/autotune.md §Measured; with fewer trials per stage to fit
    # from, the smallest steps, where jobs differ most, reach 20-27 %).
    assert all(abs(e) < 0.20 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) < 0.10, errors
    # The model_based tuner (early stopping 5) picks, in its own run, a config within 10 % of the
    # grid's fastest, by the grid's own measurements. (With one round, it once chose z0_mbs16, which
    # its own run measured fastest and the grid's two jobs measured 11 % below z1_mbs16; in the run
    # before, z0_mbs16 was the grid's fastest: the top three are within the jobs' spread.)
    mb = _tune(tmp_path, "model", tuner_type="model_based", tuner_early_stopping=5)
    chosen = max((r for r in mb.values() if r["status"] == "ok"), key=lambda r: r["samples_per_s"])["name"]
    fastest = max(r["samples_per_s"] for r in grid.values())
    assert grid[chosen]["samples_per_s"] >= 0.9 * fastest, (chosen, grid[chosen]["samples_per_s"], fastest)
    assert sum(r["status"] == "ok" for r in mb.values()) < len(grid)  # it did not run everything
