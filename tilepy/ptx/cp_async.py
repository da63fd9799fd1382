"""Asynchronous global → shared copies (``cp.async``, sm_80+) and their group waits.

Per thread, not per warp: each thread issues its own copies, commits them into groups, and
waits for groups. A copy writes shared memory only once it has *completed*, and it is known to
have completed only after a wait that covers its group (and, for other threads to see it, a
``syncthreads`` after that wait).

* ``cp_async_ca_4(dst, src, src_size)``, ``cp_async_ca_8(…)``, ``cp_async_ca_16(…)`` —
  ``cp.async.ca.shared.global [dst], [src], N, src_size;`` (cached at all levels);
* ``cp_async_cg_16(dst, src, src_size)`` — ``cp.async.cg.shared.global … 16 …`` (L2 only,
  bypasses L1; 16 bytes only).

  ``dst``: uint32 shared address (:func:`tilepy.ptx.address.shared_addr`), N-byte aligned;
  ``src``: uint64 global address (:func:`tilepy.ptx.address.global_addr`), N-byte aligned;
  ``src_size``: 0 … N — that many bytes are read from ``src`` and the rest of the N
  destination bytes are filled with zeros. ``src_size = 0`` reads nothing and writes N zeros:
  that is how the edge of a tile is predicated (``src`` may then point anywhere).

* ``cp_async_commit_group()`` — close the thread's not-yet-committed copies into a group (an
  empty group if there are none);
* ``cp_async_wait_group(N)`` — wait until at most ``N`` of the thread's committed groups are
  still pending (all but the newest ``N`` have completed). ``N`` must be a compile-time
  integer literal (a literal or a global / closure constant);
* ``cp_async_wait_all()`` — commit, then wait for every group (``wait_group 0``);
* ``cp_async_mbarrier_arrive_noinc(bar)`` — an arrival on the mbarrier at shared address
  ``bar`` once every cp.async this thread issued before it has completed (``.noinc``: the
  arrival is one of the phase's expected ones, so a barrier that ``n`` copying threads
  signal is initialised with count ``n``). Waiters of the phase then see the copies: the
  producer side of a pipeline whose loads are cp.async (:func:`tilepy.tile.pipeline.
  tma_pipeline` with ``producers``).

In the simulator the twins are faithful, not eager: a copy is recorded at issue (its addresses
are checked then, with a Python error for a misaligned or out-of-range address or a bad
``src_size``) and performed — read from global, written to shared — only by the wait that
completes its group. A kernel that reads the destination before waiting sees the old contents,
as it may on hardware. Copies that are never waited for are dropped at the end of the thread.
"""

from __future__ import annotations

import threading

from . import address
from .asm import SIMULATOR, call_asm, instruction, pick, require_cc

_MIN_CC = (8, 0)


# ---- simulator state --------------------------------------------------------------------------

class _Copy:
    __slots__ = ("dst", "src", "size", "src_size")

    def __init__(self, dst, src, size, src_size):
        self.dst, self.src, self.size, self.src_size = dst, src, size, src_size

    def perform(self):
        data = address.read_bytes(self.src, self.src_size) if self.src_size else b""
        address.write_bytes(self.dst, data + bytes(self.size - self.src_size))


def _state():
    """(uncommitted copies, committed groups oldest first) of the calling simulated thread."""
    t = threading.current_thread()
    st = getattr(t, "_tilepy_cp_async", None)
    if st is None:
        if not hasattr(t, "thread_id"):
            raise RuntimeError("tilepy.ptx cp.async twins must be called from inside a "
                               "simulated CUDA kernel")
        st = ([], [])
        t._tilepy_cp_async = st
    return st


def pending_groups() -> int:
    """Simulator only: how many committed groups of the calling thread have not completed."""
    return len(_state()[1])


def _check(space, who, addr, nbytes, align):
    address.check_range(space, who, addr, nbytes, align)


def _make_copy_twin(name, size):
    def twin(dst, src, src_size):
        dst, src, src_size = int(dst), int(src), int(src_size)
        if not 0 <= src_size <= size:
            raise ValueError(f"{name}: src_size is {src_size}; it must be 0 … {size}")
        _check("shared", f"{name} destination", dst, size, size)
        if src_size:
            _check("global", f"{name} source", src, src_size, size)
        _state()[0].append(_Copy(dst, src, size, src_size))

    twin.__name__ = name + "_twin"
    return twin


def _commit_twin():
    pending, groups = _state()
    groups.append(list(pending))
    pending.clear()


def _wait_group_twin(n):
    n = int(n)
    if n < 0:
        raise ValueError(f"cp_async_wait_group: N is {n}; it must be >= 0")
    groups = _state()[1]
    while len(groups) > n:
        for copy in groups.pop(0):
            copy.perform()


def _wait_all_twin():
    _commit_twin()
    _wait_group_twin(0)


def _mbarrier_arrive_twin(bar):
    # eager: the thread's copies complete now (allowed: completion is only bounded above),
    # then the arrival
    from . import mbarrier

    pending, groups = _state()
    for group in groups:
        for copy in group:
            copy.perform()
    for copy in pending:
        copy.perform()
    groups.clear()
    pending.clear()
    mbarrier.arrive_twin("cp_async_mbarrier_arrive_noinc", bar)


_commit_twin.__name__ = "cp_async_commit_group_twin"
_wait_all_twin.__name__ = "cp_async_wait_all_twin"
_wait_group_twin.__name__ = "cp_async_wait_group_twin"


# ---- declarations -----------------------------------------------------------------------------

def _declare_copy(level, size):
    name = f"cp_async_{level}_{size}"
    doc = (f"``{name}(dst_shared_u32, src_global_u64, src_size)``: start copying {size} bytes "
           f"global → shared ({'L2 only' if level == 'cg' else 'cached at all levels'}); "
           f"src_size (0 … {size}) bytes are read, the rest zero-filled. Completes at a "
           "cp_async_wait_group / wait_all covering its group. Both addresses "
           f"{size}-byte aligned. sm_80+. See tilepy.ptx.cp_async.")
    return instruction(
        name, f"cp.async.{level}.shared.global [$0], [$1], {size}, $2;",
        outs=(), ins=("u32", "u64", "u32"),
        side_effect=True, clobber_memory=True, min_cc=_MIN_CC,
        twin=_make_copy_twin(name, size), doc=doc)


cp_async_ca_4 = _declare_copy("ca", 4)
cp_async_ca_8 = _declare_copy("ca", 8)
cp_async_ca_16 = _declare_copy("ca", 16)
cp_async_cg_16 = _declare_copy("cg", 16)

cp_async_commit_group = instruction(
    "cp_async_commit_group", "cp.async.commit_group;",
    side_effect=True, clobber_memory=True, min_cc=_MIN_CC, twin=_commit_twin,
    doc="``cp_async_commit_group()``: close this thread's uncommitted cp.async copies into a "
        "group (an empty group if there are none). sm_80+.")

cp_async_wait_all = instruction(
    "cp_async_wait_all", "cp.async.wait_all;",
    side_effect=True, clobber_memory=True, min_cc=_MIN_CC, twin=_wait_all_twin,
    doc="``cp_async_wait_all()``: commit, then wait until every cp.async copy of this thread "
        "has completed (= commit_group + wait_group 0). sm_80+.")

cp_async_mbarrier_arrive_noinc = instruction(
    "cp_async_mbarrier_arrive_noinc", "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
    ins=("u32",), side_effect=True, clobber_memory=True, min_cc=_MIN_CC,
    twin=_mbarrier_arrive_twin,
    doc="``cp_async_mbarrier_arrive_noinc(bar)``: arrive on the mbarrier at shared address "
        "``bar`` once all of this thread's earlier cp.async copies have completed; the "
        "arrival counts against the phase's expected arrivals (init the barrier with the "
        "number of copying threads). sm_80+.")


def _make_wait_group_intrinsic():
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    @intrinsic
    def cp_async_wait_group(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            raise TypingError(
                f"tilepy.ptx: cp_async_wait_group(N) needs N to be a compile-time integer "
                f"literal (a literal or a global / closure int constant), got {n}")
        value = n.literal_value
        if value < 0:
            raise TypingError(f"tilepy.ptx: cp_async_wait_group(N) needs N >= 0, got {value}")

        def codegen(context, builder, signature, llargs):
            require_cc("cp_async_wait_group", _MIN_CC)
            call_asm(builder, f"cp.async.wait_group {value};", "~{memory}", (), (), (),
                     side_effect=True)
            return context.get_dummy_value()

        return types.void(n), codegen

    return cp_async_wait_group


_WAIT_GROUP_DOC = (
    "``cp_async_wait_group(N)``: wait until at most N of this thread's committed cp.async "
    "groups are pending (all but the newest N have completed). N must be a compile-time "
    "integer literal. sm_80+.")

cp_async_wait_group = pick(None if SIMULATOR else _make_wait_group_intrinsic(),
                           _wait_group_twin)
try:
    cp_async_wait_group.__doc__ = _WAIT_GROUP_DOC
except AttributeError:  # pragma: no cover
    pass

COPIES = {f.spec.name: f for f in (cp_async_ca_4, cp_async_ca_8, cp_async_ca_16,
                                   cp_async_cg_16)}

__all__ = [*COPIES, "cp_async_commit_group", "cp_async_wait_group", "cp_async_wait_all",
           "cp_async_mbarrier_arrive_noinc"]


# ---- offline probe (tilepy.ptx.probes) for the hand-written cp_async_wait_group ---------------

def _register_probes():
    from . import probes

    def argtypes():
        from numba import types

        return (types.uint32[:],)

    def probe_cp_async_wait_group(u32s):
        cp_async_wait_group(1)
        u32s[0] = u32s[1]

    probes.EXTRA["cp_async_wait_group"] = (probe_cp_async_wait_group, argtypes,
                                           "cp.async.wait_group", _MIN_CC)


_register_probes()
