"""Shared-memory barriers with transaction counts (``mbarrier``): how TMA says a copy landed.

An mbarrier is 8 bytes of shared memory (8-byte aligned) that counts down, per *phase*, a number
of expected arrivals and a signed count of expected transaction bytes. A phase completes when
both reach zero; the barrier then starts the next phase with the arrival count it was
initialised with. Threads wait for a phase by its parity (0, 1, 0, 1, …: the phase number
modulo 2), so a pipeline keeps one parity bit per barrier and flips it after each wait.

All addresses are uint32 shared addresses (:func:`tilepy.ptx.address.shared_addr`). Per thread:

* ``mbarrier_init(bar, count)`` — one thread, before any other use; then
  ``fence_mbarrier_init()`` (sm_90, makes the init visible to the async proxy / the cluster)
  and a ``syncthreads``. ``count`` 1 … 2**20 - 1 arrivals per phase.
* ``mbarrier_arrive(bar)`` — one arrival.
* ``mbarrier_arrive_expect_tx(bar, nbytes)`` — raise the phase's expected transaction bytes by
  ``nbytes`` and arrive, atomically (sm_90): the producer's call before (or after) it issues
  the TMA copies that will complete ``nbytes``.
* ``mbarrier_expect_tx(bar, nbytes)`` — only raise the expected bytes (sm_90).
* ``mbarrier_try_wait_parity(bar, parity) -> uint32`` — 1 if the phase with that parity has
  completed (the barrier's current phase has the other parity), else 0 (sm_90; the hardware may
  wait a while before answering 0).
* ``mbarrier_wait_parity(bar, parity)`` — spin on ``try_wait`` until that phase completed
  (sm_90). Waits have acquire semantics: data the phase's copies wrote is visible after it.
* ``mbarrier_inval(bar)`` — before the 8 bytes are used for anything else.

In the simulator the twins keep each barrier's state per block (keyed by its address), check the
address (inside a shared array whose address the kernel took, 8-byte aligned), refuse an
uninitialised barrier and more arrivals than a phase expects, and block in
``mbarrier_wait_parity`` on a condition variable. A wait that does not complete within
``tilepy.ptx._sim.WAIT_TIMEOUT`` seconds raises (a deadlock on the GPU). TMA twins complete
transaction bytes through :func:`complete_tx`.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from . import _sim, _simcluster, address
from .asm import SIMULATOR, call_asm, instruction, pick, require_cc

_TX_LIMIT = 2**20 - 1


# ---- simulator state -----------------------------------------------------------------------------

class _Barrier:
    __slots__ = ("count", "pending", "phase", "tx")

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def __repr__(self):
        return (f"mbarrier(phase {self.phase}, {self.pending} of {self.count} arrivals "
                f"pending, tx-count {self.tx})")


def _block(t=None):
    return _sim.block_state("mbarriers", lambda m: {"cond": threading.Condition(), "bars": {}},
                            t)


def _get(state, addr, who):
    bar = state["bars"].get(addr)
    if bar is None:
        raise RuntimeError(f"{who}: no initialised mbarrier at shared address {addr:#x} "
                           "(mbarrier_init it first, then syncthreads)")
    return bar


def _advance(state, bar):
    if bar.pending == 0 and bar.tx == 0:
        bar.phase += 1
        bar.pending = bar.count
        state["cond"].notify_all()


def _check_addr(who, addr, t=None):
    addr = int(addr)
    address.check_range("shared", who, addr, 8, 8, t)
    return addr


def _check_tx(who, nbytes):
    nbytes = int(nbytes)
    if not 0 <= nbytes <= _TX_LIMIT:
        raise ValueError(f"{who}: {nbytes} transaction bytes; it must be 0 … {_TX_LIMIT}")
    return nbytes


def _init_twin(bar, count):
    addr = _check_addr("mbarrier_init", bar)
    count = int(count)
    if not 1 <= count <= _TX_LIMIT:
        raise ValueError(f"mbarrier_init: count is {count}; it must be 1 … {_TX_LIMIT}")
    state = _block()
    with state["cond"]:
        state["bars"][addr] = _Barrier(count)


def _arrive(who, bar, tx):
    # a barrier of another block of the cluster (a remote arrival, tilepy.ptx.cluster) lives
    # in that block's state
    owner = _simcluster.owner(int(bar))
    addr = _check_addr(who, bar, owner)
    state = _block(owner)
    with state["cond"]:
        b = _get(state, addr, who)
        if b.pending == 0:
            raise RuntimeError(f"{who}: more arrivals than the {b.count} the phase expects")
        b.tx += tx
        b.pending -= 1
        _advance(state, b)


def _arrive_twin(bar):
    _arrive("mbarrier_arrive", bar, 0)


def arrive_twin(who, bar):
    """Simulator: one arrival on the barrier at ``bar`` on behalf of ``who`` (other modules'
    twins that arrive, such as cp.async's)."""
    _arrive(who, bar, 0)


def _arrive_expect_tx_twin(bar, nbytes):
    _arrive("mbarrier_arrive_expect_tx", bar, _check_tx("mbarrier_arrive_expect_tx", nbytes))


def _expect_tx_twin(bar, nbytes):
    nbytes = _check_tx("mbarrier_expect_tx", nbytes)
    addr = _check_addr("mbarrier_expect_tx", bar)
    state = _block()
    with state["cond"]:
        _get(state, addr, "mbarrier_expect_tx").tx += nbytes


def complete_tx(bar, nbytes, who="complete_tx"):
    """Simulator: ``nbytes`` of transactions on the barrier at ``bar`` completed (TMA twins)."""
    owner = _simcluster.owner(int(bar))
    addr = _check_addr(who, bar, owner)
    state = _block(owner)
    with state["cond"]:
        b = _get(state, addr, who)
        b.tx -= int(nbytes)
        if b.tx < -_TX_LIMIT:
            raise RuntimeError(f"{who}: transaction count of {b!r} out of range")
        _advance(state, b)


def _done(b, parity):
    return (b.phase & 1) != (int(parity) & 1)


def _try_wait_twin(bar, parity):
    addr = _check_addr("mbarrier_try_wait_parity", bar)
    state = _block()
    with state["cond"]:
        return np.uint32(_done(_get(state, addr, "mbarrier_try_wait_parity"), parity))


def _wait_twin(bar, parity):
    who = "mbarrier_wait_parity"
    addr = _check_addr(who, bar)
    state = _block()
    t = _sim.this_thread()
    deadline = time.monotonic() + _sim.WAIT_TIMEOUT
    with state["cond"]:
        while not _done(_get(state, addr, who), parity):
            state["cond"].wait(0.05)
            _sim.check_abort(t, who)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{who}: the phase of parity {int(parity) & 1} did not complete "
                                   f"within {_sim.WAIT_TIMEOUT:.0f} s: "
                                   f"{_get(state, addr, who)!r} (a deadlock on the GPU)")


def _inval_twin(bar):
    addr = _check_addr("mbarrier_inval", bar)
    state = _block()
    with state["cond"]:
        _get(state, addr, "mbarrier_inval")
        del state["bars"][addr]


def phase_of(bar) -> int:
    """Simulator only: the current phase number of the barrier at ``bar``."""
    state = _block()
    with state["cond"]:
        return _get(state, int(bar), "phase_of").phase


for _f, _n in ((_init_twin, "init"), (_arrive_twin, "arrive"),
               (_arrive_expect_tx_twin, "arrive_expect_tx"), (_expect_tx_twin, "expect_tx"),
               (_try_wait_twin, "try_wait_parity"), (_wait_twin, "wait_parity"),
               (_inval_twin, "inval")):
    _f.__name__ = f"mbarrier_{_n}_twin"


# ---- declarations --------------------------------------------------------------------------------

_SM80, _SM90 = (8, 0), (9, 0)

mbarrier_init = instruction(
    "mbarrier_init", "mbarrier.init.shared::cta.b64 [$0], $1;", ins=("u32", "u32"),
    side_effect=True, clobber_memory=True, min_cc=_SM80, twin=_init_twin,
    doc="``mbarrier_init(bar, count)``: initialise the mbarrier at shared address bar (8-byte "
        "aligned) for count arrivals per phase; phase 0 starts. One thread; then "
        "fence_mbarrier_init() and syncthreads. sm_80+.")

mbarrier_arrive = instruction(
    "mbarrier_arrive", "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [$0];\n}",
    ins=("u32",), side_effect=True, clobber_memory=True, min_cc=_SM80, twin=_arrive_twin,
    doc="``mbarrier_arrive(bar)``: one arrival on the current phase (release semantics). sm_80+.")

mbarrier_arrive_expect_tx = instruction(
    "mbarrier_arrive_expect_tx",
    "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n}",
    ins=("u32", "u32"), side_effect=True, clobber_memory=True, min_cc=_SM90,
    twin=_arrive_expect_tx_twin,
    doc="``mbarrier_arrive_expect_tx(bar, nbytes)``: expect nbytes more transaction bytes in the "
        "current phase and arrive, atomically (the TMA producer's call). sm_90+.")

mbarrier_expect_tx = instruction(
    "mbarrier_expect_tx", "mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [$0], $1;",
    ins=("u32", "u32"), side_effect=True, clobber_memory=True, min_cc=_SM90,
    twin=_expect_tx_twin,
    doc="``mbarrier_expect_tx(bar, nbytes)``: expect nbytes more transaction bytes in the "
        "current phase, without arriving. sm_90+.")

mbarrier_try_wait_parity = instruction(
    "mbarrier_try_wait_parity",
    "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\n"
    "selp.u32 $0, 1, 0, p;\n}",
    outs=("u32",), ins=("u32", "u32"), side_effect=True, clobber_memory=True, min_cc=_SM90,
    twin=_try_wait_twin,
    doc="``mbarrier_try_wait_parity(bar, parity) -> uint32``: 1 if the phase of that parity has "
        "completed, else 0 (acquire semantics when 1). sm_90+.")

mbarrier_inval = instruction(
    "mbarrier_inval", "mbarrier.inval.shared::cta.b64 [$0];", ins=("u32",),
    side_effect=True, clobber_memory=True, min_cc=_SM80, twin=_inval_twin,
    doc="``mbarrier_inval(bar)``: invalidate the mbarrier before its 8 bytes are reused. sm_80+.")

def _fence_mbarrier_init_twin():
    """No effect in the simulator: its shared memory has one proxy, and stores are immediate."""


fence_mbarrier_init = instruction(
    "fence_mbarrier_init", "fence.mbarrier_init.release.cluster;",
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_fence_mbarrier_init_twin,
    doc="``fence_mbarrier_init()``: make earlier mbarrier_init visible to the async proxy (TMA) "
        "and the cluster; after the inits, before the syncthreads. sm_90+.")

_WAIT_TEMPLATE = ("{\n.reg .pred p;\nTILEPY_MBAR_WAIT_${:uid}:\n"
                  "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
                  "@!p bra TILEPY_MBAR_WAIT_${:uid};\n}")
_WAIT_OPCODE = "mbarrier.try_wait.parity.shared::cta.b64"


def _make_wait_intrinsic():
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    @intrinsic
    def mbarrier_wait_parity(typingctx, bar, parity):
        for what, ty in (("bar", bar), ("parity", parity)):
            if not isinstance(ty, (types.Integer, types.Boolean)):
                raise TypingError(f"tilepy.ptx: mbarrier_wait_parity: {what} must be an "
                                  f"integer, got {ty}")

        def lower(context, builder, sig, args):
            require_cc("mbarrier_wait_parity", _SM90)
            ops = [context.cast(builder, v, t, types.uint32)
                   for v, t in zip(args, sig.args)]
            call_asm(builder, _WAIT_TEMPLATE, "r,r,~{memory}", (), ("u32", "u32"), ops,
                     side_effect=True)
            return context.get_dummy_value()

        return types.void(bar, parity), lower

    return mbarrier_wait_parity


mbarrier_wait_parity = pick(None if SIMULATOR else _make_wait_intrinsic(), _wait_twin)
try:
    mbarrier_wait_parity.__doc__ = (
        "``mbarrier_wait_parity(bar, parity)``: wait until the phase of that parity has "
        "completed (a try_wait spin loop; acquire semantics). sm_90+.")
except AttributeError:  # pragma: no cover
    pass

__all__ = [
    "complete_tx",
    "fence_mbarrier_init",
    "mbarrier_arrive",
    "mbarrier_arrive_expect_tx",
    "mbarrier_expect_tx",
    "mbarrier_init",
    "mbarrier_inval",
    "mbarrier_try_wait_parity",
    "mbarrier_wait_parity",
]


def _register_probes():
    from . import probes

    def argtypes():
        from numba import types

        return (types.uint32[:],)

    def probe_mbarrier_wait_parity(u32s):
        mbarrier_wait_parity(u32s[0], u32s[1])
        u32s[2] = u32s[3]

    probes.EXTRA["mbarrier_wait_parity"] = (probe_mbarrier_wait_parity, argtypes, _WAIT_OPCODE,
                                            _SM90)


_register_probes()
