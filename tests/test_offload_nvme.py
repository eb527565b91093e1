"""The NVMe optimizer store (fnzero/offload/_nvme.py, specs/offload.md §NVMe store): bitwise
equal to the in-memory kernels, bounded memory, and never silently reading bad files."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fnzero
from fnzero import _ext
from fnzero.offload import NvmeOptimizerStore, NvmeStoreError, stale_stores
from fnzero.offload import _nvme
from fnzero.offload._nvme_optimizer import StoreOptions

NATIVE = [True, False] if _ext.available() else [False]
BACKENDS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not _ext.available(), reason="no C extension")),
            pytest.param(False, id="fallback")]  # fmt: skip
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, bias_correction=True)
HYPER = {"adam": ADAM, "adagrad": dict(lr=0.1, lr_decay=0.01, eps=1e-10, weight_decay=0.01),
         "lion": dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)}  # fmt: skip
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def manifest_of(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def in_memory(optimizer, master, grads, step, native, out=None, grad_scale=1.0):
    """The reference: the same kernel over whole units, state dict {kind: {unit: tensor}}."""
    kernel, moments = _nvme.OPTIMIZERS[optimizer]
    kw = dict(HYPER[optimizer], grad_scale=grad_scale, use_cext=native)
    if optimizer != "lion":
        kw["step"] = step
    for unit, p in master["master"].items():
        o = out[unit] if out is not None else None
        g = grads[unit].float()
        o16 = o if o is not None and o.dtype != torch.float32 else None
        kernel(p, g, *[master[k][unit] for k in moments], out16=o16, **kw)
        if o is not None and o.dtype == torch.float32:
            o.copy_(p)


def run_both(tmp, optimizer, sizes, sg, nb, native, steps=2, out_dtype=None, grad_dtype=torch.float32, grad_scale=0.5):
    master = {f"u{i}": torch.randn(n) for i, n in enumerate(sizes)}
    ref = {"master": {k: v.clone() for k, v in master.items()}}
    ref.update({k: {u: torch.zeros(v.numel()) for u, v in master.items()} for k in _nvme.OPTIMIZERS[optimizer][1]})
    with NvmeOptimizerStore.create(tmp, master, optimizer=optimizer, sub_group_size=sg, buffer_count=nb,
                                   use_cext=native) as store:  # fmt: skip
        for v in master.values():
            v.fill_(float("nan"))  # the store holds its own copy
        for s in range(1, steps + 1):
            grads = {u: torch.randn(n).to(grad_dtype) for u, n in zip(master, sizes)}
            out = ref_out = None
            if out_dtype is not None:
                out = {u: torch.empty(n, dtype=out_dtype) for u, n in zip(master, sizes)}
                ref_out = {u: torch.empty(n, dtype=out_dtype) for u, n in zip(master, sizes)}
            store.step(grads, step=s, out=out, grad_scale=grad_scale, **HYPER[optimizer])
            in_memory(optimizer, ref, grads, s, native, ref_out, grad_scale)
            if out is not None:
                for u in out:
                    assert torch.equal(bits(out[u]), bits(ref_out[u])), (u, s)
        for kind in store.kinds:
            for u in master:
                assert torch.equal(bits(store.read(u, kind)), bits(ref[kind][u])), (kind, u)
        assert store.last_step == steps


SIZES = [0, 1, 3, 7, 8, 15, 17, 31, 1023, 1024, 1025, 4099]


@given(sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=4),
       sg=st.sampled_from([1, 2, 3, 7, 8, 100, 1000, 1024, 2048, 3001, 10**9]), nb=st.integers(2, 5),
       native=st.sampled_from(NATIVE), out_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]),
       grad_scale=st.sampled_from([1.0, 0.25, 1 / 3]))  # fmt: skip
def test_adam_equals_in_memory_bitwise(sizes, sg, nb, native, out_dtype, grad_scale):
    # The pool's per-request cost (~0.1-0.3 ms on 2 shared cores) makes tiny chunks slow: keep it
    # to a few hundred chunks; the small sizes still cover sub-vector lengths and odd tails.
    sizes = [n for n in sizes if -(-n // sg) <= 150] or [0]
    with tempfile.TemporaryDirectory() as tmp:
        run_both(tmp, "adam", sizes, sg, nb, native, out_dtype=out_dtype, grad_scale=grad_scale)


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adagrad", "lion"])
def test_adagrad_lion_equal_in_memory_bitwise(tmp_path, optimizer, native):
    run_both(tmp_path, optimizer, [1025, 0, 5, 3000], 1000, 3, native, steps=3, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("native", BACKENDS)
def test_16bit_and_fp64_grads_are_converted_per_chunk(tmp_path, native):
    run_both(tmp_path, "adam", [2049, 6], 512, 2, native, grad_dtype=torch.bfloat16, out_dtype=torch.float16)
    run_both(tmp_path, "adam", [777], 100, 4, native, grad_dtype=torch.float64)


def test_extension_disabled_by_environment_uses_both_fallbacks(tmp_path):
    # FNZERO_DISABLE_CEXT=1 is read at import: a fresh interpreter, where the default (use_cext=None)
    # must pick the torch kernels and the synchronous I/O.
    code = """
import sys, torch
from fnzero import _ext
from fnzero.offload import NvmeOptimizerStore
assert not _ext.available()
master = {"a": torch.randn(1500), "b": torch.randn(3), "c": torch.randn(0)}
ref = {k: [v.clone(), torch.zeros_like(v), torch.zeros_like(v)] for k, v in master.items()}
with NvmeOptimizerStore.create(sys.argv[1], master, sub_group_size=256, buffer_count=3) as s:
    assert not s._handles["master"].direct and not s._engine.native
    for step in (1, 2):
        g = {k: torch.randn_like(v) for k, v in master.items()}
        s.step(g, step=step, lr=0.01, weight_decay=0.1)
        for k, (p, m, v) in ref.items():
            _ext.adam_step_(p, g[k], m, v, step=step, lr=0.01, weight_decay=0.1)
    for k, want in ref.items():
        for kind, w in zip(s.kinds, want):
            assert torch.equal(s.read(k, kind), w), (k, kind)
print("ok")
"""
    env = dict(os.environ, FNZERO_DISABLE_CEXT="1")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_create_layout_copy_and_scratch_directories(tmp_path):
    master = {"w": torch.arange(5000, dtype=torch.float32).reshape(50, 100), "empty": torch.empty(0), "b": torch.ones(3)}
    a = NvmeOptimizerStore.create(tmp_path, master, sub_group_size=1024, rank=3)
    b = NvmeOptimizerStore.create(tmp_path, master, rank=3)
    try:
        assert a.path != b.path and os.path.basename(a.path).startswith("fnzero-rank3-")
        assert sorted(os.listdir(a.path)) == ["exp_avg.bin", "exp_avg_sq.bin", "lock", "manifest.json", "master.bin"]
        manifest = manifest_of(a.path)
        assert manifest["state"] == "clean" and manifest["step"] is None
        # header block, then each unit on an aligned block: 5000 fp32 -> 20000 bytes -> 20480
        assert manifest["units"] == [["w", 5000, 4096], ["empty", 0, 24576], ["b", 3, 24576]]
        sizes = [os.path.getsize(os.path.join(a.path, f"{k}.bin")) for k in a.kinds]
        assert a.bytes_on_disk == 3 * (24576 + 4096) == sum(sizes)
        assert a.units == {"w": 5000, "empty": 0, "b": 3}
        master["w"].zero_()
        assert torch.equal(a.read("w"), torch.arange(5000, dtype=torch.float32))
        assert torch.equal(a.read("w", "exp_avg_sq"), torch.zeros(5000)) and a.read("empty").numel() == 0
        buf = torch.empty(3)
        assert a.read("b", "master", out=buf) is buf and torch.equal(buf, torch.ones(3))
        a.write("b", "exp_avg", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        assert torch.equal(a.read("b", "exp_avg"), torch.tensor([1.0, 2.0, 3.0]))
        if _ext.available() and _ext.direct_supported(tmp_path):
            assert a._handles["master"].direct  # O_DIRECT where the file system allows it
    finally:
        a.close()
        b.close(delete=False)
    assert not os.path.exists(a.path) and os.path.exists(b.path)
    a.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        a.read("w")


def test_bad_arguments_change_nothing(tmp_path):
    with pytest.raises(ValueError, match="optimizer"):
        NvmeOptimizerStore.create(tmp_path, {}, optimizer="sgd")
    with pytest.raises(ValueError, match="sub_group_size"):
        NvmeOptimizerStore.create(tmp_path, {}, sub_group_size=0)
    with pytest.raises(ValueError, match="buffer_count"):
        NvmeOptimizerStore.create(tmp_path, {}, buffer_count=1)
    with pytest.raises(ValueError, match="float32"):
        NvmeOptimizerStore.create(tmp_path, {"a": torch.ones(3, dtype=torch.float16)})
    with pytest.raises(ValueError, match="unknown aio keys"):
        NvmeOptimizerStore.create(tmp_path, {}, aio={"blocksize": 4096})
    aio = {"block_size": 8192, "queue_depth": 2, "intra_op_parallelism": 2, "single_submit": False, "overlap_events": True}
    with NvmeOptimizerStore.create(tmp_path, {"a": torch.ones(10), "b": torch.ones(2)}, aio=aio) as s:
        assert s._engine.native == _ext.available() and (not s._engine.native or s._engine.workers == 4)
        g = {"a": torch.ones(10), "b": torch.ones(2)}
        with pytest.raises(ValueError, match="exactly the store's units"):
            s.step({"a": g["a"]}, step=1, **ADAM)
        with pytest.raises(ValueError, match="10 elements"):
            s.step({"a": torch.ones(11), "b": g["b"]}, step=1, **ADAM)
        with pytest.raises(ValueError, match="out"):
            s.step(g, step=1, out={"a": torch.ones(10, dtype=torch.int32), "b": torch.ones(2)}, **ADAM)
        with pytest.raises(TypeError):
            s.step(g, step=1, lr=1.0, momentum=0.9)
        with pytest.raises(ValueError, match="step"):
            s.step(g, step=0, **ADAM)
        with pytest.raises(ValueError, match="exp_avg"):
            s.read("a", "sum")
        with pytest.raises(KeyError):
            s.read("c")
        assert manifest_of(s.path)["state"] == "clean"
        s.step(g, step=1, **ADAM)  # still fine
    assert os.listdir(tmp_path) == []  # failed creates left nothing either


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("damage", ["truncate", "delete", "replace"])
def test_damaged_live_files_raise_naming_the_path(tmp_path, native, damage):
    with NvmeOptimizerStore.create(tmp_path, {"a": torch.ones(3000)}, sub_group_size=1024, use_cext=native) as s:
        path = os.path.join(s.path, "exp_avg.bin")
        if damage == "truncate":
            os.truncate(path, 8192)
        elif damage == "delete":
            os.unlink(path)
        else:
            os.rename(path, path + ".old")
            open(path, "wb").close()
        for call in (lambda: s.step({"a": torch.ones(3000)}, step=1, **ADAM), lambda: s.read("a", "master")):
            with pytest.raises(NvmeStoreError, match="exp_avg.bin") as e:
                call()
            assert isinstance(e.value, OSError) and isinstance(e.value, fnzero.DistributedError)
            assert e.value.filename == path


def test_open_inspects_and_refuses_bad_files(tmp_path):
    s = NvmeOptimizerStore.create(tmp_path, {"a": torch.randn(3000), "b": torch.randn(5)}, sub_group_size=1000)
    s.step({"a": torch.randn(3000), "b": torch.randn(5)}, step=1, **ADAM)
    expect = {k: s.read("a", k) for k in s.kinds}
    s.close(delete=False)
    with NvmeOptimizerStore.open(s.path) as r:
        assert r.last_step == 1 and all(torch.equal(r.read("a", k), v) for k, v in expect.items())
        with pytest.raises(ValueError, match="read-only"):
            r.write("a", "master", torch.ones(3000))
    assert os.path.exists(s.path)  # open never deletes

    other = NvmeOptimizerStore.create(tmp_path, {"a": torch.randn(3000), "b": torch.randn(5)})
    other.close(delete=False)
    os.replace(os.path.join(other.path, "exp_avg.bin"), os.path.join(s.path, "exp_avg.bin"))
    with pytest.raises(NvmeStoreError, match="header does not match"):
        NvmeOptimizerStore.open(s.path)
    os.truncate(os.path.join(s.path, "exp_avg.bin"), 100)
    with pytest.raises(NvmeStoreError, match="truncated") as e:
        NvmeOptimizerStore.open(s.path)
    assert e.value.filename == os.path.join(s.path, "exp_avg.bin")
    os.unlink(os.path.join(s.path, "manifest.json"))
    with pytest.raises(NvmeStoreError, match="no store manifest"):
        NvmeOptimizerStore.open(s.path)


def test_a_step_that_fails_part_way_poisons_the_store(tmp_path, monkeypatch):
    s = NvmeOptimizerStore.create(tmp_path, {"a": torch.randn(4096)}, sub_group_size=1024)
    calls = []
    real = s._kernel

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:  # the dry run, chunk 0, then chunk 1 fails after chunk 0 was written
            raise RuntimeError("boom")
        real(*args, **kw)

    monkeypatch.setattr(s, "_kernel", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        s.step({"a": torch.ones(4096)}, step=1, **ADAM)
    for call in (lambda: s.read("a"), lambda: s.step({"a": torch.ones(4096)}, step=1, **ADAM)):
        with pytest.raises(NvmeStoreError, match="failed part-way"):
            call()
    s.close(delete=False)
    with pytest.raises(NvmeStoreError, match="interrupted during step"):
        NvmeOptimizerStore.open(s.path)
    with NvmeOptimizerStore.open(s.path, allow_interrupted=True) as r:
        assert r.read("a").numel() == 4096


_CHILD = """
import os, sys, torch
torch.set_num_threads(1)
from fnzero.offload import NvmeOptimizerStore
s = NvmeOptimizerStore.create(sys.argv[1], {"a": torch.randn(1 << 20), "b": torch.randn(12345)}, sub_group_size=1 << 16)
g = {"a": torch.randn(1 << 20), "b": torch.randn(12345)}
print(s.path, flush=True)
i = 0
while True:
    i += 1
    s.step(g, step=i, lr=1e-3)
"""


def test_sigkill_mid_step_then_a_new_run(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        deadline = time.monotonic() + 30
        while manifest_of(path)["step"] is None:  # a step or more done: now it is stepping
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.01)
        assert stale_stores(tmp_path) == []  # alive: its lock is held
        time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert stale_stores(tmp_path) == [path]
    state = manifest_of(path)["state"]
    print("killed store state:", state)
    if state == "clean":  # killed between two steps: consistent, opens
        with NvmeOptimizerStore.open(path) as r:
            assert r.read("b").numel() == 12345
    else:  # almost always: killed inside a step, and open says so instead of reading mixed state
        with pytest.raises(NvmeStoreError, match="interrupted during step") as e:
            NvmeOptimizerStore.open(path)
        assert path in str(e.value)
    with NvmeOptimizerStore.create(tmp_path, {"a": torch.ones(1000)}) as s:  # the next run: fresh files
        assert s.path != path
        s.step({"a": torch.ones(1000)}, step=1, **ADAM)
        assert stale_stores(tmp_path, remove=True) == [path]
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_step_memory_is_bounded_by_the_buffers_not_the_shards(tmp_path):
    # 8M parameters: 96 MiB of master + moments on disk; buffers 4 x 256K x 12 bytes = 12 MiB.
    n, units, sg, nb = 8 << 20, 4, 256 << 10, 4
    master = {f"u{i}": torch.randn(n // units) for i in range(units)}
    with NvmeOptimizerStore.create(tmp_path, master, sub_group_size=sg, buffer_count=nb) as s:
        del master
        grads = {f"u{i}": torch.randn(n // units) for i in range(units)}
        out = {f"u{i}": torch.empty(n // units, dtype=torch.bfloat16).fill_(0) for i in range(units)}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _status("VmRSS")
        s.step(grads, step=1, out=out, **ADAM)
        extra = _status("VmHWM") - base
    state_bytes = 12 * n
    bound = nb * sg * 12 + sg * 4
    print(f"peak extra RSS {extra / 2**20:.1f} MiB, buffers {bound / 2**20:.1f} MiB, state {state_bytes / 2**20:.0f} MiB")
    assert extra < bound + (16 << 20), f"peak extra RSS {extra >> 20} MiB, buffers {bound >> 20} MiB"
    assert extra < state_bytes / 3, f"peak extra RSS {extra >> 20} MiB vs {state_bytes >> 20} MiB of state"


def test_a_large_sub_group_size_stages_a_bounded_chunk_with_the_same_bits(tmp_path, monkeypatch):
    """DeepSpeed's default sub_group_size (1e9) no longer stages whole units: a step streams chunks
    of at most MAX_CHUNK elements (lowered to 1024 here to keep the test small; 4Mi in use), the
    staging buffers hold that many per kind, and the results equal whole-unit updates bit for bit.
    An optimizer whose state does not start at zero writes it at init a chunk at a time."""
    monkeypatch.setattr(_nvme, "MAX_CHUNK", 1024)
    run_both(str(tmp_path / "a"), "adam", [5000, 3, 2049], 10**9, 3, NATIVE[0], out_dtype=torch.bfloat16)
    master = {"u": torch.randn(5000)}
    with NvmeOptimizerStore.create(tmp_path / "b", master, sub_group_size=10**9, buffer_count=3) as s:
        s.step({"u": torch.randn(5000)}, step=1, **ADAM)
        assert s.chunk_elems == 1024 and {b.numel() for bufs in s._bufs for b in bufs.values()} == {1024}
    opt = fnzero.offload.nvme_optimizer(fnzero.optim.adagrad(lr=0.1, initial_accumulator_value=0.25),
                                        StoreOptions(directory=str(tmp_path / "c")))
    state = opt.init({"u": torch.randn(5000)})
    starts = [state.store.read("u", k) for k in state.store.kinds if k != "master"]
    assert any(torch.equal(v, torch.full((5000,), 0.25)) for v in starts), starts
    state.store.close()
