"""Small all-reduces and all-gathers among one host's gloo ranks through shared memory
(`specs/collectives.md` §Shared memory): the rank-order sum, the same bits on every rank (and
gloo's at two ranks), larger tensors through gloo, the path off by FNZERO_GLOO_SHM=0, and a peer
that is gone or late named instead of a hang."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

import fnzero
from fnzero.sharding.comm._shm import SharedSegment, shared_memory_enabled
from fnzero.testing import run_world

pytestmark = pytest.mark.skipif(not shared_memory_enabled(), reason="the shared-memory path is x86-64 with /dev/shm")

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64]


def _values(rank: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Round i's tensor of `rank`: a size every rank shares, values of its own."""
    n = int(torch.randint(1, 5000, (1,), generator=torch.Generator().manual_seed(i)))
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** float(torch.randint(-3, 4, (1,), generator=g))
    return x.to(dtype) if dtype.is_floating_point else (x * 1000).to(dtype)


def _exchange(calls: int) -> dict:
    """On a gloo rank: `calls` rounds of every dtype through ProcessGroupCollectives, each result
    against the rank-order sum (and gloo's own), and a 2 MiB tensor that goes through gloo."""
    import torch.distributed as dist

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    world, exact, gloo_equal, gathers = comm.world_size, True, True, True
    for i in range(calls):
        for dtype in DTYPES:
            mine = _values(comm.rank, i, dtype)
            parts = [_values(r, i, dtype) for r in range(world)]
            want = parts[0].clone()
            for p in parts[1:]:
                want = want + p
            got = comm.all_reduce(mine)
            exact &= torch.equal(got, want)
            gloo_equal &= torch.equal(got, comm._gloo_all_reduce(mine))
            gathers &= torch.equal(comm.all_gather(mine), torch.cat(parts))
    shm_calls = comm._shm.calls if comm._shm else 0
    big = comm.all_reduce(torch.full((1 << 19,), float(comm.rank + 1)))  # 2 MiB: gloo's
    os.environ["FNZERO_GLOO_SHM"] = "0"  # read when a group's first small collective opens its segment
    off = ProcessGroupCollectives()
    off_sum = off.all_reduce(torch.ones(4))
    dist.barrier()
    return {"exact": exact, "gloo_equal": gloo_equal, "gathers": gathers, "shm_calls": shm_calls,
            "after_big": comm._shm.calls if comm._shm else 0, "big": float(big[0]), "world": world,
            "off": off._shm, "off_sum": float(off_sum[0])}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_small_collectives_go_through_shared_memory_with_the_rank_order_sum(world):
    """Four dtypes × 6 rounds of random sizes: every rank gets exactly the rank-order sum; at two
    ranks that is gloo's own result bit for bit (addition commutes); at four, gloo's ring adds in
    another order. The calls went through the segment; 2 MiB went through gloo. 4 ranks on 2 cores
    exercise the yielding wait. With FNZERO_GLOO_SHM=0 a group keeps gloo."""
    results = run_world(_exchange, world, 6, timeout=240)
    for r, res in enumerate(results):
        assert res["exact"] and res["gathers"], r
        if world == 2:
            assert res["gloo_equal"], r
        assert res["shm_calls"] == 6 * len(DTYPES) * 2  # every all_reduce and all_gather above
        assert res["after_big"] == res["shm_calls"] and res["big"] == sum(range(1, world + 1))
        assert res["off"] is False and res["off_sum"] == world


def _segment(tmp_path, world: int) -> torch.Tensor:
    return torch.from_file(str(tmp_path / "segment"), shared=True, dtype=torch.uint8,
                           size=SharedSegment.segment_bytes(world, 4096))  # fmt: skip


def test_a_peer_that_exited_is_named_within_a_second_or_two(tmp_path):
    """Rank 0 of a two-rank segment whose rank 1 is a process that has ended: its all-reduce raises
    a DistributedError naming rank 1 (the fault), not a hang."""
    shm = SharedSegment(_segment(tmp_path, 2), 0, 2, capacity=4096)
    gone = subprocess.Popen(["true"])
    gone.wait()
    shm.pids[1] = gone.pid
    t = time.monotonic()
    with pytest.raises(fnzero.DistributedError, match=rf"rank 1 \(pid {gone.pid}\) exited") as e:
        shm.start(torch.ones(3)).wait()
    assert e.value.ranks == (1,) and time.monotonic() - t < 5


def test_a_late_peer_is_named_at_the_timeout_and_a_punctual_one_is_summed(tmp_path):
    """Rank 1 alive but absent: named after `timeout_s`. Then rank 1 publishes (a second mapping of
    the same segment, as another process would): rank 0's next call sums both."""
    seg = _segment(tmp_path, 2)
    rank0 = SharedSegment(seg, 0, 2, capacity=4096, timeout_s=0.3)
    rank0.pids[1] = os.getpid()
    with pytest.raises(fnzero.DistributedError, match=r"rank\(s\) \[1\] did not arrive within") as e:
        rank0.start(torch.ones(3)).wait()
    assert e.value.ranks == (1,)
    rank1 = SharedSegment(_segment(tmp_path, 2), 1, 2, capacity=4096)
    rank1.start(torch.full((3,), 5.0))  # call 1 (late)
    pending1 = rank1.start(torch.full((3,), 2.0))  # call 2, parity 0
    assert torch.equal(rank0.start(torch.ones(3)).wait(), torch.full((3,), 3.0))
    assert torch.equal(pending1.wait(), torch.full((3,), 3.0))
