"""Warpgroup MMA (``wgmma``, sm_90a): one warpgroup (4 warps, 128 threads) computes D = A·B + D.

``wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}`` multiplies a 64×16 A by a 16×N B and
accumulates into a 64×N float32 tile spread over the warpgroup's registers (N/2 floats per
thread). B always comes from shared memory through a 64-bit *matrix descriptor*; A comes from
shared memory (a descriptor, the ``ss`` form) or from registers (four uint32 per thread, the
``rs`` form). The instruction is asynchronous: a batch of them is issued between
``wgmma_fence()`` and ``wgmma_commit_group()``, and its results may be read only after
``wgmma_wait_group(N)`` has retired the group.

Every call is made by all 128 threads of a warpgroup together (``.sync.aligned``); the
descriptors and ``scale_d`` must be the same in every thread. A warpgroup is four consecutive
warps starting at a warp index divisible by four.

The pieces, in the order a kernel uses them:

* ``fence_proxy_async_shared()`` — in every thread that stored (``st.shared``) data a wgmma
  (or TMA store) will read, after its stores and before the ``syncthreads`` that the wgmmas
  follow: makes generic-proxy writes visible to the async proxy. Not needed for data that TMA
  wrote.
* ``matrix_descriptor(addr, lbo, sbo, swizzle)`` — the descriptor of an operand tile starting at
  shared address ``addr`` (:func:`tilepy.ptx.address.shared_addr`); ``lbo`` / ``sbo`` in bytes,
  ``swizzle`` a compile-time literal in bytes (0, 32, 64, 128). Base offset 0.
  ``descriptor_advance(desc, nbytes)`` moves its start address (the k16 steps inside a swizzle
  atom are +32 bytes; a 32-bit add on the low word, so the result stays inside shared memory's
  256 KB window). :func:`encode_descriptor` / :func:`decode_descriptor` are the same
  encoding in plain Python.
* ``wgmma_fence()`` — before the first wgmma, and whenever the accumulator (or A-fragment)
  registers were touched by other instructions since the last wgmma.
* ``wgmma(N, "e4m3" | "e5m2", b_type=...)`` — the 8-bit forms, m64nNk32 (both operands K-major,
  A from shared memory or registers, f32 accumulators; FP8 GEMMs and attention).
* ``wgmma_m64n{N}k16_f32_{f16,bf16}(acc, desc_a, desc_b, scale_d)`` — ``acc`` is a
  ``cuda.local.array(N // 2, float32)`` (updated in place; keep every index a constant so it
  stays in registers), ``scale_d`` a run-time integer: 0 → D = A·B, otherwise D = A·B + D.
  ``..._rs(acc, a0, a1, a2, a3, desc_b, scale_d)`` takes A from registers (write them before
  the ``wgmma_fence()``, like the accumulators).
  :func:`wgmma` builds any other variant (N = 8 … 256 in steps of 8, MN-major operands).
* ``wgmma_commit_group()`` / ``wgmma_wait_group(N)`` — close the batch; wait until at most N
  batches are pending (N a compile-time literal). ``wgmma_wait_after_store(addr, x, y)`` is
  ``wait_group 0`` behind a shared store of ``x``, ``y`` that keeps ptxas from hoisting it
  above the work meant to overlap the wgmmas in flight.
* ``wgmma_fence_operand(acc, count)`` — an empty asm statement tying ``acc[0:count]`` to this
  point of the program, so that the compiler cannot move their uses across the wait (CUTLASS's
  ``warpgroup_fence_operand``); call it after ``wgmma_wait_group`` and before reading ``acc``.

Layouts — the accumulator and A-fragment register maps, the canonical shared-memory layouts
per swizzle, and the swizzle itself — are in :mod:`tilepy.ptx.wgmma_layout` (plain Python,
re-exported here). A TMA box with the matching swizzle is a valid operand. The swizzle acts on
the *address*, so a swizzled operand tile must sit where the pattern repeats: at multiples of
256 / 512 / 1024 bytes (32 / 64 / 128B) of a 1024-byte-aligned shared buffer
(``alignment=1024`` on the GPU).

Simulator: the twins compute the warpgroup's whole tile when the instruction is issued (the
GPU may compute it any time before the wait), reading the shared-memory bytes that the
descriptors address with the swizzle applied. Each shared array is treated as if it started on
a 1024-byte boundary; descriptors hold addresses in a per-block simulated shared window.
A non-zero descriptor base offset is refused there (its hardware meaning is not modelled).
The simulator does not check the fence discipline beyond "a wgmma_fence before the first
wgmma of the thread", nor that the accumulators are left alone until the wait.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from . import _sim, address
from .asm import SIMULATOR, UnsupportedTarget, call_asm, current_cc, instruction, pick
from .wgmma_layout import (  # noqa: F401  (re-exported)
    _MODE,
    TYPES_8,
    k_of,
    SWIZZLES,
    WARPGROUP,
    Descriptor,
    K,
    a_fragment_position,
    accumulator_position,
    canonical_offset,
    decode_descriptor,
    encode_descriptor,
    make_warpgroup_model,
    operand_addresses,
    swizzle,
)

# ---- simulator: the shared window that descriptors address ------------------------------------

_window_lock = threading.Lock()
_WINDOW_ALIGN = 1024
_WINDOW_LIMIT = 1 << 18


def _window():
    return _sim.block_state("shared_window", lambda m: {"arrays": [], "next": _WINDOW_ALIGN})


def window_address(host_addr: int) -> int:
    """Simulator: the simulated shared-window address of a host address that ``shared_addr``
    returned. Each shared array gets a 1024-byte-aligned place in the window."""
    host_addr = int(host_addr)
    extents = address._block_extents()["shared"]
    with address._extent_lock:
        ranges = list(extents.items())
    win = _window()
    with _window_lock:
        for lo, hi, wlo in win["arrays"]:
            if lo <= host_addr < hi:
                return wlo + host_addr - lo
        for lo, hi in ranges:
            if lo <= host_addr < hi:
                wlo = win["next"]
                end = wlo + hi - lo
                if end > _WINDOW_LIMIT:
                    raise MemoryError("the simulated shared window (256 KB) is full")
                win["next"] = -(-end // _WINDOW_ALIGN) * _WINDOW_ALIGN
                win["arrays"].append((lo, hi, wlo))
                return wlo + host_addr - lo
    raise IndexError(f"shared address {host_addr:#x} lies outside every shared array whose "
                     "address this kernel took (shared_addr)")


def host_view(window_addr: int, what: str):
    """Simulator: (uint8 view of the shared array holding ``window_addr``, its window start)."""
    with _window_lock:
        arrays = list(_window()["arrays"])
    for lo, hi, wlo in arrays:
        if wlo <= window_addr < wlo + hi - lo:
            buf = (ctypes.c_uint8 * (hi - lo)).from_address(lo)
            return np.ctypeslib.as_array(buf), wlo
    raise IndexError(f"{what}: shared address {window_addr:#x} (simulated window) lies outside "
                     "every shared array a descriptor was made for")


def _fetch(what, elem_bytes: int = 2):
    """The twins' reader: the elements (uint16, or uint8 for ``elem_bytes`` 1) at an array
    of simulated shared addresses, all in the shared array of the first one."""
    def fetch(addrs):
        addrs = np.asarray(addrs, dtype=np.int64)
        view, wlo = host_view(int(addrs.flat[0]), what)
        off = addrs - wlo
        if off.min() < 0 or off.max() + elem_bytes > view.size:
            bad = int(addrs.flat[int(np.argmax((off < 0) | (off + elem_bytes > view.size)))])
            raise IndexError(f"{what}: element at shared address {bad:#x} lies outside the "
                             f"shared array of the descriptor's start ({view.size} bytes)")
        if elem_bytes == 1:
            return view[off]
        if (off % 2).any():
            raise ValueError(f"{what}: odd element address")
        return view[off] | (view[off + 1].astype(np.uint16) << np.uint16(8))
    return fetch


# ---- simulator: per-thread bookkeeping of fences and groups ------------------------------------

def _state():
    t = _sim.this_thread()
    st = getattr(t, "_tilepy_wgmma", None)
    if st is None:
        st = {"fenced": False, "uncommitted": 0, "groups": []}
        t._tilepy_wgmma = st
    return st


def _fence_twin():
    _state()["fenced"] = True


def _commit_twin():
    st = _state()
    st["groups"].append(st["uncommitted"])
    st["uncommitted"] = 0


def _wait_group_twin(n):
    n = int(n)
    if n < 0:
        raise ValueError(f"wgmma_wait_group: N is {n}; it must be >= 0")
    groups = _state()["groups"]
    del groups[:max(0, len(groups) - n)]


def pending_groups() -> int:
    """Simulator only: committed wgmma groups of the calling thread not yet waited for."""
    return len(_state()["groups"])


_fence_twin.__name__ = "wgmma_fence_twin"
_commit_twin.__name__ = "wgmma_commit_group_twin"
_wait_group_twin.__name__ = "wgmma_wait_group_twin"


def _as_acc(acc, name, nacc):
    arr = address._ndarray(acc) if not isinstance(acc, np.ndarray) else acc
    if arr.dtype != np.float32 or arr.ndim != 1 or arr.size < nacc:
        raise TypeError(f"{name}: the accumulator must be a 1-D float32 array of at least "
                        f"{nacc} elements, got {arr.dtype} {arr.shape}")
    return arr


def _make_twin(name, n, model, rs, elem_bytes=2):
    nacc = n // 2
    fetch = _fetch(name, elem_bytes)

    def run(acc, a_regs, desc_a, desc_b, scale_d):
        st = _state()
        if not st["fenced"]:
            raise RuntimeError(f"{name}: no wgmma_fence() before the first wgmma of this thread")
        arr = _as_acc(acc, name, nacc)
        value = (tuple(float(x) for x in arr[:nacc]), a_regs, int(desc_a), int(desc_b),
                 int(bool(scale_d)))
        out = _sim.warpgroup_collective(value, lambda threads: model(threads, fetch), name)
        arr[:nacc] = out
        st["uncommitted"] += 1

    if rs:
        def twin(acc, a0, a1, a2, a3, desc_b, scale_d):
            regs = tuple(int(r) & 0xFFFFFFFF for r in (a0, a1, a2, a3))
            run(acc, regs, 0, desc_b, scale_d)
    else:
        def twin(acc, desc_a, desc_b, scale_d):
            run(acc, None, desc_a, desc_b, scale_d)

    twin.__name__ = name + "_twin"
    twin.warpgroup_model = model
    return twin


# ---- GPU: intrinsics -----------------------------------------------------------------------------

def require_sm90a(name: str) -> None:
    """Inside codegen: refuse a target other than compute capability 9.0 (wgmma is sm_90a only)."""
    cc = current_cc()
    if cc is not None and tuple(cc) != (9, 0):
        raise UnsupportedTarget(
            f"{name} needs compute capability 9.0 (sm_90a, the arch-specific target); this "
            f"kernel is being compiled for {cc[0]}.{cc[1]}")


def _literal(name, arg, what, ok=None):
    from numba import types
    from numba.core.errors import TypingError

    if not isinstance(arg, types.IntegerLiteral):
        raise TypingError(f"tilepy.ptx: {name} needs {what} to be a compile-time integer literal "
                          f"(a literal or a global / closure int constant), got {arg}")
    value = arg.literal_value
    if ok is not None and not ok(value):
        raise TypingError(f"tilepy.ptx: {name}: {what} = {value} is not allowed")
    return value


def _check_acc_type(name, acc):
    from numba import types
    from numba.core.errors import TypingError

    if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1
            and acc.layout == "C"):
        raise TypingError(f"tilepy.ptx: {name}: the accumulator must be a 1-D contiguous float32 "
                          f"array (cuda.local.array(N // 2, float32)), got {acc}")


def _check_ints(name, what, *tys):
    from numba import types
    from numba.core.errors import TypingError

    for w, t in zip(what, tys):
        if not isinstance(t, (types.Integer, types.Boolean)):
            raise TypingError(f"tilepy.ptx: {name}: {w} must be an integer, got {t}")


def _acc_pointers(context, builder, aryty, ary_val, count):
    from numba.core import cgutils

    ary = context.make_array(aryty)(context, builder, ary_val)
    return [cgutils.gep_inbounds(builder, ary.data, i) for i in range(count)]


def _wgmma_template(n, ab, rs, trans_a, trans_b, b_type=None):
    nacc = n // 2
    bt = ab if b_type is None else b_type
    k = k_of(ab)
    d = ", ".join(f"${i}" for i in range(nacc))
    if rs:
        a = "{" + ", ".join(f"${nacc + i}" for i in range(4)) + "}"
        b, sd = f"${nacc + 4}", f"${nacc + 5}"
        tail = f"p, 1, 1, {int(trans_b)}"
    else:
        a, b, sd = f"${nacc}", f"${nacc + 1}", f"${nacc + 2}"
        tail = f"p, 1, 1, {int(trans_a)}, {int(trans_b)}"
    if ab in TYPES_8:
        tail = "p, 1, 1"        # 8-bit types: K-major only, no transpose operands
    return ("{\n.reg .pred p;\n"
            f"setp.ne.b32 p, {sd}, 0;\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{bt} {{{d}}}, {a}, {b}, {tail};\n"
            "}")


def _make_wgmma_intrinsic(name, n, ab, rs, trans_a, trans_b, b_type=None):
    from numba import types
    from numba.core.extending import intrinsic

    nacc = n // 2
    template = _wgmma_template(n, ab, rs, trans_a, trans_b, b_type)
    in_kinds = (("u32",) * 4 if rs else ("u64",)) + ("u64", "u32") + ("f32",) * nacc
    constraints = ",".join(["=f"] * nacc + ["r"] * (4 if rs else 0)
                           + ["l"] * (1 if rs else 2) + ["r"]
                           + [str(i) for i in range(nacc)] + ["~{memory}"])
    out_kinds = ("f32",) * nacc

    def lower(context, builder, sig, args):
        require_sm90a(name)
        ptrs = _acc_pointers(context, builder, sig.args[0], args[0], nacc)
        targets = ([types.uint32] * 4 if rs else [types.uint64]) + [types.uint64, types.uint32]
        ops = [context.cast(builder, v, t, to)
               for v, t, to in zip(args[1:], sig.args[1:], targets)]
        vals = [builder.load(p) for p in ptrs]
        outs = call_asm(builder, template, constraints, out_kinds, in_kinds, ops + vals,
                        side_effect=True, convergent=True)
        for p, v in zip(ptrs, outs):
            builder.store(v, p)
        return context.get_dummy_value()

    if rs:
        def typer(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
            _check_acc_type(name, acc)
            _check_ints(name, ("a0", "a1", "a2", "a3", "desc_b", "scale_d"),
                        a0, a1, a2, a3, desc_b, scale_d)
            return types.void(acc, a0, a1, a2, a3, desc_b, scale_d), lower
    else:
        def typer(typingctx, acc, desc_a, desc_b, scale_d):
            _check_acc_type(name, acc)
            _check_ints(name, ("desc_a", "desc_b", "scale_d"), desc_a, desc_b, scale_d)
            return types.void(acc, desc_a, desc_b, scale_d), lower

    typer.__name__ = name
    return intrinsic(typer)


def _variant_name(n, ab, rs, trans_a, trans_b, b_type=None):
    name = f"wgmma_m64n{n}k{k_of(ab)}_f32_{ab}"
    if b_type is not None and b_type != ab:
        name += f"_{b_type}"
    if rs:
        name += "_rs"
    if trans_a:
        name += "_ta"
    if trans_b:
        name += "_tb"
    return name


@functools.cache
def wgmma(n: int, ab: str = "f16", *, a_in_registers: bool = False, trans_a: bool = False,
          trans_b: bool = False, b_type: str | None = None):
    """``wgmma.mma_async.sync.aligned.m64n{n}k{K}.f32.{ab}.{b_type}`` (cached per variant).

    ``ab``: ``"f16"`` / ``"bf16"`` (K = 16; B the same type), or ``"e4m3"`` / ``"e5m2"``
    (K = 32: 64×32 A and 32×N B of 8-bit floats; ``b_type`` either 8-bit type, default
    ``ab``; both operands K-major — the 8-bit forms have no transpose; A from shared memory
    or, ``a_in_registers``, four registers of four k each,
    :func:`tilepy.ptx.wgmma_layout.a_fragment_position` with ``elem_bytes=1``). ``trans_a`` / ``trans_b``: a 16-bit operand is
    MN-major in shared memory (``imm-trans`` 1) instead of K-major. ``a_in_registers``: the
    rs form (no ``trans_a``). Signatures: ``f(acc, desc_a, desc_b, scale_d)`` and, rs,
    ``f(acc, a0, a1, a2, a3, desc_b, scale_d)``; see the module docstring.
    """
    if a_in_registers and trans_a:
        raise ValueError("wgmma with A in registers has no trans_a")
    bt = ab if b_type is None else b_type
    name = _variant_name(n, ab, a_in_registers, trans_a, trans_b, b_type)
    model = make_warpgroup_model(n, ab, a_in_registers, trans_a, trans_b, bt)
    twin = _make_twin(name, n, model, a_in_registers, 1 if ab in TYPES_8 else 2)
    fn = pick(None if SIMULATOR else _make_wgmma_intrinsic(name, n, ab, a_in_registers,
                                                           trans_a, trans_b, b_type), twin)
    k = k_of(ab)
    try:
        fn.opcode = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{bt}"
        fn.variant = {"n": n, "ab": ab, "a_in_registers": a_in_registers, "trans_a": trans_a,
                      "trans_b": trans_b, "b_type": bt}
        fn.__doc__ = (f"``{name}``: D[64×{n}] f32 (+)= A[64×{k}] {ab} · B[{k}×{n}] {bt}, one "
                      f"warpgroup; {'A from registers, ' if a_in_registers else ''}"
                      f"A {'MN' if trans_a else 'K'}-major, B {'MN' if trans_b else 'K'}-major. "
                      "See tilepy.ptx.wgmma.")
    except AttributeError:  # pragma: no cover
        pass
    return fn


# ---- fences, groups, descriptors, operand fences, setmaxnreg -------------------------------------

def _make_simple(name, template, min_literal=None):
    """An intrinsic with no operands, or one compile-time literal formatted into ``template``."""
    from numba import types
    from numba.core.extending import intrinsic

    if min_literal is None:
        @intrinsic
        def fn(typingctx):
            def lower(context, builder, sig, args):
                require_sm90a(name)
                call_asm(builder, template, "~{memory}", (), (), (), side_effect=True,
                         convergent=True)
                return context.get_dummy_value()
            return types.void(), lower
        return fn

    @intrinsic
    def fn_lit(typingctx, n):
        value = _literal(name, n, "N", min_literal)

        def lower(context, builder, sig, args):
            require_sm90a(name)
            call_asm(builder, template.format(value), "~{memory}", (), (), (), side_effect=True,
                     convergent=True)
            return context.get_dummy_value()
        return types.void(n), lower
    return fn_lit


wgmma_fence = pick(None if SIMULATOR else _make_simple("wgmma_fence",
                                                       "wgmma.fence.sync.aligned;"), _fence_twin)
wgmma_commit_group = pick(None if SIMULATOR else _make_simple(
    "wgmma_commit_group", "wgmma.commit_group.sync.aligned;"), _commit_twin)
wgmma_wait_group = pick(None if SIMULATOR else _make_simple(
    "wgmma_wait_group", "wgmma.wait_group.sync.aligned {};", lambda v: 0 <= v <= 7),
    _wait_group_twin)


def _setmaxnreg_twin(kind):
    def twin(n):
        n = int(n)
        if not (24 <= n <= 256 and n % 8 == 0):
            raise ValueError(f"setmaxnreg_{kind}: {n} registers; it must be a multiple of 8 in "
                             "24 … 256")
        _sim.set_warp_specialised()   # a warp-specialised kernel: per-warp collectives
    twin.__name__ = f"setmaxnreg_{kind}_twin"
    return twin


def _regs_ok(v):
    return 24 <= v <= 256 and v % 8 == 0


setmaxnreg_inc = pick(None if SIMULATOR else _make_simple(
    "setmaxnreg_inc", "setmaxnreg.inc.sync.aligned.u32 {};", _regs_ok), _setmaxnreg_twin("inc"))
setmaxnreg_dec = pick(None if SIMULATOR else _make_simple(
    "setmaxnreg_dec", "setmaxnreg.dec.sync.aligned.u32 {};", _regs_ok), _setmaxnreg_twin("dec"))

def _fence_proxy_async_twin():
    """No effect in the simulator: its shared memory has one proxy, and stores are immediate."""


fence_proxy_async_shared = instruction(
    "fence_proxy_async_shared", "fence.proxy.async.shared::cta;",
    side_effect=True, clobber_memory=True, min_cc=(9, 0), twin=_fence_proxy_async_twin,
    doc="``fence_proxy_async_shared()``: order this thread's earlier generic-proxy accesses to "
        "shared memory (st.shared) before later async-proxy accesses (wgmma operand reads, TMA "
        "stores). Each writing thread, after its stores, before the syncthreads that the "
        "wgmma / TMA follows. sm_90+.")


def _wait_after_store_twin(addr, x, y):
    """The store (checked: 8 bytes inside a shared array whose address the block took, 8-byte
    aligned), then ``wgmma_wait_group(0)``."""
    addr = int(addr)
    address.check_range("shared", "wgmma_wait_after_store", addr, 8, 8)
    address.write_bytes(addr, np.array([x, y], np.float32).tobytes())
    _wait_group_twin(0)


def _make_wait_after_store():
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    @intrinsic
    def wgmma_wait_after_store(typingctx, addr, x, y):
        _check_ints("wgmma_wait_after_store", ("addr",), addr)
        for what, t in (("x", x), ("y", y)):
            if not isinstance(t, types.Float):
                raise TypingError(f"tilepy.ptx: wgmma_wait_after_store: {what} must be a float, "
                                  f"got {t}")

        def lower(context, builder, sig, args):
            require_sm90a("wgmma_wait_after_store")
            ops = [context.cast(builder, args[0], sig.args[0], types.uint32)] + [
                context.cast(builder, v, t, types.float32) for v, t in zip(args[1:], sig.args[1:])]
            call_asm(builder, "st.shared.v2.f32 [$0], {$1, $2};\n"
                     "wgmma.wait_group.sync.aligned 0;", "r,f,f,~{memory}", (),
                     ("u32", "f32", "f32"), ops, side_effect=True, convergent=True)
            return context.get_dummy_value()

        return types.void(addr, x, y), lower

    return wgmma_wait_after_store


#: ``wgmma_wait_after_store(addr, x, y)``: ``st.shared.v2.f32 [addr], {x, y}`` then
#: ``wgmma.wait_group 0``, in one asm statement; every thread of the warpgroup (``.aligned``).
#: ``addr`` a shared address (uint32, 8-byte aligned) of 8 scratch bytes, ``x`` / ``y``
#: float32. A bare ``wgmma_wait_group(0)`` has no operands, and ptxas's scheduler may hoist it
#: to the top of its basic block — above work meant to overlap the wgmmas in flight (seen in
#: the sm_90a SASS of the attention kernel's softmax). Storing values that the overlapped work
#: produces anchors the wait: it is not moved above the store, nor the store above its
#: operands. The stored bytes need no reader. sm_90a.
wgmma_wait_after_store = pick(None if SIMULATOR else _make_wait_after_store(),
                              _wait_after_store_twin)


def _descriptor_twin(addr, lbo, sbo, swizzle_bytes):
    return encode_descriptor(window_address(int(addr)), int(lbo), int(sbo), int(swizzle_bytes))


def _advance_twin(desc, nbytes):
    desc = int(desc)
    lo = ((desc & 0xFFFFFFFF) + (int(nbytes) >> 4)) & 0xFFFFFFFF   # the low word alone
    return (desc & ~0xFFFFFFFF & (2**64 - 1)) | lo


def _fence_operand_twin(acc, count):
    _as_acc(acc, "wgmma_fence_operand", int(count))


def _make_descriptor_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.core.extending import intrinsic

    i64 = ir.IntType(64)

    @intrinsic
    def matrix_descriptor(typingctx, addr, lbo, sbo, swizzle_bytes):
        _check_ints("matrix_descriptor", ("addr", "lbo", "sbo"), addr, lbo, sbo)
        mode = _MODE[_literal("matrix_descriptor", swizzle_bytes, "swizzle (bytes)",
                              lambda v: v in _MODE)]

        def lower(context, builder, sig, args):
            a, lb, sb = (context.cast(builder, v, t, types.uint64)
                         for v, t in zip(args[:3], sig.args[:3]))

            def field(v, shift):
                v = builder.lshr(builder.and_(v, i64(0x3FFFF)), i64(4))
                return builder.shl(v, i64(shift)) if shift else v

            d = builder.or_(field(a, 0), field(lb, 16))
            d = builder.or_(d, field(sb, 32))
            return builder.or_(d, i64(mode << 62))

        return types.uint64(addr, lbo, sbo, swizzle_bytes), lower

    @intrinsic
    def descriptor_advance(typingctx, desc, nbytes):
        _check_ints("descriptor_advance", ("desc", "nbytes"), desc, nbytes)

        def lower(context, builder, sig, args):
            # the start address is the low word's low 14 bits: a 32-bit add on that word, the
            # words paired by mov.b64 (a register pair, no instruction), which LLVM cannot
            # widen back into a 64-bit add with carry (three instructions per step)
            i32 = ir.IntType(32)
            d = context.cast(builder, args[0], sig.args[0], types.uint64)
            b = context.cast(builder, args[1], sig.args[1], types.int64)
            lo = builder.add(builder.trunc(d, i32), builder.trunc(builder.ashr(b, i64(4)), i32))
            hi = builder.trunc(builder.lshr(d, i64(32)), i32)
            return call_asm(builder, "mov.b64 $0, {$1, $2};", "=l,r,r", ("u64",),
                            ("u32", "u32"), [lo, hi])[0]

        return types.uint64(desc, nbytes), lower

    @intrinsic
    def wgmma_fence_operand(typingctx, acc, count):
        _check_acc_type("wgmma_fence_operand", acc)
        n = _literal("wgmma_fence_operand", count, "count", lambda v: 0 < v <= 256)

        def lower(context, builder, sig, args):
            for p in _acc_pointers(context, builder, sig.args[0], args[0], n):
                (v,) = call_asm(builder, "", "=f,0", ("f32",), ("f32",), [builder.load(p)],
                                side_effect=True)
                builder.store(v, p)
            return context.get_dummy_value()

        return types.void(acc, count), lower

    return matrix_descriptor, descriptor_advance, wgmma_fence_operand


_desc, _adv, _fop = (None, None, None) if SIMULATOR else _make_descriptor_intrinsics()
matrix_descriptor = pick(_desc, _descriptor_twin)
descriptor_advance = pick(_adv, _advance_twin)
wgmma_fence_operand = pick(_fop, _fence_operand_twin)

_DOCS = {
    "wgmma_fence": "``wgmma_fence()``: wgmma.fence.sync.aligned — order earlier register "
                   "accesses (accumulators, A fragments) before the following wgmmas. sm_90a.",
    "wgmma_commit_group": "``wgmma_commit_group()``: close the issued, uncommitted wgmmas into "
                          "a group. sm_90a.",
    "wgmma_wait_group": "``wgmma_wait_group(N)``: wait until at most N wgmma groups are pending; "
                        "N a compile-time literal 0 … 7. sm_90a.",
    "setmaxnreg_inc": "``setmaxnreg_inc(N)``: raise this warpgroup's register limit to N "
                      "(literal, multiple of 8 in 24 … 256); warp-specialised consumers. sm_90a.",
    "setmaxnreg_dec": "``setmaxnreg_dec(N)``: lower this warpgroup's register limit to N "
                      "(literal, multiple of 8 in 24 … 256); warp-specialised producers. sm_90a.",
    "matrix_descriptor": "``matrix_descriptor(addr, lbo, sbo, swizzle) -> uint64``: the wgmma "
                         "descriptor of a tile at shared address addr; swizzle a literal in "
                         "bytes (0, 32, 64, 128); base offset 0. See encode_descriptor.",
    "descriptor_advance": "``descriptor_advance(desc, nbytes) -> uint64``: the descriptor with "
                          "its start address moved by nbytes (a multiple of 16).",
    "wgmma_fence_operand": "``wgmma_fence_operand(acc, count)``: pin acc[0:count] (registers) to "
                           "this point of the program; after wgmma_wait_group, before reading.",
}
for _name, _doc in _DOCS.items():
    try:
        globals()[_name].__doc__ = _doc
    except AttributeError:  # pragma: no cover
        pass

# The named variants: N = 64, 128, 192, 256; f16 and bf16; A from shared memory or registers.
wgmma_m64n64k16_f32_f16 = wgmma(64, "f16")
wgmma_m64n64k16_f32_f16_rs = wgmma(64, "f16", a_in_registers=True)
wgmma_m64n64k16_f32_bf16 = wgmma(64, "bf16")
wgmma_m64n64k16_f32_bf16_rs = wgmma(64, "bf16", a_in_registers=True)
wgmma_m64n128k16_f32_f16 = wgmma(128, "f16")
wgmma_m64n128k16_f32_f16_rs = wgmma(128, "f16", a_in_registers=True)
wgmma_m64n128k16_f32_bf16 = wgmma(128, "bf16")
wgmma_m64n128k16_f32_bf16_rs = wgmma(128, "bf16", a_in_registers=True)
wgmma_m64n192k16_f32_f16 = wgmma(192, "f16")
wgmma_m64n192k16_f32_f16_rs = wgmma(192, "f16", a_in_registers=True)
wgmma_m64n192k16_f32_bf16 = wgmma(192, "bf16")
wgmma_m64n192k16_f32_bf16_rs = wgmma(192, "bf16", a_in_registers=True)
wgmma_m64n256k16_f32_f16 = wgmma(256, "f16")
wgmma_m64n256k16_f32_f16_rs = wgmma(256, "f16", a_in_registers=True)
wgmma_m64n256k16_f32_bf16 = wgmma(256, "bf16")
wgmma_m64n256k16_f32_bf16_rs = wgmma(256, "bf16", a_in_registers=True)

ALL = {name: fn for name, fn in globals().items() if name.startswith("wgmma_m64n")}

__all__ = [
    "Descriptor",
    "a_fragment_position",
    "accumulator_position",
    "canonical_offset",
    "decode_descriptor",
    "descriptor_advance",
    "encode_descriptor",
    "fence_proxy_async_shared",
    "make_warpgroup_model",
    "matrix_descriptor",
    "setmaxnreg_dec",
    "setmaxnreg_inc",
    "swizzle",
    "wgmma",
    "wgmma_commit_group",
    "wgmma_fence",
    "wgmma_fence_operand",
    "wgmma_m64n64k16_f32_bf16",
    "wgmma_m64n64k16_f32_bf16_rs",
    "wgmma_m64n64k16_f32_f16",
    "wgmma_m64n64k16_f32_f16_rs",
    "wgmma_m64n128k16_f32_bf16",
    "wgmma_m64n128k16_f32_bf16_rs",
    "wgmma_m64n128k16_f32_f16",
    "wgmma_m64n128k16_f32_f16_rs",
    "wgmma_m64n192k16_f32_bf16",
    "wgmma_m64n192k16_f32_bf16_rs",
    "wgmma_m64n192k16_f32_f16",
    "wgmma_m64n192k16_f32_f16_rs",
    "wgmma_m64n256k16_f32_bf16",
    "wgmma_m64n256k16_f32_bf16_rs",
    "wgmma_m64n256k16_f32_f16",
    "wgmma_m64n256k16_f32_f16_rs",
    "wgmma_wait_after_store",
    "wgmma_wait_group",
]


# ---- offline probes (tilepy.ptx.probes) ----------------------------------------------------------

def _register_probes():
    from . import probes

    def gen(name, body, argnames, **extra):
        from numba import cuda

        src = f"def probe_{name}({', '.join(argnames)}):\n" + "".join(
            f"    {ln}\n" for ln in body)
        ns = {"cuda": cuda, "float32": np.float32, **globals(), **extra}
        exec(compile(src, f"<probe {name}>", "exec"), ns)  # noqa: S102  (generated probe)
        return ns[f"probe_{name}"]

    def argtypes():
        from numba import types

        return (types.uint32[:], types.uint64[:], types.float32[:])

    def mma_probe(fn, rs):
        n = fn.variant["n"]
        nacc = n // 2
        body = [f"acc = cuda.local.array({nacc}, float32)"]
        body += [f"acc[{i}] = f32s[{i}]" for i in range(nacc)]
        body += ["wgmma_fence()"]
        if rs:
            body += ["fn(acc, u32s[1], u32s[2], u32s[3], u32s[4], u64s[1], u32s[0])"]
        else:
            body += ["fn(acc, u64s[0], u64s[1], u32s[0])"]
        body += ["wgmma_commit_group()", "wgmma_wait_group(0)",
                 f"wgmma_fence_operand(acc, {nacc})"]
        body += [f"f32s[{i}] = acc[{i}]" for i in range(nacc)]
        return body

    for ab in ("f16", "bf16"):
        for rs in (False, True):
            # N = 8: the instruction form alone, in the probes' 64-register budget; the named
            # N = 64 … 256 variants are compiled in tests/test_ptx_wgmma.py.
            fn = wgmma(8, ab, a_in_registers=rs)
            name = _variant_name(8, ab, rs, False, False)
            pyfunc = gen(name, mma_probe(fn, rs), ("u32s", "u64s", "f32s"), fn=fn)
            probes.EXTRA[name] = (pyfunc, argtypes, fn.opcode, (9, 0))
            probes.ARCH_SPECIFIC.add(name)
    for ab, bt, rs in (("e4m3", "e4m3", False), ("e5m2", "e5m2", False),
                       ("e4m3", "e5m2", False), ("e4m3", "e4m3", True)):
        fn = wgmma(8, ab, b_type=bt, a_in_registers=rs)
        name = _variant_name(8, ab, rs, False, False, bt)
        pyfunc = gen(name, mma_probe(fn, rs), ("u32s", "u64s", "f32s"), fn=fn)
        probes.EXTRA[name] = (pyfunc, argtypes, fn.opcode, (9, 0))
        probes.ARCH_SPECIFIC.add(name)
    simple = {
        "wgmma_fence": (["wgmma_fence()", "u32s[0] = u32s[1]"], "wgmma.fence.sync.aligned"),
        "wgmma_commit_group": (["wgmma_commit_group()", "u32s[0] = u32s[1]"],
                               "wgmma.commit_group.sync.aligned"),
        "wgmma_wait_group": (["wgmma_wait_group(1)", "u32s[0] = u32s[1]"],
                             "wgmma.wait_group.sync.aligned"),
        "wgmma_wait_after_store": (["wgmma_wait_after_store(u32s[0], f32s[0], f32s[1])",
                                    "u32s[0] = u32s[1]"], "st.shared.v2.f32"),
        "setmaxnreg_inc": (["setmaxnreg_inc(232)", "u32s[0] = u32s[1]"],
                           "setmaxnreg.inc.sync.aligned.u32"),
        "setmaxnreg_dec": (["setmaxnreg_dec(40)", "u32s[0] = u32s[1]"],
                           "setmaxnreg.dec.sync.aligned.u32"),
    }
    for name, (body, op) in simple.items():
        probes.EXTRA[name] = (gen(name, body, ("u32s", "u64s", "f32s")), argtypes, op, (9, 0))
        probes.ARCH_SPECIFIC.add(name)


_register_probes()
