"""Tensor Memory Accelerator (TMA), device side: boxes of a tensor, global ↔ shared (sm_90).

One thread issues ``cp.async.bulk.tensor.{2,3,4}d.shared::cluster.global.tile.mbarrier::complete_tx
::bytes``: the copy engine reads the box of the tensor that a *tensor map* describes, starting at
the given element coordinates, writes it densely into shared memory (innermost dimension
fastest, with the map's swizzle applied to the shared addresses), and completes the box's bytes
on an mbarrier (:mod:`tilepy.ptx.mbarrier`). Elements outside the tensor read as zeros and
still count, so a phase always expects the full box size.

* ``tma_load_2d(dst, tmap, bar, x, y)`` / ``tma_load_3d(dst, tmap, bar, x, y, z)`` /
  ``tma_load_4d(dst, tmap, bar, x, y, z, w)`` —
  ``dst``: uint32 shared address (128-byte aligned; a swizzled box must start where the swizzle
  pattern repeats, i.e. at a multiple of 8 × the swizzle size of a 1024-byte-aligned buffer);
  ``tmap``: uint64 generic address of the 128-byte tensor map in global memory
  (``tensor_map_address(arr)`` of the device array that
  :meth:`tilepy.tile.tma.TensorMap.to_device` made); ``bar``: uint32 shared address of the
  mbarrier; ``x, y, z``: int32 element coordinates of the box's first element, **innermost dimension
  first** (x is the column of a row-major matrix). ``x`` times the element size must be a
  multiple of 16 bytes (other starts have killed the context on an H200); coordinates may be
  negative or past the end (zeros).
* ``tma_store_2d(tmap, src, x, y)`` / ``tma_store_3d(tmap, src, x, y, z)`` — the reverse: the
  box at shared address ``src`` (laid out as a load writes it, swizzle included) goes to the
  tensor; elements outside the tensor are dropped. Before it, each thread that wrote ``src``
  calls :func:`tilepy.ptx.wgmma.fence_proxy_async_shared`, then a barrier. The issuing thread
  tracks completion with ``bulk_commit_group()``, ``bulk_wait_group_read(N)`` (``src`` may be
  reused) and ``bulk_wait_group(N)`` (the writes are done); N a compile-time literal.
* ``tma_load_2d_hint(dst, tmap, bar, x, y, policy)`` / ``tma_store_2d_hint(tmap, src, x, y,
  policy)`` — the same copies under an L2 cache policy (``.L2::cache_hint``) made by
  ``l2_evict_last_policy()`` (lines kept: read again soon) or ``l2_evict_first_policy()``
  (lines given up first: not read again) — ``createpolicy.fractional``, a uint64.
* ``bulk_reduce_add_f32(dst, src, nbytes)`` — no tensor map: ``nbytes`` of float32 in shared
  memory added element-wise into global memory (``cp.reduce.async.bulk … .add.f32``), tracked
  by the same bulk groups (a backward pass's dQ partial sums).
* ``fence_proxy_tensormap_acquire(tmap)`` — once per kernel (per thread that issues TMA),
  before the first copy through a tensor map that was written to global memory by an ordinary
  (generic-proxy) copy: Numba cannot pass a ``__grid_constant__`` kernel parameter, so tilepy
  passes the map as a global-memory array, and this fence makes it visible to the TMA unit.
* ``prefetch_tensormap(tmap)`` — optional, warms the map's cache line.
* ``tensor_map_address(arr) -> uint64`` — the generic address of ``arr[0]``, a kernel argument
  holding a tensor map (the operand form the instructions above take).

Swizzle (the map's, 0 / 32 / 64 / 128 bytes): the box byte offset ``o`` lands at shared address
``swizzle(dst + o)`` with :func:`tilepy.ptx.wgmma.swizzle` — the layout wgmma descriptors read.

Simulator: a load twin performs the copy when issued (reading the tensor through the host
address the map holds, writing shared memory with the swizzle, treating the destination array as
if it started on a 1024-byte boundary) and completes the bytes on the mbarrier; a store twin
writes the tensor when issued, and the bulk-group calls only keep count. The twins read maps that
:mod:`tilepy.tile.tma` encoded for the simulator (a tilepy-private format, not a CUtensorMap),
and refuses a swizzled box whose inner dimension is not exactly the swizzle size (whether the
GPU packs such boxes densely is not modelled).
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from . import _sim, _simcluster, address, mbarrier
from .asm import SIMULATOR, call_asm, instruction, pick, require_cc
from .wgmma_layout import swizzle as _swizzle

MAP_BYTES = 128
MAX_RANK = 5
_MAGIC = b"tilepyTM"
# magic, global address, element bytes, rank, swizzle bytes, dims (5, innermost first),
# strides in bytes of dims 1..4, box (5)
_FORMAT = "<8sQBBHI5Q4Q5H"


# ---- the simulator's tensor-map format (written by tilepy.tile.tma in the simulator) ------------

def sim_encode(address_: int, elem_bytes: int, dims, strides, box, swizzle_bytes: int) -> bytes:
    """128 bytes describing a tiled tensor map for the simulator's twins.

    ``dims``, ``box``: innermost first; ``strides``: bytes of dims 1 … rank-1 (innermost first).
    """
    rank = len(dims)
    pad = MAX_RANK - rank
    raw = struct.pack(_FORMAT, _MAGIC, int(address_), int(elem_bytes), rank, int(swizzle_bytes),
                      0, *map(int, dims), *([1] * pad), *map(int, strides),
                      *([0] * (MAX_RANK - 1 - len(strides))), *map(int, box), *([1] * pad))
    return raw + bytes(MAP_BYTES - len(raw))


def sim_decode(raw: bytes) -> dict:
    size = struct.calcsize(_FORMAT)
    fields = struct.unpack(_FORMAT, bytes(raw[:size]))
    if fields[0] != _MAGIC:
        raise ValueError("not a tensor map that tilepy.tile.tma encoded for the simulator "
                         "(a CUtensorMap from the driver cannot be read by the twins)")
    rank = fields[3]
    dims = fields[6:11][:rank]
    strides = (fields[2],) + fields[11:15][:rank - 1]
    box = fields[15:20][:rank]
    return {"address": fields[1], "elem_bytes": fields[2], "rank": rank, "swizzle": fields[4],
                "dims": dims, "strides": strides, "box": box}


# ---- simulator twins -----------------------------------------------------------------------------

def _read_map(tmap, who):
    raw = address.read_bytes(int(tmap), MAP_BYTES)
    try:
        return sim_decode(raw)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None


def _box_bytes(m):
    return int(np.prod(m["box"])) * m["elem_bytes"]


class _Box:
    """Where each element of a box lives: in global memory (byte offsets from the tensor's
    address, and whether it is inside the tensor) and in shared memory (swizzled byte offsets
    from the start of the shared array). Elements in box order, innermost dimension fastest."""

    def __init__(self, who, tmap, smem_addr, coords, what, t=None):
        m = _read_map(tmap, who)
        if m["rank"] != len(coords):
            raise ValueError(f"{who}: the tensor map has rank {m['rank']}, the copy is "
                             f"{len(coords)}-D")
        esize, swz = m["elem_bytes"], m["swizzle"]
        if (coords[0] * esize) % 16:
            raise ValueError(f"{who}: the box starts at x = {coords[0]}, {coords[0] * esize} "
                             "bytes into a row; it must be a multiple of 16 bytes")
        if swz and m["box"][0] * esize != swz:
            raise NotImplementedError(f"{who}: a {m['box'][0] * esize}-byte box row with the "
                                      f"{swz}-byte swizzle: the simulator models rows of exactly "
                                      "the swizzle size")
        self.nbytes = _box_bytes(m)
        smem_addr = int(smem_addr)
        address.check_range("shared", f"{who} {what}", smem_addr, self.nbytes, 128, t)
        self.esize = esize
        shape = tuple(reversed(m["box"]))
        idx = np.indices(shape).reshape(len(shape), -1)[::-1]  # row i: dimension i (innermost 0)
        g = idx + np.array(coords, np.int64)[:, None]
        self.inside = ((g >= 0) & (g < np.array(m["dims"], np.int64)[:, None])).all(axis=0)
        self.global_off = (g * np.array(m["strides"], np.int64)[:, None]).sum(axis=0)
        extent = sum((d - 1) * s for d, s in zip(m["dims"], m["strides"])) + esize
        self.tensor = np.ctypeslib.as_array((ctypes.c_uint8 * extent).from_address(m["address"]))
        lo = _array_start(smem_addr, t)
        rel = smem_addr - lo + np.arange(idx.shape[1], dtype=np.int64) * esize
        self.smem_off = _swizzle(rel, swz) if swz else rel
        size = int(self.smem_off.max()) + esize
        self.smem = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(lo))

    def bytes_of(self, offsets, mask=None):
        """(elements, esize) byte indices of the given element offsets."""
        offs = offsets if mask is None else offsets[mask]
        return offs[:, None] + np.arange(self.esize)


def _load(who, dst, tmap, bar, coords):
    # the destination may be another block's of the cluster (a multicast, tilepy.ptx.cluster)
    box = _Box(who, tmap, dst, coords, "destination", _simcluster.owner(int(dst)))
    elems = np.zeros((box.inside.size, box.esize), np.uint8)
    elems[box.inside] = box.tensor[box.bytes_of(box.global_off, box.inside)]
    box.smem[box.bytes_of(box.smem_off)] = elems
    mbarrier.complete_tx(bar, box.nbytes, who)


def _store(who, tmap, src, coords):
    box = _Box(who, tmap, src, coords, "source")
    elems = box.smem[box.bytes_of(box.smem_off)]
    box.tensor[box.bytes_of(box.global_off, box.inside)] = elems[box.inside]
    _bulk_groups()[0] += 1


def _bulk_groups():
    """[uncommitted stores, committed groups] of the calling simulated thread (bookkeeping: the
    twins store when issued)."""
    t = _sim.this_thread()
    st = getattr(t, "_tilepy_bulk", None)
    if st is None:
        st = t._tilepy_bulk = [0, 0]
    return st


def _bulk_commit_twin():
    st = _bulk_groups()
    st[0], st[1] = 0, st[1] + 1


def _bulk_wait_twin(n):
    n = int(n)
    if n < 0:
        raise ValueError(f"bulk_wait_group: N is {n}; it must be >= 0")
    st = _bulk_groups()
    st[1] = min(st[1], n)


def _array_start(addr, t=None):
    extents = address._block_extents(t)["shared"]
    with address._extent_lock:
        for lo, hi in extents.items():
            if lo <= addr < hi:
                return lo
    raise IndexError(f"shared address {addr:#x} is in no shared array")  # pragma: no cover


def _load_2d_twin(dst, tmap, bar, x, y):
    _load("tma_load_2d", dst, tmap, bar, (int(x), int(y)))


def _load_3d_twin(dst, tmap, bar, x, y, z):
    _load("tma_load_3d", dst, tmap, bar, (int(x), int(y), int(z)))


def _load_4d_twin(dst, tmap, bar, x, y, z, w):
    _load("tma_load_4d", dst, tmap, bar, (int(x), int(y), int(z), int(w)))


def _store_2d_twin(tmap, src, x, y):
    _store("tma_store_2d", tmap, src, (int(x), int(y)))


def _store_3d_twin(tmap, src, x, y, z):
    _store("tma_store_3d", tmap, src, (int(x), int(y), int(z)))


def _check_map_twin(tmap):
    _read_map(tmap, "fence_proxy_tensormap_acquire")


# ---- declarations --------------------------------------------------------------------------------

_SM90 = (9, 0)
_COPY = ("cp.async.bulk.tensor.{d}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
         "[$0], [$1, {{{coords}}}], [$2];")

tma_load_2d = instruction(
    "tma_load_2d", _COPY.format(d=2, coords="$3, $4"), ins=("u32", "u64", "u32", "i32", "i32"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_2d_twin,
    doc="``tma_load_2d(dst, tmap, bar, x, y)``: copy the box at element (x, y) (x innermost) of "
        "the 2-D tensor map tmap into shared memory at dst; its bytes complete on the mbarrier "
        "bar. One thread. sm_90+. See tilepy.ptx.tma.")

tma_load_3d = instruction(
    "tma_load_3d", _COPY.format(d=3, coords="$3, $4, $5"),
    ins=("u32", "u64", "u32", "i32", "i32", "i32"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_3d_twin,
    doc="``tma_load_3d(dst, tmap, bar, x, y, z)``: as tma_load_2d for a 3-D tensor map (x "
        "innermost). sm_90+.")

tma_load_4d = instruction(
    "tma_load_4d", _COPY.format(d=4, coords="$3, $4, $5, $6"),
    ins=("u32", "u64", "u32", "i32", "i32", "i32", "i32"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_4d_twin,
    doc="``tma_load_4d(dst, tmap, bar, x, y, z, w)``: as tma_load_2d for a 4-D tensor map (x "
        "innermost; e.g. (head_dim, seq, head, batch) of an attention operand). sm_90+.")

_STORE = ("cp.async.bulk.tensor.{d}d.global.shared::cta.tile.bulk_group "
          "[$0, {{{coords}}}], [$1];")

tma_store_2d = instruction(
    "tma_store_2d", _STORE.format(d=2, coords="$2, $3"), ins=("u64", "u32", "i32", "i32"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_store_2d_twin,
    doc="``tma_store_2d(tmap, src, x, y)``: copy the box in shared memory at src (laid out as "
        "tma_load_2d writes it, swizzle included) to the tensor at element (x, y); elements "
        "outside the tensor are not written. One thread; the smem writes before it need "
        "fence_proxy_async_shared and a barrier. Completes in a bulk group: bulk_commit_group, "
        "then bulk_wait_group_read(N) before reusing src, bulk_wait_group(N) before the data "
        "is needed in global memory. sm_90+.")

tma_store_3d = instruction(
    "tma_store_3d", _STORE.format(d=3, coords="$2, $3, $4"),
    ins=("u64", "u32", "i32", "i32", "i32"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_store_3d_twin,
    doc="``tma_store_3d(tmap, src, x, y, z)``: as tma_store_2d for a 3-D tensor map. sm_90+.")


# ---- L2 cache hints ------------------------------------------------------------------------------
# The simulator has no L2: the policies are placeholders there and the hinted copies are the
# plain ones.

def _policy_twin():
    return np.uint64(0)


def _load_2d_hint_twin(dst, tmap, bar, x, y, policy):
    _load_2d_twin(dst, tmap, bar, x, y)


def _store_2d_hint_twin(tmap, src, x, y, policy):
    _store_2d_twin(tmap, src, x, y)


l2_evict_last_policy = instruction(
    "l2_evict_last_policy", "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;",
    outs=("u64",), min_cc=(8, 0), twin=_policy_twin,
    doc="``l2_evict_last_policy() -> policy``: a uint64 L2 cache policy (createpolicy) under "
        "which the lines a hinted copy touches are evicted last — data read again soon. "
        "sm_80+.")

l2_evict_first_policy = instruction(
    "l2_evict_first_policy", "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;",
    outs=("u64",), min_cc=(8, 0), twin=_policy_twin,
    doc="``l2_evict_first_policy() -> policy``: as l2_evict_last_policy, evicted first — data "
        "not read again. sm_80+.")

tma_load_2d_hint = instruction(
    "tma_load_2d_hint", _COPY.replace("::bytes ", "::bytes.L2::cache_hint ").replace(
        "[$2];", "[$2], $5;").format(d=2, coords="$3, $4"),
    ins=("u32", "u64", "u32", "i32", "i32", "u64"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_2d_hint_twin,
    doc="``tma_load_2d_hint(dst, tmap, bar, x, y, policy)``: tma_load_2d under an L2 cache "
        "policy (l2_evict_last_policy …). sm_90+.")

tma_store_2d_hint = instruction(
    "tma_store_2d_hint", _STORE.replace("bulk_group ", "bulk_group.L2::cache_hint ").replace(
        "[$1];", "[$1], $4;").format(d=2, coords="$2, $3"),
    ins=("u64", "u32", "i32", "i32", "u64"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_store_2d_hint_twin,
    doc="``tma_store_2d_hint(tmap, src, x, y, policy)``: tma_store_2d under an L2 cache policy. "
        "sm_90+.")

_REDUCE_LOCK = __import__("threading").Lock()


def _bulk_reduce_add_f32_twin(dst, src, nbytes):
    dst, src, nbytes = int(dst), int(src), int(nbytes)
    if nbytes <= 0 or nbytes % 16 or dst % 16 or src % 16:
        raise ValueError(f"bulk_reduce_add_f32: size {nbytes} and both addresses must be "
                         f"positive multiples of 16 (dst {dst:#x}, src {src:#x})")
    address.check_range("shared", "bulk_reduce_add_f32", src, nbytes, 16)
    address.check_range("global", "bulk_reduce_add_f32", dst, nbytes, 16)
    add = np.frombuffer(address.read_bytes(src, nbytes), np.float32)
    with _REDUCE_LOCK:   # the L2's reduction is atomic per element
        cur = np.frombuffer(address.read_bytes(dst, nbytes), np.float32)
        address.write_bytes(dst, (cur + add).astype(np.float32).tobytes())
    _bulk_groups()[0] += 1


bulk_reduce_add_f32 = instruction(
    "bulk_reduce_add_f32",
    "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
    ins=("u64", "u32", "u32"), side_effect=True, clobber_memory=True, min_cc=_SM90,
    twin=_bulk_reduce_add_f32_twin,
    doc="``bulk_reduce_add_f32(dst, src, nbytes)``: add the ``nbytes`` / 4 float32 at shared "
        "address ``src`` element-wise into global memory at generic address ``dst`` (a 1-D "
        "bulk copy with reduction, performed by the copy engine in L2; each element's add is "
        "atomic, their order unspecified). ``nbytes`` and both addresses multiples of 16. One "
        "thread; the smem writes before it need fence_proxy_async_shared and a barrier. "
        "Completes in a bulk group like tma_store_2d. sm_90+.")

bulk_commit_group = instruction(
    "bulk_commit_group", "cp.async.bulk.commit_group;", side_effect=True, clobber_memory=True,
    min_cc=_SM90, twin=_bulk_commit_twin,
    doc="``bulk_commit_group()``: close this thread's uncommitted bulk copies (TMA stores) into "
        "a bulk group. sm_90+.")


def _make_bulk_wait(name, template):
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    @intrinsic
    def bulk_wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral) or not 0 <= n.literal_value <= 63:
            raise TypingError(f"tilepy.ptx: {name}(N) needs N to be a compile-time integer "
                              f"literal 0 … 63, got {n}")
        value = n.literal_value

        def lower(context, builder, sig, args):
            require_cc(name, _SM90)
            call_asm(builder, template.format(value), "~{memory}", (), (), (), side_effect=True)
            return context.get_dummy_value()

        return types.void(n), lower

    return bulk_wait


bulk_wait_group_read = pick(None if SIMULATOR else _make_bulk_wait(
    "bulk_wait_group_read", "cp.async.bulk.wait_group.read {};"), _bulk_wait_twin)
bulk_wait_group = pick(None if SIMULATOR else _make_bulk_wait(
    "bulk_wait_group", "cp.async.bulk.wait_group {};"), _bulk_wait_twin)
_WAIT_DOCS = {
    "bulk_wait_group_read": ("``bulk_wait_group_read(N)``: wait until at most N bulk groups "
                             "still read their shared-memory source (then it may be "
                             "overwritten). N a literal. sm_90+."),
    "bulk_wait_group": ("``bulk_wait_group(N)``: wait until at most N bulk groups are pending "
                        "(their writes done). N a literal. sm_90+."),
}
for _name, _doc in _WAIT_DOCS.items():
    try:
        globals()[_name].__doc__ = _doc
    except AttributeError:  # pragma: no cover
        pass

fence_proxy_tensormap_acquire = instruction(
    "fence_proxy_tensormap_acquire", "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
    ins=("u64",), side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_check_map_twin,
    doc="``fence_proxy_tensormap_acquire(tmap)``: make the 128-byte tensor map at global address "
        "tmap, written by an ordinary copy, visible to the TMA unit; before its first use. "
        "sm_90+.")

prefetch_tensormap = instruction(
    "prefetch_tensormap", "prefetch.tensormap [$0];", ins=("u64",), side_effect=True,
    min_cc=_SM90, twin=_check_map_twin,
    doc="``prefetch_tensormap(tmap)``: prefetch the tensor map at tmap into its cache. sm_90+.")

def _tensor_map_address_twin(arr):
    addr = address._element_address("global", arr, 0)
    address.check_range("global", "tensor_map_address", addr, MAP_BYTES, 1)
    return addr


def _make_tensor_map_address():
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.core.extending import intrinsic

    @intrinsic
    def tensor_map_address(typingctx, arr):
        if not (isinstance(arr, types.Array) and arr.ndim == 1):
            raise TypingError(f"tilepy.ptx.tensor_map_address(array): expected the 1-D device "
                              f"array holding a tensor map, got {arr}")

        def lower(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            return builder.ptrtoint(ary.data, ir.IntType(64))  # Numba's data pointers are generic

        return types.uint64(arr), lower

    return tensor_map_address


tensor_map_address = pick(None if SIMULATOR else _make_tensor_map_address(),
                          _tensor_map_address_twin)
try:
    tensor_map_address.__doc__ = (
        "``tensor_map_address(arr) -> uint64``: the generic address of arr[0], the device array "
        "(uint8[128]) holding a tensor map; what tma_load_2d/3d/4d and the fences take.")
except AttributeError:  # pragma: no cover
    pass

__all__ = [
    "MAP_BYTES",
    "bulk_commit_group",
    "bulk_reduce_add_f32",
    "bulk_wait_group",
    "bulk_wait_group_read",
    "fence_proxy_tensormap_acquire",
    "l2_evict_first_policy",
    "l2_evict_last_policy",
    "prefetch_tensormap",
    "sim_decode",
    "sim_encode",
    "tensor_map_address",
    "tma_load_2d",
    "tma_load_2d_hint",
    "tma_load_3d",
    "tma_load_4d",
    "tma_store_2d",
    "tma_store_2d_hint",
    "tma_store_3d",
]


def _register_probes():
    from . import probes

    def argtypes():
        from numba import types

        return (types.uint32[:],)

    def probe_bulk_wait_group_read(u32s):
        bulk_wait_group_read(1)
        u32s[0] = u32s[1]

    def probe_bulk_wait_group(u32s):
        bulk_wait_group(0)
        u32s[0] = u32s[1]

    probes.EXTRA["bulk_wait_group_read"] = (probe_bulk_wait_group_read, argtypes,
                                            "cp.async.bulk.wait_group.read", _SM90)
    probes.EXTRA["bulk_wait_group"] = (probe_bulk_wait_group, argtypes, "cp.async.bulk.wait_group",
                                       _SM90)


_register_probes()
