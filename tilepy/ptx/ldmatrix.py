"""Warp-wide 8×8 b16 matrix loads and stores between shared memory and registers.

``ldmatrix`` (sm_75+) and ``stmatrix`` (sm_90+) move one, two or four 8×8 matrices of 16-bit
elements (f16, bf16, or any b16) between shared memory and the mma fragment layout. All 32 lanes
of a warp call together (``.sync.aligned``); each passes ONE shared address (from
:func:`tilepy.ptx.address.shared_addr`, plus byte offsets) and gets / gives one uint32 register
per matrix.

Addresses — for ``xN``, lanes ``8i … 8i+7`` give the addresses of rows ``0 … 7`` of
matrix ``i``:

====== ===================== =========================================
 name   lanes whose address   registers per lane
        is used
====== ===================== =========================================
 x1     0 – 7                 1  (matrix 0)
 x2     0 – 15                2  (matrices 0, 1)
 x4     0 – 31                4  (matrices 0, 1, 2, 3)
====== ===================== =========================================

Each row is 16 bytes (8 b16 elements) and its address must be 16-byte aligned; rows need not be
contiguous (the usual swizzled tiles rely on that). The other lanes' addresses are ignored.

Lane table (``g = lane // 4``, ``t = lane % 4``; register ``i`` holds matrix ``i``; the lower
half of a register holds the first element):

* plain:  low half = M[g, 2t],  high half = M[g, 2t+1]  (the 4 bytes at row g, bytes 4t … 4t+3)
* .trans: low half = M[2t, g],  high half = M[2t+1, g]

That is the A / B fragment layout of ``mma.m16n8k16`` (see :mod:`tilepy.ptx.fragments`):
``ldmatrix_x4`` of the four 8×8 quadrants of a 16×16 row-major A tile (top-left, bottom-left,
top-right, bottom-right) gives A's four registers; ``.trans`` loads B from a row-major K×N tile.

``stmatrix`` is the exact inverse: lane l's register i is written where ``ldmatrix`` (same
variant, same addresses) would have read it from.

Names and signatures (all uint32):

* ``ldmatrix_x1(addr) -> r0``,  ``ldmatrix_x2(addr) -> (r0, r1)``,
  ``ldmatrix_x4(addr) -> (r0, r1, r2, r3)``, and ``ldmatrix_x{1,2,4}_trans`` likewise;
* ``stmatrix_x1(addr, r0)``, ``stmatrix_x2(addr, r0, r1)``, ``stmatrix_x4(addr, r0, r1, r2, r3)``,
  and ``stmatrix_x{1,2,4}_trans`` likewise (no result).

Every function carries ``.twin.warp_model``, a pure Python/NumPy model of the whole warp:

* ldmatrix: ``model(addresses, read) -> [regs of lane 0, …, regs of lane 31]`` where
  ``addresses`` is the 32 lanes' addresses and ``read(addr, nbytes) -> bytes`` reads memory;
  each lane's regs is a tuple of ``N`` np.uint32.
* stmatrix: ``model(addresses, regs) -> [(row_address, 16 bytes), …]`` — the ``8N`` row writes,
  matrix by matrix, row by row; ``regs`` is the 32 lanes' register tuples (or plain integers
  for x1).

In the simulator the twins check every used row address with ``address.check_range`` (inside
a shared array whose address the kernel took, 16-byte aligned relative to the array start —
on the GPU the array itself must be declared with ``alignment=16`` or more) and raise the same
error in every lane of the warp, naming the lane that gave the bad address. All 32 lanes of
the warp (and, as for every warp-collective twin, every warp of the block) must make the call.
"""

from __future__ import annotations

import numpy as np

from . import _sim, address
from .asm import instruction

WARP = _sim.WARP
ROW_BYTES = 16


# ---- pure models ------------------------------------------------------------------------------

def _ld_lane(n, trans, addrs, read, lane):
    """The ``n`` registers that ``lane`` receives (tuple of np.uint32)."""
    g, t = divmod(lane, 4)
    regs = []
    for i in range(n):
        if trans:
            # low half: M[2t, g]; high half: M[2t+1, g]  (element (r, c) at row r, byte 2c)
            data = read(int(addrs[8 * i + 2 * t]) + 2 * g, 2) + \
                read(int(addrs[8 * i + 2 * t + 1]) + 2 * g, 2)
        else:
            data = read(int(addrs[8 * i + g]) + 4 * t, 4)  # M[g, 2t], M[g, 2t+1]
        regs.append(np.uint32(int.from_bytes(bytes(data), "little")))
    return tuple(regs)


def _st_row(n, trans, regs, i, r):
    """The 16 bytes of row ``r`` of matrix ``i``, from the 32 lanes' registers ``regs``."""
    if trans:
        # M[r, c] is half (r % 2) of register i of lane 4c + r // 2
        shift = 16 * (r % 2)
        elems = [(int(regs[4 * c + r // 2][i]) >> shift) & 0xFFFF for c in range(8)]
        return b"".join(e.to_bytes(2, "little") for e in elems)
    # M[r, 2t], M[r, 2t+1] are register i of lane 4r + t
    return b"".join((int(regs[4 * r + t][i]) & 0xFFFFFFFF).to_bytes(4, "little")
                    for t in range(4))


def _as_regs(lane_regs):
    return tuple(lane_regs) if isinstance(lane_regs, (tuple, list, np.ndarray)) else (lane_regs,)


def make_ldmatrix_model(n, trans):
    """Pure model of ``ldmatrix.m8n8.x{n}{.trans}.b16`` over one warp (see module docstring)."""

    def model(addresses, read):
        if len(addresses) != WARP:
            raise TypeError(f"ldmatrix x{n} model takes the addresses of 32 lanes")
        return [_ld_lane(n, trans, addresses, read, lane) for lane in range(WARP)]

    model.__name__ = f"ldmatrix_x{n}{'_trans' if trans else ''}_model"
    return model


def make_stmatrix_model(n, trans):
    """Pure model of ``stmatrix.m8n8.x{n}{.trans}.b16``: the list of (row address, 16 bytes)."""

    def model(addresses, regs):
        if len(addresses) != WARP or len(regs) != WARP:
            raise TypeError(f"stmatrix x{n} model takes addresses and registers of 32 lanes")
        regs = [_as_regs(r) for r in regs]
        if any(len(r) != n for r in regs):
            raise TypeError(f"stmatrix x{n} model takes {n} registers per lane")
        return [(int(addresses[8 * i + r]), _st_row(n, trans, regs, i, r))
                for i in range(n) for r in range(8)]

    model.__name__ = f"stmatrix_x{n}{'_trans' if trans else ''}_model"
    return model


# ---- simulator twins --------------------------------------------------------------------------

def _check_own(name, n, lane, addr):
    """Check this lane's row address if the instruction uses it; return the error or None."""
    if lane >= 8 * n:
        return None
    try:
        address.check_range("shared", f"{name} (lane {lane}: row {lane % 8} of matrix "
                            f"{lane // 8})", addr, ROW_BYTES, ROW_BYTES)
    except (IndexError, ValueError) as e:
        return e
    return None


def _raise_first(name, n, lanes):
    """Every lane raises the same error: the first used lane's, or a missing lane's."""
    for ln in range(8 * n):
        if lanes[ln] is None:
            raise RuntimeError(f"{name}: lane {ln} of the warp did not take part; all 32 lanes "
                               "must call a .sync.aligned instruction together")
        err = lanes[ln][-1]
        if err is not None:
            raise type(err)(str(err))


def _make_ld_twin(name, n, trans):
    model = make_ldmatrix_model(n, trans)

    def twin(addr):
        lane = _sim.lane_id()
        addr = int(addr)
        lanes = _sim.warp_exchange((addr, _check_own(name, n, lane, addr)))
        _raise_first(name, n, lanes)
        addrs = [v[0] if v is not None else 0 for v in lanes]
        regs = _ld_lane(n, trans, addrs, address.read_bytes, lane)
        return regs[0] if n == 1 else regs

    twin.__name__ = name + "_twin"
    twin.warp_model = model
    return twin


def _make_st_twin(name, n, trans):
    model = make_stmatrix_model(n, trans)

    def twin(addr, *regs):
        if len(regs) != n:
            raise TypeError(f"{name}(addr, {n} registers) got {len(regs)} registers")
        lane = _sim.lane_id()
        addr = int(addr)
        regs = tuple(int(r) & 0xFFFFFFFF for r in regs)
        lanes = _sim.warp_exchange((addr, regs, _check_own(name, n, lane, addr)))
        _raise_first(name, n, lanes)
        if any(v is None for v in lanes):
            missing = [ln for ln, v in enumerate(lanes) if v is None]
            raise RuntimeError(f"{name}: lanes {missing} of the warp did not take part; all 32 "
                               "lanes must call a .sync.aligned instruction together")
        if lane < 8 * n:  # the lane that named a row writes it
            i, r = divmod(lane, 8)
            address.write_bytes(addr, _st_row(n, trans, [v[1] for v in lanes], i, r))

    twin.__name__ = name + "_twin"
    twin.warp_model = model
    return twin


# ---- declarations -----------------------------------------------------------------------------

def _regs(first, n):
    return ",".join(f"${first + i}" for i in range(n))


def _declare_ld(n, trans):
    sfx = ".trans" if trans else ""
    name = f"ldmatrix_x{n}{'_trans' if trans else ''}"
    regs = ", ".join(f"r{i}" for i in range(n))
    ret = regs if n == 1 else f"({regs})"
    doc = (f"``{name}(addr) -> {ret}``: load {n} 8×8 b16 matri{'x' if n == 1 else 'ces'} "
           f"from shared memory{' transposed' if trans else ''}, one warp.\n\n"
           f"Lanes 0–{8 * n - 1} give the 16-byte-aligned shared address of row (lane % 8) of "
           "matrix (lane // 8); register i of lane l (g = l // 4, t = l % 4) holds "
           + ("M_i[2t, g] (low half) and M_i[2t+1, g] (high half)." if trans else
              "M_i[g, 2t] (low half) and M_i[g, 2t+1] (high half).")
           + " See tilepy.ptx.ldmatrix.")
    return instruction(
        name,
        f"ldmatrix.sync.aligned.m8n8.x{n}{sfx}.shared.b16 {{{_regs(0, n)}}}, [${n}];",
        outs=("u32",) * n, ins=("u32",),
        side_effect=True, convergent=True, min_cc=(7, 5),
        twin=_make_ld_twin(name, n, trans), doc=doc)


def _declare_st(n, trans):
    sfx = ".trans" if trans else ""
    name = f"stmatrix_x{n}{'_trans' if trans else ''}"
    regs = ", ".join(f"r{i}" for i in range(n))
    doc = (f"``{name}(addr, {regs})``: store {n} 8×8 b16 matri{'x' if n == 1 else 'ces'} "
           f"to shared memory{' transposed' if trans else ''}, one warp (sm_90+).\n\n"
           f"Lanes 0–{8 * n - 1} give the 16-byte-aligned shared address of row (lane % 8) of "
           "matrix (lane // 8); register i of lane l (g = l // 4, t = l % 4) is written to "
           + ("M_i[2t, g] (low half) and M_i[2t+1, g] (high half)." if trans else
              "M_i[g, 2t] (low half) and M_i[g, 2t+1] (high half).")
           + " The inverse of the matching ldmatrix. See tilepy.ptx.ldmatrix.")
    return instruction(
        name,
        f"stmatrix.sync.aligned.m8n8.x{n}{sfx}.shared.b16 [$0], {{{_regs(1, n)}}};",
        outs=(), ins=("u32",) * (n + 1),
        side_effect=True, clobber_memory=True, convergent=True, min_cc=(9, 0),
        twin=_make_st_twin(name, n, trans), doc=doc)


ldmatrix_x1 = _declare_ld(1, False)
ldmatrix_x2 = _declare_ld(2, False)
ldmatrix_x4 = _declare_ld(4, False)
ldmatrix_x1_trans = _declare_ld(1, True)
ldmatrix_x2_trans = _declare_ld(2, True)
ldmatrix_x4_trans = _declare_ld(4, True)

stmatrix_x1 = _declare_st(1, False)
stmatrix_x2 = _declare_st(2, False)
stmatrix_x4 = _declare_st(4, False)
stmatrix_x1_trans = _declare_st(1, True)
stmatrix_x2_trans = _declare_st(2, True)
stmatrix_x4_trans = _declare_st(4, True)

LDMATRIX = {f.spec.name: f for f in (ldmatrix_x1, ldmatrix_x2, ldmatrix_x4, ldmatrix_x1_trans,
                                     ldmatrix_x2_trans, ldmatrix_x4_trans)}
STMATRIX = {f.spec.name: f for f in (stmatrix_x1, stmatrix_x2, stmatrix_x4, stmatrix_x1_trans,
                                     stmatrix_x2_trans, stmatrix_x4_trans)}
ALL = {**LDMATRIX, **STMATRIX}

__all__ = [*ALL, "make_ldmatrix_model", "make_stmatrix_model"]
