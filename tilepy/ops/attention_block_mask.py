"""Block masks for ``tilepy.flash_attention``'s ``mask_mod`` (FlexAttention's ``BlockMask``):
which (query block, key block) pairs a mask function leaves any key visible in, and which it
leaves wholly visible, so that the attention kernels visit only the first and evaluate the
function only on the blocks that are not wholly visible.

* :func:`create_block_mask` computes one on the GPU from ``mask_mod`` (every pair evaluated
  once: one block of threads per query block, one thread per query row).
* :class:`BlockMask` holds it: FlexAttention's four int32 arrays and the sizes they were made
  for, plus the ``mask_mod`` and ``mod_args`` the attention call then uses.
* :func:`check_block_mask` is what ``flash_attention(..., block_mask=)`` checks before launch;
  :func:`cached_block_mask` the mask it makes itself for a ``mask_mod`` that reads no array.

The kernels' side is :func:`tilepy.tile.attention.block_mask_row` and
:func:`tilepy.tile.attention.key_block_at`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict

import numpy as np
from numba import cuda

from .. import arrays
from ..arrays import describe, device_view
from ..inline import inline_device
from ..launch import MAX_GRID_YZ, LaunchPlan
from ..tile.attention import check_n_args, check_user_function, mask_visible
from ..tile.device_write import stream_capturing

#: The default block size (query rows, keys) of :func:`create_block_mask`: FlexAttention's.
BLOCK_SIZE = 128


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Which key blocks each query block visits (FlexAttention's ``BlockMask`` layout).

    * ``kv_num_blocks`` int32 ``(batch, heads, ceil(seq_q / block_q))``: per query block, the
      number of *partial* key blocks (some pair visible, not all), listed first in
      ``kv_indices`` int32 ``(batch, heads, query blocks, ceil(seq_k / block_k))``;
    * ``full_kv_num_blocks`` / ``full_kv_indices``: the same for the *full* key blocks (every
      pair of the block's rows before ``seq_q`` and keys before ``seq_k`` visible), on which
      ``mask_mod`` is not evaluated;
    * ``batch`` or ``heads`` of 1 is one mask for every batch / query head (``create_block_mask``
      with ``batch=None`` / ``heads=None``);
    * ``block_size`` ``(block_q, block_k)``, ``seq_lengths`` ``(seq_q, seq_k)``;
    * ``mask_mod`` / ``mod_args``: the mask function and its arguments, which
      ``flash_attention(..., block_mask=)`` applies on the partial blocks;
    * ``q_num_blocks`` / ``q_indices`` / ``full_q_num_blocks`` / ``full_q_indices``
      (FlexAttention's names; ``(batch, heads, key blocks[, query blocks])``): the same lists
      transposed — per key block, the query blocks that see it, in ascending order — which the
      backward's dK / dV kernel walks. :func:`create_block_mask` makes them; a mask without
      them (None) has its backward visit every block. They must be the transpose of the
      ``kv_*`` lists: a mask whose lists are replaced (``dataclasses.replace``) must have
      them replaced too, or set to None.
    * ``partial_bits``: None, or uint32 ``(batch, heads, query blocks · block_q, key blocks ·
      block_k / 32)``: ``mask_mod``'s value at every pair of the partial blocks (bit
      ``kv_idx % 32`` of word ``[b, h, q_idx, kv_idx // 32]``; the other blocks' words are
      not read). ``flash_attention`` then reads these bits on the partial blocks in place of
      calling ``mask_mod`` — unless the call gives its own ``mod_args`` (the bits hold the
      function's value for the mask's). ``partial_bits_t``: the same bits by key, uint32
      ``(batch, heads, key blocks · block_k, query blocks · block_q / 32)`` (bit ``q_idx % 32``
      of word ``[b, h, kv_idx, q_idx // 32]``), which the backward reads (it needs both). A
      mask whose lists or arguments are replaced must have them replaced or set to None.

    Arrays of the caller's kind (CuPy, PyTorch, Numba; NumPy in the simulator) on one device.
    A hand-made mask must list each key block at most once per query block across both lists
    and must not list one that has a visible pair as neither (it would be skipped); an index
    outside ``0 … ceil(seq_k / block_k) - 1`` is clamped into it and a count past the index
    arrays' length is cut to it (never read out of bounds)."""

    kv_num_blocks: object
    kv_indices: object
    full_kv_num_blocks: object
    full_kv_indices: object
    block_size: tuple
    seq_lengths: tuple
    mask_mod: object = None
    mod_args: tuple = ()
    q_num_blocks: object = None
    q_indices: object = None
    full_q_num_blocks: object = None
    full_q_indices: object = None
    partial_bits: object = None
    partial_bits_t: object = None

    @property
    def arrays(self) -> tuple:
        """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)``: the kernels'
        order."""
        return (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                self.full_kv_indices)

    @property
    def q_arrays(self):
        """``(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``, or None when the
        mask has no transposed lists."""
        qa = (self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)
        return None if any(x is None for x in qa) else qa

    def function(self, mask_mod, mod_args) -> tuple:
        """``(mask_mod, mod_args)`` of a call given this mask: the call's, else the mask's
        (``mod_args`` the mask's when the call's are None or empty; another kind is left for
        the op's checks to refuse)."""
        if mask_mod is None:
            mask_mod = self.mask_mod
        if mod_args is None or (isinstance(mod_args, (tuple, list)) and not mod_args):
            mod_args = self.mod_args
        return mask_mod, mod_args

    @property
    def shape(self) -> tuple:
        """``(batch, heads, seq_q, seq_k)`` it was made for (batch / heads 1: broadcast)."""
        return tuple(self.kv_num_blocks.shape[:2]) + tuple(self.seq_lengths)

    def __repr__(self):
        b, h, sq, sk = self.shape
        return (f"BlockMask(batch={b}, heads={h}, seq_q={sq}, seq_k={sk}, "
                f"block_size={self.block_size}, mask_mod={_name(self.mask_mod)})")


def _name(fn) -> str:
    return getattr(getattr(fn, "py_func", fn), "__qualname__", repr(fn))


def block_sizes(block_size) -> tuple:
    """``(block_q, block_k)`` from an int or a pair; ``ValueError`` unless multiples of 16
    from 16 to 1024 (one thread per query row of a block when the mask is made)."""
    pair = (block_size, block_size) if isinstance(block_size, (int, np.integer)) \
        else tuple(block_size)
    if len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer))
                             or not 16 <= x <= 1024 or x % 16 for x in pair):
        raise ValueError(f"block_size must be an int or a (query, key) pair of multiples of "
                         f"16 from 16 to 1024, got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _dim(x, name: str) -> int:
    if x is None:
        return 1
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"create_block_mask: {name} must be a positive int or None (one mask "
                         f"for every {name}), got {x!r}")
    return int(x)


def create_block_mask(mask_mod, batch, heads, seq_q, seq_k, *, like=None, mod_args=(),
                      block_size=BLOCK_SIZE, partial_bits=None):
    """The :class:`BlockMask` of ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool``
    (``flash_attention``'s contract) over ``batch`` × ``heads`` × ``seq_q`` × ``seq_k``,
    FlexAttention's ``create_block_mask``.

    * ``batch`` / ``heads``: ints, or None for one mask shared by every batch / query head
      (``mask_mod`` then called with ``b = 0`` / ``h = 0``: it must not depend on them). A
      mask made for 1 is shared the same way (FlexAttention's broadcast): used with more
      batches / heads it is batch / head 0's for all of them.
    * ``like``: an array whose kind and device the mask's arrays take (e.g. ``q``); may be
      left out when ``mod_args`` holds an array.
    * ``block_size``: ``block_q`` and ``block_k`` (an int for both), multiples of 16 up to
      1024; 128 by default. The attention kernel's tiles must divide them (its config is
      chosen so, or a ``ValueError`` says which sizes fit).
    * ``mod_args``: as ``flash_attention``'s (arrays on the device, numbers); kept in the
      mask, and used by ``flash_attention(..., block_mask=)`` unless that call gives its own.
    * ``partial_bits``: whether to keep ``mask_mod``'s value at every pair of the partial
      blocks as bitmaps (:class:`BlockMask`'s ``partial_bits`` by query row and
      ``partial_bits_t`` by key: ``seq_q · seq_k / 8`` bytes each per batch and head, rounded
      up to blocks), which the attention forward and backward then read in place of calling
      the function — one 32-bit load per 32 keys of a row instead of the function's own
      loads per score. None (the default): kept where ``mod_args`` holds an array (a function
      that reads memory, whose per-score loads cost most), the block sizes are multiples of
      32 and the two take at most :data:`PARTIAL_BITS_LIMIT` bytes; True / False: always
      (``ValueError`` for other block sizes) / never.

    Every pair is evaluated once on the caller's current stream (no host synchronisation);
    the result is valid for the ``mod_args`` contents it saw — make a new one when they
    change. Errors (a function of the wrong arity, bad sizes) before anything is launched."""
    n_args = check_n_args(_n_mod_args(mod_args))
    check_user_function(mask_mod, "mask_mod", 4, n_args)
    if mask_mod is None:
        raise TypeError("create_block_mask: mask_mod is None")
    bq, bk = block_sizes(block_size)
    b, h = _dim(batch, "batch"), _dim(heads, "heads")
    for name, x in (("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"create_block_mask: {name} must be an int >= 0, got {x!r}")
    sq, sk = int(seq_q), int(seq_k)
    from . import attention as at    # (its module imports this one)

    hargs, hops = at.hook_args(None, mod_args, b, h, sq, sk)
    if like is None:
        if not hops:
            raise TypeError("create_block_mask: pass like= (an array whose kind and device "
                            "the mask takes, e.g. q)")
        L = hops[0]
    else:
        L = describe(like, "like", dtypes=arrays.HOOK_DTYPES + arrays.DTYPES
                     + ("float8_e4m3fn", "float8_e5m2"))
    arrays.same_device(L, *hops)
    nq, nk = -(-sq // bq), -(-sk // bk)
    if max(b, h) > MAX_GRID_YZ:
        raise ValueError(f"create_block_mask: at most {MAX_GRID_YZ} batches and heads, got "
                         f"batch {b}, heads {h}")
    bits_shape = (b, h, nq * bq, nk * bk // 32)
    if partial_bits is None:
        keep_bits = bool(hops) and bq % 32 == 0 and bk % 32 == 0 and \
            2 * 4 * int(np.prod(bits_shape)) <= PARTIAL_BITS_LIMIT
    elif isinstance(partial_bits, (bool, np.bool_)):
        keep_bits = bool(partial_bits)
        if keep_bits and (bq % 32 or bk % 32):
            raise ValueError(f"create_block_mask: partial_bits needs a block size of "
                             f"multiples of 32, got {(bq, bk)}")
    else:
        raise TypeError(f"create_block_mask: partial_bits must be None, True or False, got "
                        f"{partial_bits!r}")
    with arrays.on_device(L.device):
        outs = [arrays.zeros(L, shape, "int32")
                for shape in ((b, h, nq), (b, h, nq, nk), (b, h, nq), (b, h, nq, nk),
                              (b, h, nk), (b, h, nk, nq), (b, h, nk), (b, h, nk, nq))]
        bits = arrays.zeros(L, bits_shape, "uint32") if keep_bits else None
        bits_t = arrays.zeros(L, (b, h, nk * bk, nq * bq // 32), "uint32") if keep_bits \
            else None
        if nq and nk:
            views = [device_view(arrays.raw_view(describe(x, "mask", dtypes=("int32",))))
                     for x in outs]
            stream = arrays.stream_handle(L)
            kern = block_mask_kernel(mask_visible(mask_mod, n_args), bq, bk, keep_bits)
            args = (np.int64(sq), np.int64(sk), *views[:4], tuple(hargs))
            if keep_bits:
                args += tuple(device_view(arrays.raw_view(describe(x, "partial_bits",
                                                                   dtypes=("uint32",))))
                              for x in (bits, bits_t))
            LaunchPlan(kern, args, (nq, h, b), bq).launch(stream, args)
            args = tuple(views)
            LaunchPlan(transpose_kernel(), args, (-(-nk // 32), h, b), 32).launch(stream, args)
    return BlockMask(*outs[:4], (bq, bk), (sq, sk), mask_mod, tuple(mod_args or ()),
                     *outs[4:], partial_bits=bits, partial_bits_t=bits_t)


#: The most bytes :func:`create_block_mask` gives the bitmaps it keeps by default
#: (``partial_bits=None``), the two together: 256 MiB (batch 4 of one 16k × 16k mask shared by
#: the heads).
PARTIAL_BITS_LIMIT = 256 << 20


def _n_mod_args(mod_args) -> int:
    if mod_args is None:
        return 0
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays and numbers, got "
                        f"{type(mod_args).__name__}")
    return len(mod_args)


@functools.cache
def block_mask_kernel(visible, block_q: int, block_k: int, bits: bool = False):
    """``kernel(sq, sk, num, idx, full_num, full_idx, args[, words, words_t])``: grid (query blocks,
    heads, batch), ``block_q`` threads, thread ``r`` for query row ``qb · block_q + r``. Per key
    block (in order) each thread tests its row's keys with ``visible(b, h, q, kv, args)`` —
    stopping once it has seen a visible and a hidden key — and the block's threads vote (rows
    past ``sq`` and keys past ``sk`` do not count): some pair visible → partial, every pair →
    full; thread 0 appends the key block to its list and writes the counts at the end.
    ``bits`` (``block_q`` and ``block_k`` multiples of 32): on a partial block each thread also
    writes its row's ``block_k / 32`` words of ``words`` (uint32 (batch, heads, rows, key
    words), zero-filled before: bit ``c`` of word ``kv // 32`` for ``kv = 32 · word + c``
    visible; keys past ``sk`` and rows past ``sq`` 0), and, through ``block_q`` words of
    shared memory, the block's words of ``words_t`` (uint32 (batch, heads, keys, query words):
    bit ``i`` of word ``q // 32`` for ``q = 32 · word + i``), the same bits by key. Not
    disk-cached (its closure holds the user's function)."""
    BQ, BK, BITS = block_q, block_k, bits
    KW, QW = block_k // 32, block_q // 32
    one = np.uint32(1)

    @inline_device
    def write_bits(words, words_t, b, h, qb, r, kb, sq, sk, args):
        # word by word: each thread its row's 32 keys, then (through a block_q-word tile of
        # shared memory) thread 32·qw + c the word of key c over rows 32·qw … 32·qw + 31
        row = cuda.threadIdx.x
        tile = cuda.shared.array(BQ, np.uint32)
        c = row % 32
        qw = row // 32
        for wd in range(KW):
            acc = np.uint32(0)
            key0 = np.int64(kb) * BK + 32 * wd
            if r < sq:
                for j in range(32):
                    if key0 + j < sk:
                        if visible(b, h, r, key0 + j, args):
                            acc |= one << np.uint32(j)
            words[b, h, r, np.int64(kb) * KW + wd] = acc
            tile[row] = acc
            cuda.syncthreads()
            acc = np.uint32(0)
            for i in range(32):
                acc |= ((tile[32 * qw + i] >> np.uint32(c)) & one) << np.uint32(i)
            words_t[b, h, key0 + c, np.int64(qb) * QW + qw] = acc
            cuda.syncthreads()   # (the tile is rewritten by the next word)

    @inline_device
    def run(sq, sk, num, idx, full_num, full_idx, args, words, words_t):
        qb = cuda.blockIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        r = np.int64(qb) * BQ + cuda.threadIdx.x
        n_kb = (sk + BK - 1) // BK
        n_part = 0
        n_full = 0
        for kb in range(n_kb):
            seen = np.int32(0)
            hidden = np.int32(0)
            if r < sq:
                key0 = np.int64(kb) * BK
                for c in range(min(BK, sk - key0)):
                    if visible(b, h, r, key0 + c, args):
                        seen = np.int32(1)
                    else:
                        hidden = np.int32(1)
                    if seen and hidden:
                        break
            any_seen = cuda.syncthreads_or(seen)
            any_hidden = cuda.syncthreads_or(hidden)
            if BITS:
                if any_seen and any_hidden:   # (block-uniform)
                    write_bits(words, words_t, b, h, qb, r, kb, sq, sk, args)
            if cuda.threadIdx.x == 0 and any_seen:
                if any_hidden:
                    idx[b, h, qb, n_part] = kb
                    n_part += 1
                else:
                    full_idx[b, h, qb, n_full] = kb
                    n_full += 1
        if cuda.threadIdx.x == 0:
            num[b, h, qb] = n_part
            full_num[b, h, qb] = n_full

    if BITS:
        @cuda.jit
        def kernel(sq, sk, num, idx, full_num, full_idx, args, words, words_t):
            run(sq, sk, num, idx, full_num, full_idx, args, words, words_t)
    else:
        @cuda.jit
        def kernel(sq, sk, num, idx, full_num, full_idx, args):
            run(sq, sk, num, idx, full_num, full_idx, args, 0, 0)

    return kernel


@functools.cache
def transpose_kernel():
    """``kernel(num, idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx)``: grid
    (ceil(key blocks / 32), heads, batch), 32 threads, a thread per key block ``kb``: for each
    query block in order, whether ``kb`` is in its partial list (``idx[b, h, qm, :num]``) or
    its full one (binary searches: :func:`block_mask_kernel` lists ascending), appended to
    ``kb``'s transposed partial / full list, and the counts written at the end. Masks of
    :func:`create_block_mask` only (hand-made lists need not be sorted)."""

    @inline_device
    def listed(row, count, kb):
        n = min(max(np.int64(count), np.int64(0)), np.int64(row.shape[0]))
        lo = np.int64(0)
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            if row[mid] < kb:
                lo = mid + 1
            else:
                hi = mid
        found = False
        if lo < n:
            found = row[lo] == kb
        return found

    @cuda.jit
    def kernel(num, idx, full_num, full_idx, q_num, q_idx, full_q_num, full_q_idx):
        kb = cuda.blockIdx.x * 32 + cuda.threadIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        if kb >= q_num.shape[2]:
            return
        n_part = 0
        n_full = 0
        for qm in range(num.shape[2]):
            if listed(idx[b, h, qm], num[b, h, qm], kb):
                q_idx[b, h, kb, n_part] = qm
                n_part += 1
            elif listed(full_idx[b, h, qm], full_num[b, h, qm], kb):
                full_q_idx[b, h, kb, n_full] = qm
                n_full += 1
        q_num[b, h, kb] = n_part
        full_q_num[b, h, kb] = n_full

    return kernel


def check_block_mask(block_mask, mask_mod, mod_args, batch: int, heads: int, sq: int, sk: int,
                     causal, window, like, op: str = "flash_attention"):
    """``(mask_mod, mod_args, (num, idx, full_num, full_idx) Operands)`` (the transposed
    lists, where the mask has them, checked likewise: int32, (batch, heads) as the others,
    (key blocks[, query blocks]) after them, on the same device) of
    ``flash_attention(..., block_mask=)``: the mask's function unless the call gives the same
    one (another is a ``ValueError``), the call's ``mod_args`` or else the mask's; ``TypeError``
    / ``ValueError`` for a mask that is not a :class:`BlockMask` of int32 arrays on the inputs'
    device made for these sequence lengths, this batch (or 1) and these query heads (or 1), or
    for one given with ``causal`` / a bounded ``window`` (a block mask's function says which
    keys each row sees: write causal or a window in it; ``(-1, -1)`` is no window). ``op``:
    the function the messages name."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a tilepy BlockMask (tilepy.create_block_mask), "
                        f"got {type(block_mask).__name__}")
    unbounded = window is None or (isinstance(window, (tuple, list)) and len(window) == 2 and
                                   all(x is None or (not isinstance(x, bool) and x == -1)
                                       for x in window))
    if causal or not unbounded:
        raise ValueError(f"{op}: block_mask with causal=True or a window; the block "
                         "mask's mask_mod says which keys each row sees (write causal or the "
                         "window in it)")
    if mask_mod is not None and block_mask.mask_mod is not None \
            and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"{op}: mask_mod {_name(mask_mod)!r} is not the block "
                         f"mask's ({_name(block_mask.mask_mod)!r})")
    mask_mod, mod_args = block_mask.function(mask_mod, mod_args)
    if mask_mod is None:
        raise ValueError(f"{op}: a block_mask needs its mask_mod (none in the mask "
                         "and none given)")
    if tuple(block_mask.seq_lengths) != (sq, sk):
        raise ValueError(f"block_mask was made for (seq_q, seq_k) = "
                         f"{tuple(block_mask.seq_lengths)}, the inputs have ({sq}, {sk})")
    bq, bk = block_sizes(block_mask.block_size)
    nq, nk = -(-sq // bq), -(-sk // bk)
    ops = []
    for x, name, n in zip(block_mask.arrays, ("kv_num_blocks", "kv_indices",
                                              "full_kv_num_blocks", "full_kv_indices"),
                          (3, 4, 3, 4)):
        op = describe(x, f"block_mask.{name}", dtypes=("int32",))
        mb, mh = op.shape[:2] if op.ndim == n else (0, 0)
        want = (nq, nk)[:n - 2]
        if op.ndim != n or mb not in (1, batch) or mh not in (1, heads) \
                or op.shape[2:] != want:
            raise ValueError(f"block_mask.{name} must have shape (batch {batch} or 1, heads "
                             f"{heads} or 1, {', '.join(map(str, want))}) for block size "
                             f"{(bq, bk)}, got {op.shape}")
        ops.append(op)
    if block_mask.q_arrays is not None:   # the transposed lists: (…, key blocks[, query])
        for x, name, n in zip(block_mask.q_arrays, ("q_num_blocks", "q_indices",
                                                    "full_q_num_blocks", "full_q_indices"),
                              (3, 4, 3, 4)):
            op = describe(x, f"block_mask.{name}", dtypes=("int32",))
            want = (nk, nq)[:n - 2]
            if op.ndim != n or op.shape[2:] != want:
                raise ValueError(f"block_mask.{name} must have shape (batch, heads, "
                                 f"{', '.join(map(str, want))}) for block size {(bq, bk)}, "
                                 f"got {op.shape}")
            ops.append(op)
    if len({op.shape[:2] for op in ops}) != 1:
        raise ValueError(f"block_mask: its arrays' (batch, heads) differ: "
                         f"{[op.shape[:2] for op in ops]}")
    arrays.same_device(describe(like, "q", dtypes=arrays.DTYPES), *ops)
    return mask_mod, mod_args, ops[:4]


def reads_bits(block_mask, mask_mod, mod_args, by_key: bool = False) -> bool:
    """Whether ``flash_attention(..., block_mask=, mask_mod=, mod_args=)`` reads the mask's
    ``partial_bits`` (``by_key``: the backward, which reads ``partial_bits_t`` too) in place of
    calling ``mask_mod``: a :class:`BlockMask` with them, and a call that gives no other
    function and no ``mod_args`` but the mask's own objects (the bits are the function's value
    for those)."""
    if not isinstance(block_mask, BlockMask) or block_mask.partial_bits is None or \
            (by_key and block_mask.partial_bits_t is None):
        return False
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        return False
    if mod_args is None or (isinstance(mod_args, (tuple, list)) and not mod_args):
        return True
    own = tuple(block_mask.mod_args or ())
    return isinstance(mod_args, (tuple, list)) and len(mod_args) == len(own) and \
        all(x is y for x, y in zip(mod_args, own))


def check_partial_bits(block_mask, batch: int, heads: int, by_key: bool = False):
    """The Operand of a checked block mask's ``partial_bits`` (``by_key``:
    ``partial_bits_t``; :func:`check_block_mask` first); ``TypeError`` / ``ValueError``
    unless uint32 of shape ``(batch or 1, heads or 1, query blocks · block_q, key blocks ·
    block_k / 32)`` (by key: ``(…, key blocks · block_k, query blocks · block_q / 32)``) with
    the lists' (batch, heads), on their device."""
    bq, bk = block_sizes(block_mask.block_size)
    name = "partial_bits_t" if by_key else "partial_bits"
    if bq % 32 or bk % 32:
        raise ValueError(f"block_mask.{name}: the block size {(bq, bk)} must be multiples of 32")
    sq, sk = block_mask.seq_lengths
    x = block_mask.partial_bits_t if by_key else block_mask.partial_bits
    op = describe(x, f"block_mask.{name}", dtypes=("uint32",))
    lists = describe(block_mask.kv_num_blocks, "block_mask.kv_num_blocks", dtypes=("int32",))
    rows, words = -(-sq // bq) * bq, -(-sk // bk) * bk // 32
    if by_key:
        rows, words = words * 32, rows // 32
    want = (*lists.shape[:2], rows, words)
    if op.shape != want or want[0] not in (1, batch) or want[1] not in (1, heads):
        raise ValueError(f"block_mask.{name} must have shape {want} (the lists' batch and "
                         f"heads, then {'keys, query words' if by_key else 'rows, key words'} "
                         f"of whole blocks), got {op.shape}")
    arrays.same_device(lists, op)
    return op


def mask_views(ops, batch: int, heads: int):
    """The block mask's arrays as the kernels' ``(num, idx, full_num, full_idx)`` views over
    (batch, heads, …), a zero stride along a dimension of 1 (one mask for all)."""
    views = []
    for op in ops:
        view = arrays.raw_view(op)
        shape = (batch, heads) + tuple(view.shape[2:])
        strides = tuple(0 if n == 1 and want > 1 else s
                        for n, want, s in zip(view.shape[:2], (batch, heads),
                                              view.strides[:2])) + tuple(view.strides[2:])
        views.append(device_view(arrays.restride(view, shape, strides)))
    return tuple(views)


# ---- masks made by the op itself --------------------------------------------------------------

#: The most block masks :func:`cached_block_mask` keeps (least recently used dropped first).
CACHE_SIZE = 32
_CACHE: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def makes_own_mask(mask_mod, mod_args, window) -> bool:
    """Whether an attention call without a block mask gets one made by the op
    (:func:`cached_block_mask`): a ``mask_mod`` whose ``mod_args`` hold no array (numbers
    only), and no window (``window`` the checked ``(left, right)``)."""
    return (mask_mod is not None and tuple(window) == (-1, -1)
            and all(isinstance(x, (bool, int, float, np.generic)) for x in mod_args or ()))


def cached_block_mask(mask_mod, mod_args, batch: int, heads: int, sq: int, sk: int,
                      block_size, like):
    """The block mask ``flash_attention`` makes for a ``mask_mod`` whose ``mod_args`` hold no
    array (numbers only: a function of the indices and those, so one mask per shape serves
    every call): made once per (function, numbers, shape, block size, device) and kept
    (:data:`CACHE_SIZE` at most), the device synchronised once after making it so that calls
    on any stream read it whole. None while the caller's stream is being captured into a
    CUDA graph and no mask is kept yet (the attention then visits every key block: a mask
    made inside a capture would live in the graph's memory)."""
    L = describe(like, "q", dtypes=arrays.DTYPES)
    key = (mask_mod, tuple((type(x), x) for x in (mod_args or ())), batch, heads, sq, sk,
           tuple(block_size), L.family, L.device)
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    if stream_capturing(arrays.stream_handle(L)):
        return None
    mask = create_block_mask(mask_mod, batch, heads, sq, sk, like=like, mod_args=mod_args,
                             block_size=block_size)
    # kept for calls on any stream: made on this one, so finished before any other reads it
    # (once per shape; the device synchronisation costs nothing per call)
    if not arrays.SIMULATOR:
        with arrays.on_device(L.device):
            cuda.synchronize()
    with _LOCK:
        _CACHE[key] = mask
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return mask


# ---- offline compile reports ------------------------------------------------------------------

def _probe_causal(b, h, q_idx, kv_idx):
    """The compile reports' mask function (causal, written as a user would)."""
    return kv_idx <= q_idx


def _sparse_argtypes(base, layout: str = "A"):
    """``base`` (a kernel's argument types, empty hook arguments last) with a block-sparse
    kernel's hargs: (the empty hook arguments, the mask's four int32 arrays)."""
    from numba import types

    n3, n4 = types.Array(types.int32, 3, layout), types.Array(types.int32, 4, layout)
    return base[:-1] + (types.Tuple((base[-1], types.Tuple((n3, n4, n3, n4)))),)


#: Block-sparse kernels of :func:`compile_reports`: (name, head_dim, tile rows, tile keys,
#: mask block) — the grid TMA kernel of the built-in d128 config (ping-pong, producer) under
#: 128 × 128 mask blocks, also reading a block mask's ``partial_bits`` (``_bits``) in place of
#: the function, and under 128 × 256 ones (two key tiles a mask block), its persistent
#: kernel (``tilepy.ops.attention.SPARSE_PERSISTENT``, the default) under 128 × 128, with the
#: function and with the bitmap, and the
#: mma.sync kernel of the built-in d128 config.
SPARSE_REPORTS = (("attention_wgmma_tma_pingpong_producer_sparse_d128_128x128", 128, 128, 128,
                   (128, 128)),
                  ("attention_wgmma_tma_pingpong_producer_sparse_bits_d128_128x128", 128, 128,
                   128, (128, 128)),
                  ("attention_wgmma_tma_pingpong_producer_sparse_d128_128x128_mask256", 128,
                   128, 128, (128, 256)),
                  ("attention_wgmma_tma_pingpong_producer_persistent_sparse_d128_128x128", 128,
                   128, 128, (128, 128)),
                  ("attention_wgmma_tma_pingpong_producer_persistent_sparse_bits_d128_128x128",
                   128, 128, 128, (128, 128)),
                  ("attention_sparse_d128_f16_lse", 128, 64, 64, (128, 128)))


#: Block-sparse backward kernels of :func:`compile_reports` (mma.sync, a causal mask function,
#: 128 × 128 mask blocks): (name, kernel, head_dim, sparse) — the dK / dV kernel (atomic dQ)
#: and the dQ kernel of the GPU configs, each also dense with the same hook (the reference
#: for their registers and spills).
SPARSE_BACKWARD_REPORTS = tuple(
    (f"attention_backward_{kind}_d{d}{'_sparse' if sparse else '_dense'}", kind, d, sparse)
    for d in (64, 128) for kind in ("dkdv", "dq") for sparse in (True, False))


#: The warp-specialised wgmma backward kernel of the built-in d128 choice under 128 × 128 mask
#: blocks (a causal mask function), in :func:`compile_reports`.
WS_SPARSE_REPORT = "attention_backward_wgmma_ws_d128_sparse"


#: The kernels of :data:`SPARSE_REPORTS` and :data:`SPARSE_BACKWARD_REPORTS` in
#: :func:`compile_reports`' ``extended`` group: the grid TMA kernels (the persistent one is the
#: default) and the backward's mma.sync pairs at head_dim 64.
EXTENDED_REPORTS = frozenset(
    [n for n, *_ in SPARSE_REPORTS if n.startswith("attention_wgmma") and "persistent" not in n]
    + [n for n, _, d, _ in SPARSE_BACKWARD_REPORTS if d == 64])


def compile_reports(group: str = "core"):
    """Offline sm_90a reports of the block-sparse attention kernels (:data:`SPARSE_REPORTS`,
    a causal mask function, LSE), of the block-sparse backward kernels
    (:data:`SPARSE_BACKWARD_REPORTS`, :data:`WS_SPARSE_REPORT`) and of the block mask's own
    kernel for it (with and without the bitmaps). ``group``: ``"core"`` all but
    :data:`EXTENDED_REPORTS`, ``"extended"`` those, ``"all"`` both."""
    if group not in ("core", "extended", "all"):
        raise ValueError(f"compile_reports: group must be 'core', 'extended' or 'all', "
                         f"got {group!r}")
    return _compile_reports(lambda name: group == "all" or (
        name in EXTENDED_REPORTS) == (group == "extended"))


def compile_reports_extended():
    """:func:`compile_reports` of the ``extended`` group (a ``run_in_subprocess`` target)."""
    return compile_reports("extended")


def _compile_reports(want):
    """:func:`compile_reports` of the kernels whose names ``want`` takes."""
    from numba import types

    from ..offline import report_entry
    from ..tile.attention import score_hook
    from . import attention_mma_sync as fa
    from . import attention_wgmma as aw

    hook = score_hook(0.0, None, _probe_causal)
    bits_hook = score_hook(0.0, None, None, mask_bits=True)
    words = types.Tuple((types.Array(types.uint32, 4, "A"),))   # the hook's bitmap
    out = []
    for name, d, bm, bn, block in SPARSE_REPORTS:
        if not want(name):
            continue
        if name.startswith("attention_wgmma"):
            cfg = aw.WgmmaAttentionConfig(d, bm, bn, overlap=True, tma=True, pingpong=True,
                                          producer=True, persistent="persistent" in name)
            bits = "_bits_" in name
            make = (lambda cfg=cfg, block=block, bits=bits: aw.wgmma_attention_kernel(
                cfg, False, True, None, bits_hook if bits else hook, mask_block=block,
                full_score_mod=None))
            base = aw.kernel_argtypes(cfg)
            if bits:
                base = base[:-1] + (words,)
            out.append(report_entry(
                name, make, _sparse_argtypes(base), (9, 0, "a"),
                threads=cfg.threads, launch_bounds=(cfg.threads, 1), config=cfg.describe(),
                smem_bytes=aw.smem_bytes_of(make(), cfg)))
        else:
            cfg = fa.AttentionConfig(d, bm, bn, 16, "float16")
            out.append(report_entry(
                name, lambda cfg=cfg, block=block: fa.attention_kernel(
                    cfg, False, True, None, hook, mask_block=block),
                _sparse_argtypes(fa.argtypes()), (9, 0), threads=cfg.threads,
                config=cfg.describe(), smem_bytes=cfg.smem_bytes))
    from . import attention_backward as ab
    from . import attention_backward_mma_sync as bk

    mods = (None, None, _probe_causal)
    for name, kind, d, sparse in SPARSE_BACKWARD_REPORTS:
        if not want(name):
            continue
        cfg = bk.BackwardConfig(d, dtype="float16", **ab.GPU_BLOCKS[d])
        block = (128, 128) if sparse else None
        base = bk.argtypes(kind)
        if kind == "dkdv":
            make = (lambda cfg=cfg, block=block: bk.dkdv_kernel(cfg, False, True, None, 0.0,
                                                                 mods, mask_block=block))
            threads, smem = 32 * cfg.warps, cfg.dkdv_layout(True).nbytes
        else:
            make = (lambda cfg=cfg, block=block: bk.dq_kernel(cfg, False, None, 0.0, mods,
                                                              mask_block=block))
            threads, smem = 32 * cfg.dq_warps, cfg.dq_smem_bytes
        out.append(report_entry(name, make, _sparse_argtypes(base) if sparse else base,
                                (9, 0), threads=threads, config=cfg.describe(),
                                smem_bytes=smem))
    from . import attention_backward_wgmma as bw

    cfg = bw.WgmmaBackwardConfig(128, dtype="bfloat16", **ab.HOPPER_FUSED[128])
    if want(WS_SPARSE_REPORT):
        out.append(report_entry(
            WS_SPARSE_REPORT, lambda: bw.dkdv_ws_kernel(cfg, False, None, 0.0, mods,
                                                         mask_block=(128, 128)),
            _sparse_argtypes(bk.argtypes("dkdv")), (9, 0, "a"), threads=cfg.threads,
            launch_bounds=(cfg.threads, 1), config=cfg.describe(),
            smem_bytes=cfg.dkdv_layout.nbytes))
    n3, n4 = types.Array(types.int32, 3, "A"), types.Array(types.int32, 4, "A")
    # (the bitmaps' kernel at the largest blocks: its shared memory grows with block_q)
    for bits, block in ((False, 128), (True, 1024)):
        name = f"block_mask_{block}x{block}" + ("_bits" if bits else "")
        if not want(name):
            continue
        out.append(report_entry(
            name,
            lambda bits=bits, block=block: block_mask_kernel(mask_visible(_probe_causal), block,
                                                             block, bits),
            (types.int64, types.int64, n3, n4, n3, n4, types.Tuple(()))
            + ((types.Array(types.uint32, 4, "A"),) * 2 if bits else ()), (9, 0),
            threads=block))
    return out


__all__ = ["BLOCK_SIZE", "BlockMask", "CACHE_SIZE", "block_mask_kernel", "block_sizes",
           "cached_block_mask", "check_block_mask", "compile_reports", "create_block_mask",
           "EXTENDED_REPORTS",
           "makes_own_mask", "PARTIAL_BITS_LIMIT", "check_partial_bits", "reads_bits",
           "mask_views", "SPARSE_BACKWARD_REPORTS", "SPARSE_REPORTS", "transpose_kernel",
           "WS_SPARSE_REPORT"]
