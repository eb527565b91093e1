"""fnzero.monitor: progress lines, CSV/TensorBoard scalars, memory and FLOP reports for a training
loop, driven by the config's `steps_per_print`, `csv_monitor`, `tensorboard`, `memory_breakdown`,
`flops_profiler` and `wall_clock_breakdown` sections (`specs/monitor.md`).

The step stays pure: it returns metrics; the Monitor consumes them after the step.

    from fnzero.monitor import Monitor

    with Monitor.from_config(cfg, rank=dist.rank, world_size=dist.world_size, tokens_per_step=T) as mon:
        for i in range(1, steps + 1):
            if mon.should_profile(i):                    # every rank: the forward may gather shards
                mon.profile_flops(loss_fn, state.params, batch)
            state, metrics = step(state, batch)
            mon.log(i, metrics, state=state)
"""

from ._flops import FlopsProfile, format_flops
from ._monitor import TIMING_KEYS, Monitor
from ._writers import CsvWriter, TensorboardWriter

__all__ = ["Monitor", "FlopsProfile", "TIMING_KEYS", "CsvWriter", "TensorboardWriter", "format_flops"]
