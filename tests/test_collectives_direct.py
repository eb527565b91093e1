"""On gloo, all-gather and reduce-scatter run as direct point-to-point exchanges
(specs/collectives.md §Interface.gloo). They must equal gloo's own collectives: exactly for the
gather, and for the sum up to the order of addition (exactly at N = 2, where both add the same
two numbers). A donated reduce-scatter, which receives into its input, gives the same bits as
one that does not."""

from __future__ import annotations

import pytest
import torch

from fnzero.testing import run_world

pytestmark = pytest.mark.multiprocess


def _compare_with_gloo():
    import torch.distributed as dist

    from fnzero._shard._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives()
    assert comm._direct
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(100 + r)
    worst = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for per_rank in (0, 1, 7, 1000, (5 << 20) // 4 + 3):  # the last spans several 4 MiB messages
            full = torch.randn(per_rank * n, generator=g).to(dtype)
            shard = torch.randn(per_rank, generator=g).to(dtype)
            want_ag = torch.empty(per_rank * n, dtype=dtype)
            dist.all_gather_into_tensor(want_ag, shard)
            want_rs = torch.empty(per_rank, dtype=dtype)
            dist.reduce_scatter_tensor(want_rs, full.clone())
            full_before = full.clone()
            # Two collectives in flight at once, waited in the opposite order.
            p_ag, p_rs = comm.all_gather_async(shard), comm.reduce_scatter_async(full)
            got_rs, got_ag = p_rs.wait(), p_ag.wait()
            assert torch.equal(got_ag, want_ag), (dtype, per_rank)
            assert torch.equal(full, full_before), "reduce_scatter must leave its input alone"
            diff = (got_rs.double() - want_rs.double()).abs().max().item() if per_rank else 0.0
            worst[f"{dtype}|{per_rank}"] = diff
            # A donated input (stage 3's backward): received into, same bits, result not a view of it.
            got_d = comm.reduce_scatter(full.clone(), donate=True)
            assert torch.equal(got_d, got_rs), (dtype, per_rank)
            assert got_d.untyped_storage().nbytes() == per_rank * got_d.element_size()
            # Gathering into a given buffer (the donated step's path).
            out = torch.full((per_rank * n,), -1.0, dtype=dtype)
            assert comm.all_gather_async(shard, out=out).wait() is out and torch.equal(out, want_ag)
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
def test_direct_exchanges_equal_gloo_collectives(world):
    for rank_worst in run_world(_compare_with_gloo, world, timeout=300):
        for case, diff in rank_worst.items():
            if world == 2:
                assert diff == 0.0, case  # a + b == b + a
            else:
                tol = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.bfloat16": 0.13}[case.split("|")[0]]
                assert diff <= tol, (case, diff)


def _direct_flag():
    from fnzero._shard._collectives import ProcessGroupCollectives

    return ProcessGroupCollectives()._direct


def test_switch_turns_direct_exchanges_off():
    assert run_world(_direct_flag, 2, timeout=120) == [True, True]
    assert run_world(_direct_flag, 2, timeout=120, env={"FNZERO_GLOO_DIRECT": "0"}) == [False, False]


def _peer_fails(rank, port, how, q):
    import datetime
    import os
    import time

    import torch.distributed as dist

    from fnzero._shard._collectives import ProcessGroupCollectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    comm = ProcessGroupCollectives()
    x = torch.ones(1 << 20)
    comm.reduce_scatter(x)
    if rank == 1:
        if how == "stuck":
            time.sleep(30)
        os._exit(3)
    t = time.monotonic()
    try:
        comm.reduce_scatter(x)
        q.put(("no error", time.monotonic() - t))
    except RuntimeError as e:
        q.put((str(e), time.monotonic() - t))


@pytest.mark.parametrize("how,within", [("dies", 3.0), ("stuck", 10.0)])
def test_a_failed_peer_raises_instead_of_hanging(how, within):
    # A peer that dies closes its sockets: the exchange fails at once. A peer that is alive but
    # never joins: the process group's timeout (2 s here) ends the wait. Never a hang.
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_peer_fails, args=(r, port, how, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg, seconds = q.get(timeout=60)
    finally:
        for p in procs:
            p.join(1)  # the stuck peer sleeps on: no reason to wait for it
            if p.is_alive():
                p.kill()
                p.join()
    assert msg != "no error" and seconds < within, (msg, seconds)


class _Shift(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))

    def forward(self, x):
        return x + self.w  # autograd hands the same gradient tensor to x and to w


class _ShiftNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.shift = _Shift((3, 4))  # one parameter, 12 elements: no padding at N = 3
        self.out = torch.nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, x):
        return self.out(torch.tanh(self.shift(self.lin(x))))


def _shift_grads(sharded: bool):
    import fnzero

    torch.manual_seed(0)
    model = _ShiftNet()
    x = torch.randn(3, 4, dtype=torch.float64)
    if not sharded:
        model(x).square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}
    cfg = fnzero.load_config({"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
                              "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    sm = fnzero.shard(model, config=cfg)
    s0 = sm.init_state()
    before = sm.gather(s0.params)
    # Every rank sees the same batch and the step divides by N, so one SGD step at lr 1 moves the
    # parameters by exactly the single-process gradient.
    s1, _ = fnzero.train_step(lambda p, b: sm.apply(p, b).square().sum(), cfg)(s0, x)
    after = sm.gather(s1.params)
    return {n: before[n] - after[n] for n in before}


def test_a_gradient_shared_with_another_input_is_not_received_into():
    # Stage 3 receives its reduce-scatter into the unit's gradient only when nothing else holds
    # that storage; here the shift's gradient is also x's, which lin's backward still needs.
    want = _shift_grads(False)
    for got in run_world(_shift_grads, 3, True, timeout=120):
        for n in want:
            assert torch.allclose(got[n], want[n], rtol=1e-12, atol=1e-12), n
