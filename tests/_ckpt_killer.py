"""Run by test_checkpoint_atomic in a subprocess (argv: directory, kills, seed): fork savers and
kill -9 them at random moments; after each kill, `latest` must load and be self-consistent.
Prints one JSON line. Forking from this small, single-threaded process keeps each round cheap."""

import json
import os
import random
import signal
import sys
import time

import torch

torch.set_num_threads(1)
import fnzero  # noqa: E402
import fnzero.testing  # noqa: E402
from fnzero.checkpoint import load, save  # noqa: E402


def state_with(base, i):
    fill = lambda d: {k: torch.full_like(v, float(i)) for k, v in d.items()}  # noqa: E731
    opt = base.opt_state._replace(exp_avg=fill(base.opt_state.exp_avg), exp_avg_sq=fill(base.opt_state.exp_avg_sq))
    return base.replace(params=fill(base.params), opt_state=opt, step=torch.tensor(i))


def main(d, kills, seed):
    rng = random.Random(seed)
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}})
    base = fnzero.shard(fnzero.testing.MLP([512, 1024, 512]), stage=1, config=cfg).init_state()  # ~1M params
    save(d, state_with(base, 0), tag="t0", client_state={"i": 0})
    t0 = time.monotonic()
    save(d, state_with(base, 0), tag="t0", client_state={"i": 0})  # the same tag again: the replace path
    per_save = time.monotonic() - t0
    last, seen = 0, set()
    # Kills land in [0, window) after the fork. A loaded machine (CI's 2 cores under two test
    # workers) can make a forked saver's first save far slower than `per_save`, so every kill would
    # land before its first commit: widen the window after each round without an advance.
    window = 3 * per_save
    for k in range(kills):
        pid = os.fork()
        if pid == 0:  # the saver: keeps saving newer states into 3 rotating tags until killed
            try:
                i = last + 1
                while True:
                    save(d, state_with(base, i), tag=f"t{i % 3}", client_state={"i": i})
                    i += 1
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, window))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        state, cs = load(d, like=base)
        i = cs["i"]
        assert i >= last, f"latest went back from {last} to {i}"
        assert int(state.step) == i and all(bool((t == i).all()) for t in state.params.values()), i
        assert all(bool((t == i).all()) for t in state.opt_state.exp_avg_sq.values()), i
        seen.add(i - last)
        window = window if i > last else window * 1.5
        last = i
    print(json.dumps({"kills": kills, "last": last, "per_save_s": per_save, "advances": sorted(seen)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
