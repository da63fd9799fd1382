"""Vector shared / global moves: the 4-, 8- and 16-byte accesses of a shared-memory-staged store.

Per thread (no warp exchange); addresses are byte addresses from
:func:`tilepy.ptx.address.shared_addr` (uint32) and :func:`~tilepy.ptx.address.global_addr`
(uint64), aligned to the access size:

* ``st_shared_b32(addr, w)`` — 4 bytes (``st.shared.b32``);
* ``st_shared_v2_f32(addr, x, y)`` — 8 bytes, x first (``st.shared.v2.f32``);
* ``ld_shared_f32(addr) -> x`` — 4 bytes as a float32 (``ld.shared.f32``);
  ``ld_shared_b32(addr) -> w`` the same as a uint32 (``ld.shared.b32``);
* ``ld_shared_v2_f32(addr) -> (x, y)`` — 8 bytes as two float32 (``ld.shared.v2.f32``);
* ``ld_shared_v4_b32(addr) -> (w0, w1, w2, w3)`` — 16 bytes as four uint32, lowest address
  first (``ld.shared.v4.b32``); ``ld_shared_v4_f32`` the same as float32;
* ``st_shared_v4_b32(addr, w0, w1, w2, w3)`` — 16 bytes, w0 first (``st.shared.v4.b32``);
* ``ld_global_v4_b32(gaddr) -> (w0, w1, w2, w3)`` — 16 bytes from global memory
  (``ld.global.v4.b32``);
* ``st_global_v4_b32(gaddr, w0, w1, w2, w3)`` / ``st_global_v4_f32(gaddr, x0, …, x3)`` — 16
  bytes to global memory (``st.global.v4``).

All are declared with side effects and a memory clobber, so the compiler keeps them in program
order with barriers (:mod:`tilepy.ptx.barrier`) and other inline PTX. The twins read and write
the bytes at the address after checking that the access lies inside an array whose address the
block took and is aligned (an ``IndexError`` / ``ValueError`` instead of a wild access).
"""

from __future__ import annotations

import numpy as np

from . import address
from .asm import instruction


def _check(space, who, addr, nbytes):
    addr = int(addr)
    address.check_range(space, who, addr, nbytes, nbytes)
    return addr


def _st_shared_b32_twin(addr, w):
    addr = _check("shared", "st_shared_b32", addr, 4)
    address.write_bytes(addr, np.uint32(int(w) & 0xFFFFFFFF).tobytes())


def _st_shared_v2_f32_twin(addr, x, y):
    addr = _check("shared", "st_shared_v2_f32", addr, 8)
    address.write_bytes(addr, np.array([x, y], np.float32).tobytes())


def _ld_shared_f32_twin(addr):
    addr = _check("shared", "ld_shared_f32", addr, 4)
    return np.frombuffer(address.read_bytes(addr, 4), np.float32)[0]


def _ld_shared_b32_twin(addr):
    addr = _check("shared", "ld_shared_b32", addr, 4)
    return np.frombuffer(address.read_bytes(addr, 4), np.uint32)[0]


def _st_shared_v4_b32_twin(addr, w0, w1, w2, w3):
    addr = _check("shared", "st_shared_v4_b32", addr, 16)
    words = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)], np.uint32)
    address.write_bytes(addr, words.tobytes())


def _ld_shared_v2_f32_twin(addr):
    addr = _check("shared", "ld_shared_v2_f32", addr, 8)
    return tuple(np.frombuffer(address.read_bytes(addr, 8), np.float32).copy())


def _ld_shared_v4_b32_twin(addr):
    addr = _check("shared", "ld_shared_v4_b32", addr, 16)
    return tuple(np.frombuffer(address.read_bytes(addr, 16), np.uint32).copy())


def _ld_shared_v4_f32_twin(addr):
    addr = _check("shared", "ld_shared_v4_f32", addr, 16)
    return tuple(np.frombuffer(address.read_bytes(addr, 16), np.float32).copy())


def _ld_global_v4_b32_twin(gaddr):
    gaddr = _check("global", "ld_global_v4_b32", gaddr, 16)
    return tuple(np.frombuffer(address.read_bytes(gaddr, 16), np.uint32).copy())


def _st_global_v4_b32_twin(gaddr, w0, w1, w2, w3):
    gaddr = _check("global", "st_global_v4_b32", gaddr, 16)
    words = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)], np.uint32)
    address.write_bytes(gaddr, words.tobytes())


def _st_global_v4_f32_twin(gaddr, x0, x1, x2, x3):
    gaddr = _check("global", "st_global_v4_f32", gaddr, 16)
    address.write_bytes(gaddr, np.array([x0, x1, x2, x3], np.float32).tobytes())


_MEM = {"side_effect": True, "clobber_memory": True}

st_shared_b32 = instruction(
    "st_shared_b32", "st.shared.b32 [$0], $1;", ins=("u32", "u32"), **_MEM,
    twin=_st_shared_b32_twin,
    doc="``st_shared_b32(addr, w)``: store 4 bytes at shared address addr (4-byte aligned).")

st_shared_v2_f32 = instruction(
    "st_shared_v2_f32", "st.shared.v2.f32 [$0], {$1, $2};", ins=("u32", "f32", "f32"), **_MEM,
    twin=_st_shared_v2_f32_twin,
    doc="``st_shared_v2_f32(addr, x, y)``: store two float32 at shared address addr (8-byte "
        "aligned), x at addr.")

ld_shared_f32 = instruction(
    "ld_shared_f32", "ld.shared.f32 $0, [$1];", outs=("f32",), ins=("u32",), **_MEM,
    twin=_ld_shared_f32_twin,
    doc="``ld_shared_f32(addr) -> x``: load a float32 from shared address addr (4-byte "
        "aligned).")

ld_shared_b32 = instruction(
    "ld_shared_b32", "ld.shared.b32 $0, [$1];", outs=("u32",), ins=("u32",), **_MEM,
    twin=_ld_shared_b32_twin,
    doc="``ld_shared_b32(addr) -> w``: load 4 bytes from shared address addr (4-byte aligned) "
        "as a uint32.")

st_shared_v4_b32 = instruction(
    "st_shared_v4_b32", "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
    ins=("u32", "u32", "u32", "u32", "u32"), **_MEM, twin=_st_shared_v4_b32_twin,
    doc="``st_shared_v4_b32(addr, w0, w1, w2, w3)``: store 16 bytes at shared address addr "
        "(16-byte aligned), w0 first.")

ld_shared_v2_f32 = instruction(
    "ld_shared_v2_f32", "ld.shared.v2.f32 {$0, $1}, [$2];",
    outs=("f32", "f32"), ins=("u32",), **_MEM, twin=_ld_shared_v2_f32_twin,
    doc="``ld_shared_v2_f32(addr) -> (x, y)``: load 8 bytes from shared address addr (8-byte "
        "aligned) as two float32, x at addr.")

ld_shared_v4_b32 = instruction(
    "ld_shared_v4_b32", "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
    outs=("u32", "u32", "u32", "u32"), ins=("u32",), **_MEM, twin=_ld_shared_v4_b32_twin,
    doc="``ld_shared_v4_b32(addr) -> (w0, w1, w2, w3)``: load 16 bytes from shared address addr "
        "(16-byte aligned) as four uint32, w0 at addr.")

ld_shared_v4_f32 = instruction(
    "ld_shared_v4_f32", "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
    outs=("f32", "f32", "f32", "f32"), ins=("u32",), **_MEM, twin=_ld_shared_v4_f32_twin,
    doc="``ld_shared_v4_f32(addr) -> (x0, x1, x2, x3)``: load four float32 from shared address "
        "addr (16-byte aligned).")

ld_global_v4_b32 = instruction(
    "ld_global_v4_b32", "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
    outs=("u32", "u32", "u32", "u32"), ins=("u64",), **_MEM, twin=_ld_global_v4_b32_twin,
    doc="``ld_global_v4_b32(gaddr) -> (w0, w1, w2, w3)``: load 16 bytes from global address "
        "gaddr (16-byte aligned) as four uint32, w0 at gaddr.")

st_global_v4_b32 = instruction(
    "st_global_v4_b32", "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
    ins=("u64", "u32", "u32", "u32", "u32"), **_MEM, twin=_st_global_v4_b32_twin,
    doc="``st_global_v4_b32(gaddr, w0, w1, w2, w3)``: store 16 bytes at global address gaddr "
        "(16-byte aligned), w0 first.")

st_global_v4_f32 = instruction(
    "st_global_v4_f32", "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
    ins=("u64", "f32", "f32", "f32", "f32"), **_MEM, twin=_st_global_v4_f32_twin,
    doc="``st_global_v4_f32(gaddr, x0, x1, x2, x3)``: store four float32 at global address "
        "gaddr (16-byte aligned), x0 first.")

__all__ = ["ld_global_v4_b32", "ld_shared_f32", "ld_shared_v2_f32", "ld_shared_v4_b32",
           "ld_shared_v4_f32", "st_global_v4_b32", "st_global_v4_f32", "st_shared_b32",
           "st_shared_v2_f32", "st_shared_v4_b32"]
