"""The comms logger's timed summary (specs/collectives.md §Comms logger timings)."""

import io

import pytest
import torch

import fnzero
from fnzero.sharding.comm._comms_summary import bus_factor, comms_summary, format_comms_summary
from fnzero.testing import GPT, seeded
from fnzero.testing._threads import simulated_world


def _cfg(stage):
    return fnzero.load_config({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, "overlap_comm": True},
        "comms_logger": {"enabled": True},
    }, world_size=2)


def _model():
    with seeded(0):
        return GPT(vocab_size=50, seq_len=8, d_model=16, n_layer=2, n_head=2)


def test_timed_summary_matches_its_counts_and_bytes():
    """A ZeRO-3 step (async gathers and reduce-scatters, a blocking all-reduce) on 2 ranks with the
    comms logger on: every call is timed once its result is ready; per (op, size) the summary's
    count and bytes are the records', its bandwidths bytes / time and that times the bus factor."""
    def rank_fn(comm):
        sm = fnzero.shard(_model(), config=_cfg(3), comm=comm)
        state = sm.init_state()
        step = fnzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(sm.apply(p, b[0]).flatten(0, 1), b[1].flatten()), _cfg(3))
        x = torch.randint(0, 50, (2, 8))
        state, _ = step(state, (x, x))
        return list(sm.comm.records), sm.comm.summary(), sm.comm.log_summary(file=io.StringIO())

    records, rows, text = simulated_world(2).run(rank_fn)[0]
    assert {r.op for r in records} >= {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(r.seconds is not None and r.seconds > 0 for r in records)  # every async call was waited for
    assert sum(row.count for row in rows) == len(records)
    for row in rows:
        mine = [r for r in records if r.op == row.op and r.bytes == row.bytes]
        assert row.count == row.timed == len(mine)
        assert row.total_bytes == sum(r.bytes for r in mine)
        assert row.total_s == pytest.approx(sum(r.seconds for r in mine), rel=1e-12)
        assert row.avg_s == pytest.approx(row.total_s / row.count, rel=1e-12)
        assert row.algbw == pytest.approx(row.total_bytes / row.total_s, rel=1e-12)
        assert row.busbw == pytest.approx(row.algbw * bus_factor(row.op, 2), rel=1e-12)
    # DeepSpeed's layout: the header, each op's name alone on a line, then one line per size.
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["Comm.", "Op", "Message"] and "busbw_avg (Gbps)" in lines[0]
    for op in {r.op for r in records}:
        assert op in lines
    assert len(lines) == 1 + len({r.op for r in records}) + len(rows)


class _Rec:
    def __init__(self, op, nbytes, seconds):
        self.op, self.bytes, self.seconds = op, nbytes, seconds


def test_bus_factors_and_untimed_calls():
    """DeepSpeed's bus factors; a call still in flight is counted but not timed."""
    n = 4
    assert bus_factor("all_reduce", n) == 1.5 and bus_factor("all_gather", n) == 0.75
    assert bus_factor("reduce_scatter", n) == 0.75 and bus_factor("broadcast", n) == 1.0
    assert bus_factor("all_to_all", n) == 1.0 and bus_factor("all_reduce", 1) == 0.0
    rows = comms_summary([_Rec("all_reduce", 1000, 0.5), _Rec("all_reduce", 1000, None),
                          _Rec("all_reduce", 10, 0.25), _Rec("broadcast", 8, 2.0)], n)
    assert [(r.op, r.bytes, r.count, r.timed) for r in rows] == [
        ("all_reduce", 10, 1, 1), ("all_reduce", 1000, 2, 1), ("broadcast", 8, 1, 1)]
    assert rows[1].algbw == 2000.0 and rows[1].busbw == 3000.0 and rows[1].total_bytes == 2000
    assert "2 (1 timed)" in format_comms_summary(rows)
    with pytest.raises(ValueError, match="barrier"):
        bus_factor("barrier", 2)


def test_bus_bandwidth_and_layout_equal_deepspeeds(monkeypatch, capsys):
    """Against DeepSpeed 0.19.8's own comms logger (skipped where it is not importable): the
    summary's header line, and busbw for each op at n = 4 from DeepSpeed's `calc_bw_log` (its
    message size is the per-rank input for all-gather and reduce-scatter, fnzero's the whole buffer)."""
    comms_logging = pytest.importorskip("deepspeed.utils.comms_logging", reason="DeepSpeed is not importable here")
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda *a, **k: 4)
    ms = 2.0  # DeepSpeed's latencies are in ms; its bandwidths come out in Gbps
    for op, ds_size, ours in (("all_reduce", 4096, 4096), ("all_gather", 1024, 4096),
                              ("reduce_scatter", 1024, 4096), ("broadcast", 4096, 4096)):
        _, ds_busbw = comms_logging.calc_bw_log(op, ds_size, ms)
        row, = comms_summary([_Rec(op, ours, ms / 1e3)], 4)
        assert row.busbw * 8e-9 == pytest.approx(ds_busbw, rel=1e-12), op
    comms_logging.CommsLogger().log_all(print_log=True)
    assert format_comms_summary([]) == capsys.readouterr().out.splitlines()[-1]  # after an accelerator warning
