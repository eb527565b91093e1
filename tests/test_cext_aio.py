"""Async file I/O (cext/aio.c via fnzero._ext.AioHandle), native and fallback."""

import os

import pytest
import torch

from fnzero import _ext

BACKENDS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not _ext.available(), reason="no C extension")),
            pytest.param(False, id="fallback")]  # fmt: skip


def pattern(nbytes, seed=0):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("block_size,queue_depth,thread_count", [(1 << 20, 8, 1), (65536, 1, 1), (4096 * 3, 4, 2)])
def test_aligned_round_trip(tmp_path, native, block_size, queue_depth, thread_count):
    data = _ext.aligned_empty(3 * (1 << 20) + 8192, torch.uint8)
    data.copy_(pattern(data.numel()))
    path = tmp_path / "swap.bin"
    kw = dict(block_size=block_size, queue_depth=queue_depth, thread_count=thread_count, use_cext=native)
    with _ext.AioHandle(path, "w", size=data.numel() + 4096, **kw) as h:
        assert h.direct == (native and _ext.direct_supported(tmp_path))
        assert h.pwrite(data, 4096) == data.numel()
        back = _ext.aligned_empty(data.numel(), torch.uint8)
        h.pread(back, 4096)
    assert torch.equal(back, data)
    assert os.path.getsize(path) == data.numel() + 4096


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("offset", [0, 1, 4095, 4097, 12345])
def test_unaligned_offsets_sizes_and_buffers(tmp_path, native, offset):
    raw = torch.empty(100_003, dtype=torch.uint8)
    data = raw[3:]  # data_ptr not 4096-aligned, odd length
    data.copy_(pattern(data.numel(), offset))
    assert not _ext.is_aligned(data)
    with _ext.AioHandle(tmp_path / "f.bin", "w", block_size=8192, queue_depth=4, use_cext=native) as h:
        h.pwrite(data, offset)
        floats = torch.arange(1001, dtype=torch.float32)
        h.pwrite(floats, offset + data.numel())
        back = torch.empty_like(data)
        fback = torch.empty_like(floats)
        h.pread(back, offset)
        h.pread(fback, offset + data.numel())
    assert torch.equal(back, data) and torch.equal(fback, floats)


@pytest.mark.parametrize("native", BACKENDS)
def test_many_outstanding_requests(tmp_path, native):
    chunk, count = 12288 + 100, 64
    src = [pattern(chunk, i) for i in range(count)]
    with _ext.AioEngine(block_size=4096, queue_depth=4, thread_count=2, use_cext=native) as eng:
        with _ext.AioHandle(tmp_path / "m.bin", "w", engine=eng) as h:
            reqs = [h.submit_write(t, i * chunk) for i, t in enumerate(src)]
            assert sum(r.wait() for r in reqs) == chunk * count
            dst = [torch.empty(chunk, dtype=torch.uint8) for _ in range(count)]
            reqs = [h.submit_read(t, i * chunk) for i, t in enumerate(dst)]
            h.wait_all()
            assert all(r.done() for r in reqs)
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        if native:
            assert eng.workers == 8


@pytest.mark.parametrize("native", BACKENDS)
def test_preallocate_and_reopen(tmp_path, native):
    path = tmp_path / "p.bin"
    with _ext.AioHandle(path, "w", use_cext=native) as h:
        assert h.size == 0
        h.preallocate(1 << 20)
        assert h.size == 1 << 20
        h.preallocate(10)  # never shrinks
        assert h.size == 1 << 20
        h.pwrite(torch.ones(4), 100)
        h.sync()
    with _ext.AioHandle(path, "r", use_cext=native) as h:
        assert torch.equal(h.pread(torch.empty(4), 100), torch.ones(4))
        with pytest.raises(ValueError, match="read-only"):
            h.pwrite(torch.ones(4), 0)
    with _ext.AioHandle(path, "a+", use_cext=native) as h:  # keeps contents
        assert h.size == 1 << 20


@pytest.mark.parametrize("native", BACKENDS)
def test_missing_and_truncated_files_name_the_path(tmp_path, native):
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError) as e:
        _ext.AioHandle(missing, "r", use_cext=native)
    assert e.value.filename == str(missing)
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 1000)
    with _ext.AioHandle(short, "r+", use_cext=native) as h:
        with pytest.raises(OSError, match="truncated") as e:
            h.pread(torch.empty(4096, dtype=torch.uint8), 0)
        assert e.value.filename == str(short)
    with pytest.raises(ValueError, match="mode"):
        _ext.AioHandle(short, "x")


@pytest.mark.skipif(not _ext.available(), reason="no C extension")
def test_short_read_detected_by_native_backend(tmp_path):
    """A file truncated after the size check: the worker's short read becomes an OSError."""
    path = tmp_path / "t.bin"
    path.write_bytes(b"y" * 10000)
    with _ext.AioHandle(path, "r+") as h:
        buf = torch.empty(10000, dtype=torch.uint8)
        os.truncate(path, 5000)
        req = _ext.AioRequest(h, False, buf, 10000, 0, None, 5000)  # what wait() sees for a short read
        with pytest.raises(OSError, match="ends after 5000"):
            req.wait()
        lib, ffi = _ext._lib.lib, _ext._lib.ffi
        err = ffi.new("int *")
        r = lib.fnz_aio_submit(h.engine._ptr, h._file, 0, ffi.cast("void *", buf.data_ptr()), 10000, 0, err)
        assert lib.fnz_aio_wait(h.engine._ptr, r) == 5000


def test_aligned_empty_and_config():
    t = _ext.aligned_empty((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and _ext.is_aligned(t)
    eng = _ext.AioEngine.from_config({"block_size": 65536, "queue_depth": 2, "thread_count": 3})
    assert (eng.block_size, eng.queue_depth, eng.thread_count) == (65536, 2, 3)
    eng.close()
    with pytest.raises(ValueError, match="queue_depth"):
        _ext.AioEngine(queue_depth=0)


@pytest.mark.skipif(not _ext.available(), reason="no C extension")
def test_direct_probe(tmp_path):
    assert _ext.direct_supported(tmp_path) in (True, False)
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        _ext.direct_supported(tmp_path / "no" / "such" / "dir")
