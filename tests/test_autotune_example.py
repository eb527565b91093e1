"""The autotuner's acceptance on the example GPT (specs/autotune.md §Measured): every ZeRO stage x
micro-batch {1, 2, 4, 8, 16} x offload {none, cpu} (35 candidates) as 2-rank jobs, two rounds, the
step-time model's out-of-sample prediction of each, and the model_based tuner's choice against the
grid's (both two rounds, then --confirm's default), the two then run head to head. About 17 minutes on the 2-core machine:
`-m slow`."""

import json
import os
import statistics
import types

import pytest

from fnzero.autotune import Candidate
from fnzero.cli._main import main as cli
from fnzero.cli.autotune._jobs import run_trial
from fnzero.config._parse import read_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
SPACE = ["--world", "2", "--stages", "0,1,2,3", "--micro-batch-sizes", "1,2,4,8,16", "--offload", "none,cpu"]


def _raw():
    return read_source(os.path.join(ROOT, "examples", "configs", "zero3.json"))[0]


def _tune(tmp_path, name, **block):
    raw = _raw()
    raw["autotuning"] = {"enabled": True, "start_profile_step": 3, "end_profile_step": 33,
                         "results_dir": str(tmp_path / name), "exps_dir": str(tmp_path / f"{name}_exps"), **block}
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(raw))
    assert cli(["autotune", *SPACE, "--rounds", "2", SCRIPT, "--config", str(cfg), "--checkpoint-dir", ""]) == 0
    return {r["name"]: r for r in json.loads((tmp_path / name / "autotune_results.json").read_text())}


def _ms(t):
    return "failed" if t is None else f"{t * 1e3:.1f}"


def _head_to_head(tmp_path, rows, jobs=3):
    """Each row's candidate run `jobs` times, alternating, as the tuner runs a trial; the fastest
    job of each (s/step). Run in the same minutes, they share the machine's slow spells."""
    at = types.SimpleNamespace(start_profile_step=3, end_profile_step=33, arg_mappings=None, overwrite=True)
    best = {}
    for j in range(jobs):
        for r in rows:
            c = Candidate(r["stage"], r["micro_batch"], r["offload"])
            res = run_trial(c, raw=_raw(), exps_dir=str(tmp_path / f"head_to_head{j}"), world=2, gas=1,
                            script=SCRIPT, user_args=["--config", "ds.json", "--checkpoint-dir", ""], at=at,
                            timeout_s=300)
            assert res.status == "ok", (c.name, res.reason)
            best[c.name] = min(best.get(c.name, res.step_time_s), res.step_time_s)
    return best


@pytest.mark.slow
def test_example_gpt_every_candidate_predicted_out_of_sample_and_the_model_based_choice(tmp_path, capsys):
    grid = _tune(tmp_path, "grid", tuner_early_stopping=100)
    # Every candidate ran; a repeat job may fail (the tuner keeps the other), not a whole candidate.
    # Two rounds, and at most seven candidates confirmed (§Confirm: a fifth of 35), twice at most.
    assert len(grid) == 35 and all(r["status"] == "ok" and 2 <= len(r["job_step_times_s"]) <= 4 for r in grid.values())
    assert sum(len(r["job_step_times_s"]) - 2 for r in grid.values()) <= 7
    errors = {n: r["prediction_error"] for n, r in grid.items()}  # each from the model fitted to the other 34
    with capsys.disabled():
        print("\n" + "\n".join(f"{n}: measured {r['step_time_s'] * 1e3:.1f} ms (jobs "
                               f"{', '.join(_ms(t) for t in r['job_step_times_s'])}), predicted "
                               f"{r['predicted_step_s'] * 1e3:.1f} ms ({100 * errors[n]:+.1f}%)"
                               for n, r in sorted(grid.items())))
    # Every candidate within 20 % (specs/autotune.md §Measured; with fewer trials per stage to fit
    # from, the smallest steps, where jobs differ most, reach 20-27 %).
    assert all(abs(e) < 0.20 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) < 0.10, errors
    # The model_based tuner (early stopping 5), in its own run, picks a config within 10 % of the
    # grid's fastest. The grid's own number for its fastest is the best of 35 noisy measurements,
    # biased up by the choosing (the top three candidates are within the jobs' spread: with one
    # round, model_based once chose z0_mbs16, which the grid's jobs then measured 11 % below
    # z1_mbs16, and the run before had it the grid's fastest). So the two picks are compared
    # head to head: three jobs each, alternating, the fastest of each.
    mb = _tune(tmp_path, "model", tuner_type="model_based", tuner_early_stopping=5)
    assert sum(r["status"] == "ok" for r in mb.values()) < len(grid)  # it did not run everything
    chosen = max((r for r in mb.values() if r["status"] == "ok"), key=lambda r: r["samples_per_s"])
    fastest = max(grid.values(), key=lambda r: r["samples_per_s"])
    if chosen["name"] == fastest["name"]:
        return
    t = _head_to_head(tmp_path, [chosen, fastest])
    with capsys.disabled():
        print(f"head to head: model_based's {chosen['name']} {_ms(t[chosen['name']])} ms, "
              f"the grid's {fastest['name']} {_ms(t[fastest['name']])} ms per step")
    assert t[chosen["name"]] <= t[fastest["name"]] / 0.9, t
