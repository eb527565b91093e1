"""On gloo, all-gather and reduce-scatter run as direct point-to-point exchanges
(specs/collectives.md §Interface.gloo). They must equal gloo's own collectives: exactly for the
gather, and for the sum up to the order of addition (exactly at N = 2, where both add the same
two numbers). A donated reduce-scatter, which receives into its input, gives the same bits as
one that does not.

Starting ranks costs seconds each (every one imports torch), so one world of 4 runs every check
but the failed-peer ones (which need a rank that dies or hangs), and the tests read its cached
results. The world's own group is N = 4; N = 2 and N = 3 run on subgroups of it. Each size proves
something the others do not: N = 2 is the exact case; N = 3 is an odd world, where no peer is both
the one sent to and the one received from in the same exchange step, and the donated
reduce-scatter defers one receive into a region of its input; N = 4 is an even world past 2
(step N/2 sends to and receives from the same peer) and the smallest where the donated
reduce-scatter chains several deferred receives, each waiting on the send that frees its region.
The subgroups' ranks are not their global ranks ([2, 3] and [1, 2, 3]), so the exchanges' mapping
of group ranks to global peers is exercised too.
"""

from __future__ import annotations

import pytest
import torch

from fnzero.testing import run_world

pytestmark = pytest.mark.multiprocess

SIZES = (2, 3, 4)
_SUBGROUP_RANKS = {2: [2, 3], 3: [1, 2, 3]}  # N = 4 is the world's default group
_TOL = {"torch.float64": 1e-12, "torch.float32": 1e-5, "torch.bfloat16": 0.13}  # sums at N >= 3


def _compare_with_gloo(group):
    """Direct exchanges against gloo's collectives on `group`; returns what the tests assert."""
    import torch.distributed as dist

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    comm = ProcessGroupCollectives(group)
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(100 + r)
    cases = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for per_rank in (0, 1, 7, 1000, (5 << 20) // 4 + 3):  # the last spans several 4 MiB messages
            full = torch.randn(per_rank * n, generator=g).to(dtype)
            shard = torch.randn(per_rank, generator=g).to(dtype)
            want_ag = torch.empty(per_rank * n, dtype=dtype)
            dist.all_gather_into_tensor(want_ag, shard, group=group)
            want_rs = torch.empty(per_rank, dtype=dtype)
            dist.reduce_scatter_tensor(want_rs, full.clone(), group=group)
            full_before = full.clone()
            # Two collectives in flight at once, waited in the opposite order.
            p_ag, p_rs = comm.all_gather_async(shard), comm.reduce_scatter_async(full)
            got_rs, got_ag = p_rs.wait(), p_ag.wait()
            # A donated input (stage 3's backward): received into, same bits, result not a view of it.
            got_d = comm.reduce_scatter(full.clone(), donate=True)
            # Gathering into a given buffer (the donated step's path).
            out = torch.full((per_rank * n,), -1.0, dtype=dtype)
            out_is_result = comm.all_gather_async(shard, out=out).wait() is out
            cases[f"{dtype}|{per_rank}"] = {
                "gather_equal": torch.equal(got_ag, want_ag),
                "gather_into_out_equal": out_is_result and torch.equal(out, want_ag),
                "input_left_alone": torch.equal(full, full_before),
                "sum_diff": (got_rs.double() - want_rs.double()).abs().max().item() if per_rank else 0.0,
                "donated_equal": torch.equal(got_d, got_rs),
                "donated_own_storage": got_d.untyped_storage().nbytes() == per_rank * got_d.element_size(),
            }
    return {"direct": comm._direct, "cases": cases}


def _switched_off():
    """FNZERO_GLOO_DIRECT=0, read when the collectives are made: gloo's own collectives, which
    then give gloo's results."""
    import os

    import torch.distributed as dist

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    old = os.environ.get("FNZERO_GLOO_DIRECT")
    os.environ["FNZERO_GLOO_DIRECT"] = "0"
    try:
        comm = ProcessGroupCollectives()
    finally:
        if old is None:
            del os.environ["FNZERO_GLOO_DIRECT"]
        else:
            os.environ["FNZERO_GLOO_DIRECT"] = old
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(200 + r)
    full, shard = torch.randn(7 * n, generator=g), torch.randn(7, generator=g)
    want_ag, want_rs = torch.empty(7 * n), torch.empty(7)
    dist.all_gather_into_tensor(want_ag, shard)
    dist.reduce_scatter_tensor(want_rs, full.clone())
    return {"direct": comm._direct,
            "equal": torch.equal(comm.all_gather(shard), want_ag) and torch.equal(comm.reduce_scatter(full), want_rs)}


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
        self.shift = _Shift((3, 4))  # one parameter, 12 elements: no padding at N = 3 or 4
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


def _world_of_four():
    import torch.distributed as dist

    me = dist.get_rank()
    # Every rank takes part in making each subgroup, in the same order.
    groups = {4: None, **{n: dist.new_group(ranks) for n, ranks in _SUBGROUP_RANKS.items()}}
    out = {"compare": {n: _compare_with_gloo(gr) for n, gr in groups.items() if gr is None or me in _SUBGROUP_RANKS[n]}}
    out["shift_grads"] = _shift_grads(True)  # the donated reduce-scatter at N = 4 (N >= 3 donates)
    out["switched_off"] = _switched_off()
    return out


@pytest.fixture(scope="module")
def world():
    """Each rank's results (a failed world fails every test here, with its traceback, once)."""
    return run_world(_world_of_four, 4, timeout=300)


def _cases(world, n):
    """(global rank, case, results) for every rank of the N-rank group."""
    ranks = _SUBGROUP_RANKS.get(n, range(4))
    out = [(r, case, res) for r in ranks for case, res in world[r]["compare"][n]["cases"].items()]
    assert len(out) == n * 3 * 5, len(out)  # every rank: 3 dtypes x 5 sizes
    return out


@pytest.mark.parametrize("n", SIZES)
def test_direct_all_gather_equals_gloo(world, n):
    for r, case, res in _cases(world, n):
        assert res["gather_equal"], f"N={n} rank {r} {case}: all-gather differs from gloo's"
        assert res["gather_into_out_equal"], f"N={n} rank {r} {case}: all-gather into a given buffer"


@pytest.mark.parametrize("n", SIZES)
def test_direct_reduce_scatter_equals_gloo(world, n):
    for r, case, res in _cases(world, n):
        assert res["input_left_alone"], f"N={n} rank {r} {case}: reduce_scatter must leave its input alone"
        if n == 2:
            assert res["sum_diff"] == 0.0, f"N=2 rank {r} {case}: {res['sum_diff']!r}"  # a + b == b + a
        else:
            tol = _TOL[case.split("|")[0]]
            assert res["sum_diff"] <= tol, f"N={n} rank {r} {case}: {res['sum_diff']!r} > {tol}"


@pytest.mark.parametrize("n", SIZES)
def test_donated_reduce_scatter_gives_the_same_bits(world, n):
    for r, case, res in _cases(world, n):
        assert res["donated_equal"], f"N={n} rank {r} {case}: donated result differs"
        assert res["donated_own_storage"], f"N={n} rank {r} {case}: donated result keeps its input alive"


def test_direct_exchanges_are_on_by_default_and_the_switch_turns_them_off(world):
    for n in SIZES:
        assert [world[r]["compare"][n]["direct"] for r in _SUBGROUP_RANKS.get(n, range(4))] == [True] * n, n
    assert [w["switched_off"]["direct"] for w in world] == [False] * 4
    assert [w["switched_off"]["equal"] for w in world] == [True] * 4


def test_a_gradient_shared_with_another_input_is_not_received_into(world):
    # Stage 3 receives its reduce-scatter into the unit's gradient only when nothing else holds
    # that storage; here the shift's gradient is also x's, which lin's backward still needs.
    want = _shift_grads(False)
    for r, w in enumerate(world):
        got = w["shift_grads"]
        for n in want:
            assert torch.allclose(got[n], want[n], rtol=1e-12, atol=1e-12), (r, n)


# A failed peer: its own pair of processes, since a dead or stuck rank ruins the group it is in.
# The ranks meet with a generous timeout (two fresh processes may arrive seconds apart on a loaded
# machine), then exchange over a group with the case's own timeout: long where a peer dies, so
# only its closed sockets can end the wait in time; short where a peer is stuck, so the timeout
# must end it.
_GROUP_TIMEOUT = {"dies": 30.0, "stuck": 1.0}


def _peer_fails(rank, store, how, q):
    import datetime
    import os
    import time

    import torch.distributed as dist

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT[how]))
    dist.barrier()  # both here: the first exchange below does not wait on the other's start-up
    comm = ProcessGroupCollectives(group)
    x = torch.ones(1 << 20)
    comm.reduce_scatter(x)
    if rank == 1:
        if how == "stuck":
            time.sleep(60)
        os._exit(3)
    t = time.monotonic()
    try:
        comm.reduce_scatter(x)
        q.put(("no error", time.monotonic() - t))
    except RuntimeError as e:
        q.put((str(e), time.monotonic() - t))


@pytest.mark.parametrize("how,within", [("dies", 3.0), ("stuck", 10.0)])
def test_a_failed_peer_raises_instead_of_hanging(how, within, tmp_path):
    # A peer that dies closes its sockets: the exchange fails at once (well inside the group's
    # 30 s timeout). A peer that is alive but never joins: the group's 1 s timeout ends the wait.
    # Never a hang.
    import multiprocessing as mp
    import queue

    # The pair meets through a fresh file store, not a port found free and released (which another
    # process may take before rank 0 binds it again).
    store = str(tmp_path / "store")
    # A fork server that has imported torch and fnzero once starts each pair in a fraction of a
    # second, where a spawned process spends seconds importing them (the rank's own module, this
    # one, is imported in the child: the server does not see the tests' sys.path).
    ctx = mp.get_context("forkserver")
    # (The same server as fnzero.testing's worlds: whichever starts it first sets what it preloads.)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pytest", "fnzero", "fnzero.testing", "fnzero.sharding.comm._collectives"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_peer_fails, args=(r, store, how, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg, seconds = q.get(timeout=90)
    except queue.Empty:
        pytest.fail(f"{how}: rank 0 gave no answer within 90 s (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:  # the answer is in: the stuck peer would sleep on, rank 0 has nothing left to do
            p.kill()
            p.join()
    assert msg != "no error" and seconds < within, (msg, seconds)
