"""`Collectives.all_to_all` (specs/collectives.md §All-to-all): torch's `all_to_all_single` on every
implementation, its bytes, and one clear error for each bad call, never a hang.

All-to-all moves data without arithmetic, so every result is compared exactly against a plain-torch
reference of the same exchange. The simulated world carries most cases (hypothesis draws the split
sizes); one spawned gloo world checks the process-group, functional and checked forms together."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fnzero
from fnzero.sharding.comm._collectives import CollectivesBase, LocalCollectives
from fnzero.sharding.comm._observed import CheckedCollectives, RecordingCollectives
from fnzero.testing import count_collectives, run_world, simulated_world


def _input(rank: int, rows: int, row_shape=(3,), dtype=torch.float64) -> torch.Tensor:
    """Rank r's input: values that say which rank and row they came from."""
    base = torch.arange(rows * max(1, torch.Size(row_shape).numel()), dtype=torch.float64).view(rows, *row_shape)
    return (base + 1000 * rank).to(dtype)


def _expected(inputs: list[torch.Tensor], splits: list[list[int]], rank: int) -> torch.Tensor:
    """What `rank` receives: chunk `rank` of every rank's input, in rank order."""
    return torch.cat([t.split(s)[rank] for t, s in zip(inputs, splits)])


def _unequal(n: int) -> list[list[int]]:
    """A split table (row r: what rank r sends to each rank) with empty chunks and a self-chunk."""
    return [[(r + 2 * d) % 3 for d in range(n)] for r in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_equal_and_unequal_splits_equal_the_reference(n):
    unequal = _unequal(n)

    def body(comm):
        r = comm.rank
        eq = comm.all_to_all(_input(r, 2 * n))
        ins = unequal[r]
        outs = [unequal[s][r] for s in range(n)]
        x = _input(r, sum(ins), (2, 2))
        both = comm.all_to_all(x, input_split_sizes=ins, output_split_sizes=outs, label="experts")
        learnt = comm.all_to_all(x, input_split_sizes=ins)  # output sizes exchanged first
        pending = comm.all_to_all_async(x, input_split_sizes=ins, output_split_sizes=outs)
        only_out = comm.all_to_all(_input(r, n), output_split_sizes=[1] * n)
        return eq, both, learnt, pending.wait(), only_out, x

    res = simulated_world(n).run(body)
    for r in range(n):
        eq, both, learnt, waited, only_out, _ = res[r]
        assert torch.equal(eq, _expected([_input(s, 2 * n) for s in range(n)], [[2] * n] * n, r))
        want = _expected([res[s][5] for s in range(n)], unequal, r)
        assert want.shape[0] == sum(unequal[s][r] for s in range(n))
        for got in (both, learnt, waited):
            assert torch.equal(got, want)
        assert torch.equal(only_out, torch.stack([_input(s, n)[r] for s in range(n)]))


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_any_split_table_is_exchanged_exactly(data):
    n = data.draw(st.sampled_from([2, 3, 4]), label="n")
    table = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=n, max_size=n), min_size=n, max_size=n),
                      label="splits")
    row = data.draw(st.sampled_from([(), (1,), (2, 3)]), label="row shape")
    inputs = [_input(r, sum(table[r]), row, torch.float32) for r in range(n)]
    got = simulated_world(n).run(lambda c: c.all_to_all_async(inputs[c.rank], input_split_sizes=table[c.rank]).wait())
    for r in range(n):
        assert torch.equal(got[r], _expected(inputs, table, r))


def test_bytes_counted_are_what_leaves_the_rank():
    """bytes = (rows − rows kept) × row numel × itemsize; ring bytes the same (sent once)."""
    n, table = 4, _unequal(4)

    def body(comm):
        x = _input(comm.rank, sum(table[comm.rank]), (5,), torch.float32)
        with count_collectives(comm) as c:
            c.comm.all_to_all(x, input_split_sizes=table[comm.rank],
                              output_split_sizes=[table[s][comm.rank] for s in range(n)])
            c.comm.all_to_all_async(x, input_split_sizes=table[comm.rank]).wait()  # learns its sizes
        return c.records, c.bytes("all_to_all"), c.ring_bytes("all_to_all"), c.calls("all_to_all")

    for r, (records, total, ring, calls) in enumerate(simulated_world(n).run(body)):
        sent = (sum(table[r]) - table[r][r]) * 5 * 4
        sizes = (n - 1) * 8  # the int64 split sizes, one to each other rank
        assert [(x.op, x.bytes) for x in records] == [("all_to_all", sent), ("all_to_all", sizes), ("all_to_all", sent)]
        assert (total, ring, calls) == (2 * sent + sizes, 2 * sent + sizes, 3)


class _FiveCalls(CollectivesBase):
    """A custom backend with only the five blocking calls: all-to-all is derived from all-gathers."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.all_gather, self.reduce_scatter = inner.all_gather, inner.reduce_scatter
        self.all_reduce, self.broadcast, self.barrier = inner.all_reduce, inner.broadcast, inner.barrier


def test_derived_form_and_world_of_one():
    table = _unequal(3)
    inputs = [_input(r, sum(table[r]), (2,)) for r in range(3)]
    got = simulated_world(3).run(lambda c: _FiveCalls(c).all_to_all_async(
        inputs[c.rank], input_split_sizes=table[c.rank]).wait())
    for r in range(3):
        assert torch.equal(got[r], _expected(inputs, table, r))
    x = _input(0, 3)
    out = LocalCollectives().all_to_all(x, input_split_sizes=[3])
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("call, message", [
    (lambda c: c.all_to_all(torch.zeros(5, 2)), "5 rows along dim 0, not divisible by the world size 2"),
    (lambda c: c.all_to_all(torch.zeros(4), input_split_sizes=[1, 2]), "sum to 3, the tensor has 4 rows"),
    (lambda c: c.all_to_all(torch.zeros(4), input_split_sizes=[4]), "has 1 entries, the world has 2 ranks"),
    (lambda c: c.all_to_all(torch.zeros(4), output_split_sizes=[2, 2, 0]), "has 3 entries"),
    (lambda c: c.all_to_all(torch.zeros(4), input_split_sizes=[5, -1]), "negative size"),
    (lambda c: c.all_to_all(torch.zeros(2, 4).t()), "needs a contiguous tensor"),
    (lambda c: c.all_to_all(torch.tensor(1.0)), "a scalar"),
])
def test_a_bad_call_is_one_error_naming_the_rank(call, message):
    def body(comm):
        if comm.rank == 1:
            call(comm)
        return comm.all_to_all(torch.zeros(2))  # rank 0 goes on: it must be released, not hang

    with pytest.raises(fnzero.DistributedError, match="rank 1 of the simulated world") as e:
        simulated_world(2, timeout=10).run(body)
    assert f"rank 1: all_to_all" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("wrap", [None, CheckedCollectives])
@pytest.mark.parametrize("rank1, message", [
    ((torch.zeros(2, dtype=torch.float32), None, None), "another dtype|rank 1 sends torch.float32"),
    ((torch.zeros(2, 3, dtype=torch.float64), None, None), "elements|rank 1's rows have shape \\[3\\]"),
    ((torch.zeros(3, dtype=torch.float64), [2, 1], [1, 1]), "rank 1 sends 2 rows to rank 0, which expects 1 from it"),
])
def test_ranks_that_disagree_are_named_not_hung(wrap, rank1, message):
    def body(comm):
        t, ins, outs = (torch.zeros(2, dtype=torch.float64), [1, 1], [1, 1]) if comm.rank == 0 else rank1
        if ins is None:
            return comm.all_to_all(t)
        return comm.all_to_all(t, input_split_sizes=ins, output_split_sizes=outs)

    with pytest.raises(fnzero.DistributedError, match=message):
        simulated_world(2, timeout=10, wrap_comm=wrap).run(body)


def _process_group_rank():
    """Every case of the process-group, checked and functional forms, on one gloo world of 2."""
    import torch.distributed as dist

    from fnzero.sharding.comm._collectives import ProcessGroupCollectives
    from fnzero.sharding.comm._functional import FunctionalCollectives
    from fnzero.sharding.comm._watchdog import start_watchdog

    start_watchdog(dist.get_rank(), dist.get_world_size(), 60, 120)  # as init_distributed does
    comm = ProcessGroupCollectives()
    r, n = comm.rank, comm.world_size
    table = [[2, 0], [1, 3]]  # rank 0 keeps 2, sends none; rank 1 sends 1, keeps 3
    x = _input(r, sum(table[r]), (3,))
    out = {"x": x, "eq": comm.all_to_all(_input(r, 4)),
           "uneq": comm.all_to_all_async(x, input_split_sizes=table[r], label="experts").wait(),
           "watched": (comm.watchdog.issued, comm.watchdog.last),
           "bf16": comm.all_to_all(x.to(torch.bfloat16), input_split_sizes=table[r],
                                   output_split_sizes=[table[0][r], table[1][r]])}
    rec = RecordingCollectives(comm)
    rec.all_to_all(x, input_split_sizes=table[r], output_split_sizes=[table[0][r], table[1][r]])
    out["bytes"] = rec.records[0].bytes
    funcol = FunctionalCollectives(dist.group.WORLD, r, n)  # as the whole-step graph builds it
    out["functional"] = torch.as_tensor(funcol.all_to_all(x, input_split_sizes=table[r],
                                                          output_split_sizes=[table[0][r], table[1][r]])).clone()
    # Traced as the whole-step graph (`fnzero.jit(scope="step")`) traces it: one graph, no break.
    traced = torch.compile(lambda t: funcol.all_to_all(t * 2, input_split_sizes=table[r], output_split_sizes=[
        table[0][r], table[1][r]]) + 1, fullgraph=True, backend="aot_eager")
    out["traced"] = traced(x)
    try:
        funcol.all_to_all(x, input_split_sizes=table[r])
    except fnzero.DistributedError as e:
        out["functional_error"] = str(e)
    try:  # rank 1 expects 2 rows from rank 0, which sends it 1: named by the checker, no hang
        CheckedCollectives(comm).all_to_all(torch.zeros(2), input_split_sizes=[1, 1],
                                            output_split_sizes=[1, 1] if r == 0 else [2, 1])
    except fnzero.DistributedError as e:
        out["checked_error"] = str(e)
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_process_group_functional_and_checked_forms_on_gloo():
    res = run_world(_process_group_rank, 2, timeout=120)
    table, inputs = [[2, 0], [1, 3]], [res[0]["x"], res[1]["x"]]
    for r in range(2):
        want = _expected(inputs, table, r)
        assert torch.equal(res[r]["eq"], _expected([_input(s, 4) for s in range(2)], [[2, 2]] * 2, r))
        assert torch.equal(res[r]["uneq"], want) and torch.equal(res[r]["functional"], want)
        assert torch.equal(res[r]["bf16"], want.to(torch.bfloat16))
        assert torch.equal(res[r]["traced"], want * 2 + 1)
        # Numbered and labelled by the watchdog like every collective: the equal one, the sizes, the data.
        assert res[r]["watched"] == (3, ("all_to_all", "experts"))
        assert res[r]["bytes"] == (sum(table[r]) - table[r][r]) * 3 * 8
        assert "needs output_split_sizes" in res[r]["functional_error"]
        assert "rank 0 sends 1 rows to rank 1, which expects 2 from it" in res[r]["checked_error"]
