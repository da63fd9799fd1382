"""tilepy.tile.device_write and tilepy.tile.tma.maps_to_device: buffers from an allocation
callback, aligned inside it where the callback's pointer is not, and bytes written by the
writer kernel (in the simulator a simulator kernel) landing exactly where they should — and
nowhere else."""

from __future__ import annotations

import numpy as np
import pytest

from tilepy import arrays
from tilepy.tile import device_write as dw
from tilepy.tile import tma as host_tma

pytestmark = pytest.mark.sim



def host_alloc(offset=0, log=None):
    """An allocation callback over NumPy arrays whose pointers are ``offset`` bytes past a
    64-byte boundary (0: aligned), recording each request in ``log``."""
    def alloc(nbytes):
        if log is not None:
            log.append(nbytes)
        base = np.zeros(nbytes + 128, np.uint8)
        start = -base.ctypes.data % 64 + offset
        view = base[start:start + nbytes]
        return view, view.ctypes.data
    return alloc


def read(ptr, nbytes):
    import ctypes

    return np.frombuffer(ctypes.string_at(ptr, nbytes), np.uint8)


@pytest.mark.parametrize("nbytes", [8, 24, 128, 136, 384])
def test_write_lands_exactly(nbytes):
    """Words 1 … 16 in one writer launch, more in several: every byte as given, the bytes
    around untouched."""
    rng = np.random.default_rng()
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    guard = np.full(nbytes + 32, 0xA5, np.uint8)
    ptr = guard.ctypes.data + 16
    assert ptr % 8 == 0
    dw.write(0, ptr, data)
    np.testing.assert_array_equal(guard[16:16 + nbytes], data)
    assert (guard[:16] == 0xA5).all() and (guard[16 + nbytes:] == 0xA5).all()


def test_write_and_zero_take_bytes_and_refuse_odd_sizes():
    buf = np.full(16, 7, np.uint8)
    dw.write(0, buf.ctypes.data, b"\x01\x02\x03\x04\x05\x06\x07\x08")
    assert buf[:8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and (buf[8:] == 7).all()
    dw.zero(0, buf.ctypes.data + 8, 8)
    assert (buf[8:] == 0).all()
    with pytest.raises(ValueError, match="multiple of 8"):
        dw.write(0, buf.ctypes.data, b"\x00" * 12)
    with pytest.raises(ValueError, match="8-byte aligned"):
        dw.write(0, buf.ctypes.data + 4, b"\x00" * 8)


def test_allocate_aligns_inside_a_larger_allocation():
    log = []
    buf = dw.allocate(host_alloc(0, log), 256, 64)     # aligned already: used as it is
    assert buf.ptr % 64 == 0 and log == [256] and buf.nbytes == 256
    log.clear()
    buf = dw.allocate(host_alloc(16, log), 256, 64)    # 16 bytes off: one larger request
    assert buf.ptr % 64 == 0 and log == [256, 256 + 63]
    start = buf.owner.ctypes.data
    assert start <= buf.ptr and buf.ptr + 256 <= start + buf.owner.nbytes


def test_view_keeps_the_buffer_and_reads_its_bytes():
    buf = dw.allocate(host_alloc(8), 16, 8)
    dw.write(0, buf.ptr, np.arange(16, dtype=np.uint8))
    v = buf.view((2,), np.uint64)
    del buf
    np.testing.assert_array_equal(v.copy_to_host().view(np.uint8), np.arange(16))
    with pytest.raises(ValueError, match="a view of 24 bytes"):
        dw.allocate(host_alloc(), 16).view((3,), np.uint64)


def test_maps_to_device_is_aligned_and_exact():
    """Three maps through an allocator 32 bytes off alignment: 64-byte aligned, bytes as
    encoded; and TensorMap.to_device the same for one map."""
    rng = np.random.default_rng()
    src = rng.standard_normal((64, 64)).astype(np.float16)
    maps = [host_tma.encode_tiled(src.ctypes.data, "float16", (64, 64), (128, 2), (rows, 64))
            for rows in (8, 16, 64)]
    raw = np.concatenate([m.data for m in maps])
    log = []
    buf = host_tma.maps_to_device(raw, 0, host_alloc(32, log))
    assert buf.ptr % host_tma.MAP_ALIGN == 0 and log == [384, 384 + 63]
    np.testing.assert_array_equal(read(buf.ptr, 384), raw)
    dev = maps[1].to_device(alloc=host_alloc(16))
    assert arrays.SIMULATOR and dev._ary.ctypes.data % host_tma.MAP_ALIGN == 0
    np.testing.assert_array_equal(dev.copy_to_host(), maps[1].data)
    with pytest.raises(ValueError, match="whole number of 128-byte"):
        host_tma.maps_to_device(raw[:100])


def test_byte_allocator_of_the_simulator_families():
    """tilepy.arrays.byte_allocator: host memory in the simulator, whatever the family."""
    op = arrays.describe(np.zeros((2, 2), np.float16), "x")
    y, p = arrays.byte_allocator(op)(40)
    assert y.dtype == np.uint8 and y.size == 40 and p == y.ctypes.data


def test_no_stream_captures_in_the_simulator():
    assert dw.stream_capturing(0) is False and dw.stream_capturing(0x5EED) is False


@pytest.mark.compile
def test_writer_compiles_to_sixteen_global_stores():
    """The writer kernel for sm_90 (offline, no simulator): 16 64-bit global stores of its
    parameters, no local memory."""
    from tilepy.offline import find_ptxas, run_in_subprocess

    if find_ptxas() is None:
        pytest.skip("ptxas not found (install the test extra)")
    rep = run_in_subprocess("tilepy.tile.device_write:compile_reports")["write_words"]
    assert "error" not in rep, rep.get("error")
    assert rep["ptx"].count("st.global.u64") == dw.WORDS
    assert rep["spill_stores"] == 0 and rep["local_bytes"] == 0 and rep["stack_frame"] == 0
