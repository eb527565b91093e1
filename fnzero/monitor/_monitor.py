"""`Monitor`: logging for the pure step's metrics, outside the step (`specs/monitor.md`; its use:
the package's docstring). Everything with side effects (printing, files, clocks, progress bars,
FLOP counting) happens here, after the step, on rank 0.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, Callable

from ._flops import FlopsProfile, count_flops, format_flops
from ._probe import TrialProbe
from ._writers import CsvWriter, TensorboardWriter, check_tensorboard

__all__ = ["Monitor", "TIMING_KEYS"]

# The keys of the `timings` dict (seconds spent in one optimizer step, summed over its
# micro-batches). Other keys are accepted and printed after these.
TIMING_KEYS = ("forward", "backward", "comm", "optimizer")


def _num(v: Any) -> float | None:
    """A metric as a float (tensors and numpy scalars too); None stays None."""
    return None if v is None else float(v)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _mesh_share(sh) -> str:
    """What of the model this rank holds on a mesh: its pipeline stage's layers and its
    tensor-parallel slice, and the parameters that leaves it (empty without either)."""
    where = []
    if getattr(sh, "pp", None) is not None and sh.pp.stages > 1:
        ranges = ", ".join(f"{lo}-{hi - 1}" for lo, hi in sh.pp.layers)
        where.append(f"pp stage {sh.pp.stage_index}/{sh.pp.stages}, layers {ranges}")
    if getattr(sh, "tp", None) is not None and sh.tp.size > 1:
        where.append(f"tp rank {sh.tp.rank}/{sh.tp.size}, {len(sh.tp.splits)} split tensors")
    if not where:
        return ""
    return f" of {sh.plan.num_params:,} parameters ({'; '.join(where)}), sharded over {sh.world_size} dp rank(s)"


class Monitor(contextlib.AbstractContextManager):
    """Prints progress, writes scalars and profiles FLOPs for a training loop. Build it with
    `Monitor.from_config`; call `log` after every step; `close` at the end (or use `with`).

    Only rank 0 prints or writes; every rank may call every method (and must call
    `profile_flops` together, since the profiled forward may run collectives).
    """

    def __init__(self, cfg, *, rank: int = 0, world_size: int = 1, tokens_per_step: int | None = None,
                 samples_per_step: int | None = None, stream=None, total_steps: int | None = None,
                 progress: bool | None = None, clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = cfg.train_batch_size if samples_per_step is None else samples_per_step
        self.stream = sys.stdout if stream is None else stream
        self.total_steps = total_steps
        self.steps_per_print = cfg.steps_per_print
        self._clock = clock
        self._t_last = clock()  # the first step's time runs from construction
        self._samples = 0
        self._last_dt: float | None = None
        self._reset_window()
        self._pending: tuple | None = None  # the last unprinted (step, metrics, state)
        self._step_flops: int | None = None
        self._closed = False
        # An autotuner trial (`autotuning.metric_path` set): every rank times the profile steps.
        self._probe = TrialProbe.from_config(cfg, rank=rank, world_size=world_size, tokens_per_step=tokens_per_step,
                                             samples_per_step=self.samples_per_step)
        # Fail on every rank, before training starts, rather than on rank 0 alone mid-run.
        if cfg.tensorboard.enabled:
            check_tensorboard()
        self._writers: list = []
        self._bar = None
        if rank != 0:
            return
        if cfg.csv_monitor.enabled:
            self._writers.append(CsvWriter(cfg.csv_monitor.output_path, cfg.csv_monitor.job_name))
        if cfg.tensorboard.enabled:
            self._writers.append(TensorboardWriter(cfg.tensorboard.output_path, cfg.tensorboard.job_name))
        if progress is None:
            isatty = getattr(self.stream, "isatty", None)
            progress = bool(isatty and isatty())
        if progress:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: no bar, lines only
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_steps, file=self.stream, unit="step", dynamic_ncols=True, leave=True)

    @classmethod
    def from_config(cls, cfg, *, rank: int, world_size: int, tokens_per_step: int | None = None,
                    samples_per_step: int | None = None, stream=None, total_steps: int | None = None,
                    progress: bool | None = None, clock: Callable[[], float] = time.perf_counter) -> "Monitor":
        """A Monitor for `cfg` (a `Config`, or anything `fnzero.load_config` reads); the arguments are
        `specs/monitor.md` §Construction's. `clock`: seconds, for tests.

        >>> import io, fnzero
        >>> cfg = fnzero.load_config({"train_batch_size": 4, "steps_per_print": 2})
        >>> ticks = iter(range(100))
        >>> out = io.StringIO()
        >>> mon = Monitor.from_config(cfg, rank=0, world_size=1, tokens_per_step=64, stream=out,
        ...                           clock=lambda: float(next(ticks)))
        >>> for i in (1, 2):
        ...     mon.log(i, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "loss_scale": None, "skipped": False})
        >>> print(out.getvalue().strip())
        step     2 | loss 2.0000 | lr 1.00e-03 | grad norm 0.500 | 64 tok/s | 4.0 samples/s
        """
        if not hasattr(cfg, "steps_per_print"):
            from ..config import load_config

            cfg = load_config(cfg, world_size=world_size)
        return cls(cfg, rank=rank, world_size=world_size, tokens_per_step=tokens_per_step,
                   samples_per_step=samples_per_step, stream=stream, total_steps=total_steps, progress=progress,
                   clock=clock)

    # -- the loop's calls -----------------------------------------------------------------------------------

    def log(self, step: int, metrics: dict, timings: dict | None = None, *, state=None) -> None:
        """Record optimizer step `step` (1 after the first step) and its metrics; call it once per
        step, right after it (`specs/monitor.md` §`log`). `timings` (else `metrics["timings"]`):
        seconds by TIMING_KEYS. `state`: the new TrainState, for `memory_breakdown`."""
        now = self._clock()
        dt, self._t_last = now - self._t_last, now
        self._last_dt = dt
        self._win_steps += 1
        self._win_time += dt
        self._samples += self.samples_per_step
        self._win_skipped += bool(metrics.get("skipped"))
        timings = timings if timings is not None else metrics.get("timings")
        if timings:
            for k, v in timings.items():
                self._win_timings[k] = self._win_timings.get(k, 0.0) + float(v)
        if self._probe is not None and self._probe.record(step, dt, timings, state, self._step_flops):
            # As DeepSpeed's engine after its profile steps: the trial has reported; end the run.
            self.close()
            raise SystemExit(0)
        if self.rank != 0:
            return
        self._write_scalars(metrics, timings)
        if self._bar is not None:
            self._bar.update(1)
        self._pending = (step, metrics, state)
        # steps_per_print null (DeepSpeed's default): no periodic line, only the last step's.
        if (self.steps_per_print and step % self.steps_per_print == 0) or step == self.total_steps:
            self._print_window()

    def should_profile(self, step: int) -> bool:
        """True when `flops_profiler` is enabled and `step` (1-based, the step about to run) is its profile_step."""
        fp = self.cfg.flops_profiler
        return bool(fp.enabled and step == fp.profile_step)

    def profile_flops(self, fn: Callable, *args, includes_backward: bool = False, calls_per_step: int | None = None,
                      **kwargs) -> FlopsProfile:
        """Count the FLOPs of `fn(*args, **kwargs)` with torch's FlopCounterMode and print the report.

        fn is one micro-batch's forward, run under no_grad; the step's FLOPs are estimated from it
        (`specs/monitor.md`), or, with includes_backward=True, fn does its own backward and counts as is.

        >>> import torch, fnzero
        >>> mon = Monitor.from_config(fnzero.load_config({"train_batch_size": 1}), rank=1, world_size=2)
        >>> lin = torch.nn.Linear(4, 3, bias=False)
        >>> mon.profile_flops(lin, torch.ones(2, 4)).total      # 2 * 2*4*3
        48
        """
        fp = self.cfg.flops_profiler
        total, by_module, top, output = count_flops(fn, args, kwargs, module_depth=fp.module_depth,
                                                    top_modules=fp.top_modules, includes_backward=includes_backward)
        calls = self.cfg.gradient_accumulation_steps if calls_per_step is None else calls_per_step
        factor = 1.0 if includes_backward else 3.0 + fp.recompute_fwd_factor
        step_flops = int(round(total * factor * calls))
        self._step_flops = step_flops
        prof = FlopsProfile(total=total, by_module=by_module, top=top, step_flops=step_flops, output=output)
        if self.rank == 0:
            self._print_flops(prof, factor, calls, includes_backward)
        return prof

    def close(self) -> None:
        """Print the last unprinted step, flush and close the files and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0 and self._pending is not None and self._win_steps:
            self._print_window()
        for w in self._writers:
            w.close()
        if self._bar is not None:
            self._bar.close()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._win_steps, self._win_time, self._win_skipped = 0, 0.0, 0
        self._win_timings: dict[str, float] = {}

    def _emit(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)  # keeps the bar below the line
        else:
            print(line, file=self.stream, flush=True)

    def _write_scalars(self, metrics: dict, timings: dict | None) -> None:
        if not self._writers:
            return
        # DeepSpeed's names and x axis: samples seen (all ranks).
        x = self._samples
        events = [("Train/Samples/train_loss", _num(metrics.get("loss")), x)]
        for key, name in (("lr", "lr"), ("grad_norm", "grad_norm"), ("loss_scale", "loss_scale")):
            v = _num(metrics.get(key))
            if v is not None:
                events.append((f"Train/Samples/{name}", v, x))
        if timings and self.cfg.wall_clock_breakdown:
            events += [(f"Train/Samples/elapsed_time_ms_{k}", float(v) * 1000.0, x) for k, v in timings.items()]
        for w in self._writers:
            w.write(events)
            w.flush()

    def _print_window(self) -> None:
        step, metrics, state = self._pending
        n, secs = self._win_steps, self._win_time
        per_step = secs / n if n else float("nan")
        loss, lr, gn, scale = (_num(metrics.get(k)) for k in ("loss", "lr", "grad_norm", "loss_scale"))
        parts = [f"step {step:5d}", f"loss {loss:.4f}" if loss is not None else "loss -",
                 f"lr {lr:.2e}" if lr is not None else "lr -", f"grad norm {gn:.3f}" if gn is not None else "grad norm -"]
        if scale is not None:
            parts.append(f"scale {scale:.0f}")
        if per_step > 0 and math.isfinite(per_step):
            if self.tokens_per_step:
                parts.append(f"{self.tokens_per_step / per_step:,.0f} tok/s")
            parts.append(f"{self.samples_per_step / per_step:.1f} samples/s")
            if self._step_flops:
                parts.append(f"{format_flops(self._step_flops / per_step, per_second=True)} per rank")
        if self._win_skipped:
            parts.append(f"skipped {self._win_skipped}")
        self._emit(" | ".join(parts))
        if self.cfg.wall_clock_breakdown and self._win_timings:
            order = [k for k in TIMING_KEYS if k in self._win_timings] + sorted(set(self._win_timings) - set(TIMING_KEYS))
            self._emit("time/step: " + " | ".join(f"{k} {self._win_timings[k] / n * 1000:.2f} ms" for k in order))
        if self.cfg.memory_breakdown:
            self._emit(self._memory_line(state))
        if self._bar is not None and loss is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self._pending = None
        self._reset_window()

    def _memory_line(self, state) -> str:
        import torch

        from ..memory import model_state_bytes, peak_rss_bytes

        parts = []
        if state is not None:
            m = model_state_bytes(state)
            parts.append(f"model state {_mib(m.total)} (params {_mib(m.params)}, master {_mib(m.master)}, "
                         f"optimizer {_mib(m.optimizer)}, grads {_mib(m.grads)}){_mesh_share(state.sharding)}")
            if m.stored:  # `offload_param: nvme`: shards in files, not in memory
                parts.append(f"parameter shards on NVMe {_mib(m.stored)}")
        parts.append(f"peak RSS {_mib(peak_rss_bytes())}")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            parts.append(f"cuda peak allocated {_mib(torch.cuda.max_memory_allocated())}")
        return "memory: " + " | ".join(parts)

    def _print_flops(self, prof: FlopsProfile, factor: float, calls: int, includes_backward: bool) -> None:
        fp = self.cfg.flops_profiler
        how = "counted with backward" if includes_backward else f"{factor:g} x forward"
        lines = [f"flops profiler (rank 0 of {self.world_size}):",
                 f"  profiled call: {format_flops(prof.total)}; training step ~ {format_flops(prof.step_flops)} per rank "
                 f"({how} x {calls} micro-batch(es))"]
        if self._last_dt:
            lines.append(f"  achieved ~ {format_flops(prof.step_flops / self._last_dt, per_second=True)} per rank "
                         f"at the last step's {self._last_dt * 1000:.1f} ms; progress lines show it from now on")
        else:
            lines.append("  achieved FLOP/s: shown on the progress lines from the next print")
        if fp.detailed and prof.top:
            for depth, mods in prof.top.items():
                for name, flops in mods:
                    share = 100.0 * flops / prof.total if prof.total else 0.0
                    lines.append(f"  depth {depth}: {name} {format_flops(flops)} ({share:.1f}%)")
        text = "\n".join(lines)
        if fp.output_file:
            with open(fp.output_file, "a") as f:
                f.write(text + "\n")
        else:
            self._emit(text)
