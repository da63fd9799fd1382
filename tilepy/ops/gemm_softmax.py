"""``tilepy.gemm_softmax``: ``softmax(scale · a @ b, axis=-1)`` in one tensor-core kernel.

Validation and layout handling on the host (the rules and errors of :func:`tilepy.gemm`), then
one launch of :mod:`tilepy.ops.gemm_softmax_mma_sync` on the inputs' device and the caller's
current stream. The kernel and its two ways of parking the unnormalised rows are described
there; this module picks the config:

* rows that fit in shared memory next to the GEMM pipeline (``park="smem"``, N up to about
  1104 with the 64-row block at 4 stages, 1264 at 3 stages, on sm_90) are kept on chip until
  they are final — the output is written once;
* longer rows (``park="global"``) go to ``out`` unnormalised and are rescaled in place by the
  same block at the end (one more read and write of its rows, mostly from L2): correct for any
  N, slower. :data:`ON_CHIP_MAX_N` caps the first path (tests lower it to force the second).

A smaller block (16 or 32 rows) keeps rows of up to ~5600 / ~2700 columns on chip, but then
every 16 (32) rows read all of ``b`` again and the main loop is bound by shared-memory and L2
bandwidth rather than the tensor cores; :data:`ON_CHIP_MIN_BLOCK_M` (default 64) is the
smallest block the built-in choice uses for the on-chip path. Pass ``config=`` to try others.
"""

from __future__ import annotations

import math

import numpy as np

from .. import arrays, launch
from ..arrays import describe, kernel_view
from ..launch import PlanCache
from ..tile import device_write
from ..tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout
from . import gemm_softmax_mma_sync as gsk
from . import gemm_softmax_wgmma as gsw
from . import gemm_wgmma_ws as ws
from .gemm_softmax_mma_sync import GemmSoftmaxConfig
from .gemm_wgmma_ws import WsConfig

#: Rows longer than this never take the on-chip path, even where a config would fit.
ON_CHIP_MAX_N = 1 << 30
#: The smallest block (rows) the built-in choice uses to keep rows on chip.
ON_CHIP_MIN_BLOCK_M = 64

# GPU: a 64-row block of 4 warps side by side (64 x 64 warp tiles, as the plain GEMM's LARGE
# config) sweeping N in 256-column tiles; 4 stages where the parked rows leave room, else 3.
# Smaller blocks only when ON_CHIP_MIN_BLOCK_M allows them.
_ON_CHIP_GPU = (
    GemmConfig(BlockTile(64, 256, 32), WarpLayout(1, 4), Pipeline(4)),
    GemmConfig(BlockTile(64, 256, 32), WarpLayout(1, 4), Pipeline(3)),
    GemmConfig(BlockTile(32, 256, 32), WarpLayout(1, 4), Pipeline(3)),
    GemmConfig(BlockTile(16, 128, 64), WarpLayout(1, 4), Pipeline(3)),
)
# Long rows: the same main loop at 3 stages; 96 KB of shared memory and 240 registers, so two
# blocks share an SM and one's epilogue overlaps the other's main loop.
_GLOBAL_GPU = GemmConfig(BlockTile(64, 256, 32), WarpLayout(1, 4), Pipeline(3))
# Timed by main() too: a 128-row block of 8 warps (one block per SM).
_GLOBAL_ALTERNATIVES = (GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 4), Pipeline(3)),)
# Simulator: every thread is a Python thread: the smallest real pipeline, two warps side by
# side along N (so the warps' row statistics are combined), 32-column tiles.
SIMULATOR_CONFIG = GemmConfig(BlockTile(32, 32, 16), WarpLayout(1, 2), Pipeline(2))


#: The built-in choice on compute capability 9.0: the TMA + wgmma kernel's softmax mode with
#: TMA-stored output, ahead of the mma.sync kernel (bench/NOTES.md: gemm_softmax).
HOPPER_CONFIG = (128, 256, 3)


def choose_config(n: int, dtype: str, *, simulator: bool | None = None,
                  hopper: bool | None = None, tma_out: bool = True):
    """The built-in choice for rows of ``n`` columns (``simulator``: the choice for the CUDA
    simulator; ``hopper``: for a compute capability 9.0 GPU; defaults: this process's target
    and device, ``TILEPY_HOPPER=0`` turning the Hopper kernels off).

    On sm_90, rows of at most 4096 columns whose output TMA can store (``tma_out``: unit column
    stride, 16-byte rows and start) take the TMA + wgmma kernel's softmax mode (a
    :class:`~tilepy.ops.gemm_wgmma_ws.WsConfig`); everything else the mma.sync kernel, its rows
    on chip where allowed and they fit (a :class:`GemmSoftmaxConfig`)."""
    sim = arrays.SIMULATOR if simulator is None else simulator
    if hopper is None:
        hopper = not sim and launch.is_hopper()
    bm, bn, st = HOPPER_CONFIG
    if hopper and tma_out and n <= gsw.SOFTMAX_CHUNKS * bn:
        return WsConfig(bm, bn, st, dtype, persistent=True, smem_epilogue=True)
    if sim:
        candidates, fallback = (SIMULATOR_CONFIG,), SIMULATOR_CONFIG
    else:
        candidates = tuple(c for c in _ON_CHIP_GPU if c.block.m >= ON_CHIP_MIN_BLOCK_M)
        fallback = _GLOBAL_GPU
    if n <= ON_CHIP_MAX_N:
        for base in candidates:
            cfg = GemmSoftmaxConfig(_with_dtype(base, dtype), "smem")
            if cfg.fits(n):
                return cfg
    return GemmSoftmaxConfig(_with_dtype(fallback, dtype), "global")


def _with_dtype(base: GemmConfig, dtype: str) -> GemmConfig:
    return GemmConfig(base.block, base.warps, base.pipeline, dtype, base.swizzle, base.cc)


def _row_major_aligned(op) -> bool:
    """Unit column stride, 16-byte row stride and base: what cp.async reads in place."""
    cols = op.shape[1]
    s_row, s_col = op.strides
    return ((s_col == 1 or cols == 1) and (s_row * 2) % 16 == 0
            and op.byte_pointer() % 16 == 0)


def _col_major_aligned(op) -> bool:
    rows = op.shape[0]
    s_row, s_col = op.strides
    return ((s_row == 1 or rows == 1) and (s_col * 2) % 16 == 0
            and op.byte_pointer() % 16 == 0)


def gemm_softmax(a, b, *, scale=1.0, out=None, config=None):
    """``softmax(scale · a @ b, axis=-1)`` — the product and the softmax in one kernel.

    * ``a`` (M, K) and ``b`` (K, N), both float16 or both bfloat16; the result (M, N) has their
      dtype. Products are accumulated and the softmax computed in float32 (``exp`` is
      ``ex2.approx``); the unnormalised values are held as 16-bit numbers in between, so the
      result carries at most about one more rounding of the dtype than a float32 softmax
      rounded once. float32 inputs are refused (``TypeError``): use ``tilepy.gemm`` with
      ``tilepy.softmax``.
    * Any M, N, K >= 1 (edges need not be multiples of a tile); M = 0 or N = 0 give an empty
      result, K = 0 the softmax of zeros (uniform rows).
    * ``scale``: any finite float (negative and 0 included).
    * Rows are kept in shared memory until final when they fit (N up to 1264 on
      sm_90 with the built-in configs); longer rows are written unnormalised and rescaled in a
      second sweep by the same kernel, through global memory (L2): one launch either way, same
      result, the second slower. See :mod:`tilepy.ops.gemm_softmax`.
    * Row-major inputs, and a column-major ``b`` (a transposed view, e.g. ``k.T``), are read in
      place; other strides, or rows not 16-byte aligned (K or N not a multiple of 8 for
      row-major data), are first copied into an aligned buffer.
    * ``out``: (M, N) of the input dtype, any strides; must not overlap ``a`` or ``b``.
    * ``config``: a :class:`tilepy.ops.gemm_softmax_mma_sync.GemmSoftmaxConfig` to override the
      built-in choice (its dtype must match; it must fit in shared memory for this N), or a
      :class:`tilepy.ops.gemm_wgmma_ws.WsConfig` (persistent, ``smem_epilogue``, 128 rows in
      two consumers) for the TMA + wgmma kernel's softmax mode (compute capability 9.0; N up
      to 16 × ``block_n``; see :func:`tilepy.ops.gemm_wgmma_ws.wgmma_ws_gemm_kernel`).
    * The built-in choice (:func:`choose_config`): on a compute capability 9.0 GPU, rows of up
      to 4096 columns whose ``out`` TMA can store (unit column stride, rows and start 16-byte
      aligned — a fresh result when N is a multiple of 8) take that TMA + wgmma kernel: it
      parks each 256-column chunk's exponentials in ``out``, stores the last one final and
      rescales the others at the end through shared memory. Otherwise the mma.sync kernel.
    * CuPy arrays, PyTorch tensors, Numba device arrays (NumPy arrays in the simulator); the
      result is of the same kind, on the inputs' device, computed on the caller's current
      stream. Errors are raised before anything is launched.
    * A call whose arrays have the same kinds, dtypes, shapes, strides, device and alignment,
      and the same ``config``, as an earlier call reuses that call's launch plan
      (:mod:`tilepy.launch`): only the pointers and ``scale`` change (and, with a fresh
      result or ``park="global"``, arrays are allocated through the caller's framework).
      Calls whose inputs needed an aligned copy build their launch afresh.
    """
    fa, pa = arrays.fingerprint(a)
    fb, pb = arrays.fingerprint(b)
    fo, po = arrays.fingerprint(out)
    cached, key = _PLANS.lookup((fa, fb, fo, config, ON_CHIP_MAX_N, ON_CHIP_MIN_BLOCK_M))
    if cached is not None:
        done = cached(out, pa, pb, po, _checked_scale(scale))
        if done is not None:
            return done
        key = None   # a fresh out aligned unlike the plan's: launch afresh, cache nothing
    return _gemm_softmax(a, b, scale, out, config, key)


def _checked_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) and not hasattr(
            scale, "__float__"):
        raise TypeError(f"scale must be a float, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return scale


class _Cached:
    """A launch plan bound to gemm_softmax's operands (a, b, out, seg_max) and what a call
    needs besides: the stream getter, an allocator of ``out`` when the caller passes none (and
    the 16-byte alignment the plan was built for), an allocator of the float32 ``seg_max``
    scratch (``park="global"``; one per call, so calls on different streams share none), and
    the kernel's scalars as a function of ``scale``."""

    def __init__(self, bound, stream, alloc_out, out_align, alloc_seg, scalars):
        self.bound, self.stream = bound, stream
        self.alloc_out, self.out_align = alloc_out, out_align
        self.alloc_seg, self.scalars = alloc_seg, scalars

    def __call__(self, out, pa, pb, po, scale):
        """The result, or None when a fresh ``out`` is not aligned as the plan needs."""
        if out is None:
            out, po = self.alloc_out()
            if po % 16 != self.out_align:
                return None
        seg, ps = self.alloc_seg() if self.alloc_seg is not None else (None, 0)
        stream = self.stream()
        self.bound(stream, [pa, pb, po, ps], self.scalars(scale))
        if seg is not None:
            device_write.keep_during_capture(stream, seg)
        del seg     # stream-ordered allocators: freeing after the launch is enqueued is safe
        return out


_PLANS = PlanCache()


def output_spec(a, b, *, scale=1.0, out=None, config=None):
    """``(shape, dtype name)`` of ``gemm_softmax``'s result for these arguments, after every
    check ``gemm_softmax`` makes before launching (the same errors); reads only shapes,
    strides, dtypes and devices, so it also takes PyTorch fake tensors (the registered
    operator's meta function)."""
    _, _, _, dtype, (m, n, _), _, _ = _check(a, b, scale, out, config)
    return (m, n), dtype


def _check(a, b, scale, out, config):
    """Validate ``gemm_softmax``'s arguments: ``(A, B, Out or None, dtype, (m, n, k), scale as
    a float, device)``."""
    A = describe(a, "a", allow_float32=False)
    B = describe(b, "b", allow_float32=False)
    if A.dtype != B.dtype:
        raise TypeError(f"a and b must have the same dtype; got a {A.dtype} and b {B.dtype}")
    dtype = A.dtype
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"a and b must be 2-D matrices; got shapes {A.shape} and {B.shape}")
    m, k = A.shape
    k2, n = B.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a {A.shape} @ b {B.shape} ({k} != {k2})")
    scale = _checked_scale(scale)
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None:
        if Out.shape != (m, n):
            raise ValueError(f"out must have shape {(m, n)}, got {Out.shape}")
        if Out.dtype != dtype:
            raise ValueError(f"out must have dtype {dtype}, got {Out.dtype}")
    device = arrays.same_device(A, B, Out)
    if isinstance(config, WsConfig):
        _check_ws_config(config, dtype, n, device)
    elif config is not None:
        if not isinstance(config, GemmSoftmaxConfig):
            raise TypeError(f"config must be a tilepy.ops.gemm_softmax_mma_sync."
                            f"GemmSoftmaxConfig or a tilepy.ops.gemm_wgmma_ws.WsConfig, got "
                            f"{type(config).__name__}")
        if config.gemm.dtype != dtype:
            raise ValueError(f"config is for {config.gemm.dtype}, inputs are {dtype}")
        if not config.fits(max(n, 1)):
            raise ValueError(f"config needs {config.smem_bytes(n)} B of shared memory at "
                             f"N={n}, more than a block may use: {config.describe()}")
    return A, B, Out, dtype, (m, n, k), scale, device


def _gemm_softmax(a, b, scale, out, config, key):
    A, B, Out, dtype, (m, n, k), scale, device = _check(a, b, scale, out, config)
    with arrays.on_device(device):
        caller_out = out is not None
        if out is None:
            out = arrays.empty(A, (m, n), dtype)
            Out = describe(out, "out")
        if m == 0 or n == 0:
            return out
        cached = _run(A, B, Out, config, m, n, k, scale, device)
        if cached is not None:
            bound, alloc_seg, scalars = cached
            alloc_out = None if caller_out else arrays.allocator(A, (m, n), dtype)
            _PLANS.put(key, _Cached(bound, arrays.stream_getter(A), alloc_out,
                                    Out.byte_pointer() % 16, alloc_seg, scalars))
        return out


def _tma_scalars(scale: float):
    """The TMA kernel's scalars (alpha, beta): ``scale`` and 0."""
    return (np.float32(scale), np.float32(0.0))


def _run(A, B, Out, cfg, m, n, k, scale, device):
    """Launch; return ``(the plan bound to (a, b, out, seg_max), the seg_max allocator or None,
    the scalars of a scale)`` for later calls of this signature, or None when an input needed
    a copy (an aligned one, or zeros for K = 0)."""
    with arrays.on_device(device):
        # the built-in choice asks the inputs' device (compute capability 9.0 or not)
        cfg = cfg or choose_config(n, A.dtype, tma_out=_row_major_aligned(Out))
        stream = arrays.stream_handle(A)
        a_ptr, b_ptr, o_ptr = A.byte_pointer(), B.byte_pointer(), Out.byte_pointer()
        reusable = True
        if k == 0:  # a @ b is zeros: run on K = 8 zeros (uniform rows)
            A = describe(arrays.zeros_like_matrix(A, m, 8), "a")
            B = describe(arrays.zeros_like_matrix(B, 8, n), "b")
            reusable = False
        if not _row_major_aligned(A):
            A = describe(arrays.copy_aligned(A), "a")
            reusable = False
        b_k_major = True
        if _col_major_aligned(B) and not _row_major_aligned(B):
            b_k_major = False
        elif not _row_major_aligned(B):
            B = describe(arrays.copy_aligned(B), "b")
            reusable = False
        if isinstance(cfg, WsConfig):
            out_v = kernel_view(Out, 3)
            # the output's own tensor map (TMA stores) when TMA can describe it; 128-column
            # chunks overlap each chunk's softmax with the next one's MMAs where K allows
            tma_out = _row_major_aligned(Out)
            overlap = (tma_out and cfg.block_n == 128 and cfg.stages >= 3
                       and -(-k // ws.BK) >= cfg.stages - 1)
            kern = gsw.gemm_softmax_wgmma_kernel(cfg, b_k_major, B.dtype, tma_out=tma_out,
                                                 overlap=overlap)
            plan, args = ws.plan(kern, cfg, kernel_view(A, 3), kernel_view(
                B, 3, swap_last=not b_k_major), out_v, out_v, arrays.placeholder(1),
                *_tma_scalars(scale), stream=stream, alloc=arrays.byte_allocator(A))
            plan.launch(stream, args)
            if not reusable:   # copies the launch reads, when a CUDA graph captured it
                device_write.keep_during_capture(stream, A, B)
                return None
            # a, b, out, c (= out), bias (a placeholder); the plan supplies the maps
            return (plan.bind([(0, a_ptr), (1, b_ptr), (2, o_ptr), (2, o_ptr), None]), None,
                    _tma_scalars)
        b_view = kernel_view(B, swap_last=not b_k_major)  # column-major: (N, K) row-major
        alloc_seg, seg_src = None, None
        if cfg.park == "global":
            alloc_seg = arrays.allocator(
                A, (gsk.grid(cfg, m) * cfg.gemm.block.m, cfg.segments(n)), "float32")
            seg, seg_ptr = alloc_seg()
            seg_max, seg_src = kernel_view(describe(seg, "seg")), (3, seg_ptr)
        else:
            seg_max = arrays.placeholder(2)
        out_v, pairs = _out_view(Out, n)
        kern = gsk.gemm_softmax_kernel(cfg, b_k_major, pairs)
        plan, args = gsk.plan(kern, cfg, kernel_view(A), b_view, out_v, seg_max, scale, n)
        plan.launch(stream, args)
        # the scratch and any copies, when a CUDA graph captured the launch
        device_write.keep_during_capture(stream, seg if cfg.park == "global" else None,
                                         *((A, B) if not reusable else ()))
    if not reusable:
        return None
    return (plan.bind([(0, a_ptr), (1, b_ptr), (2, o_ptr), seg_src]), alloc_seg, gsk.scalars)


def _check_ws_config(cfg, dtype: str, n: int, device=None):
    """A WsConfig for the TMA kernel's softmax mode: refused before launch if it cannot run."""
    if cfg.dtype != dtype:
        raise ValueError(f"config is for {cfg.dtype}, inputs are {dtype}")
    try:
        gsw.check_softmax_config(cfg, dtype)
    except ValueError as e:
        raise ValueError(f"config: {e}") from None
    if n > gsw.SOFTMAX_CHUNKS * cfg.block_n:
        raise ValueError(f"config: the TMA softmax mode takes rows of at most "
                         f"{gsw.SOFTMAX_CHUNKS * cfg.block_n} columns, got {n}")
    if not arrays.SIMULATOR:
        if launch.compute_capability(device) != (9, 0):
            raise ValueError("config: a WsConfig needs a compute capability 9.0 GPU")


def _out_view(Out, n: int):
    """``(view, pairs)``: ``out`` as the kernel writes it — uint32 words, one per column pair,
    when N is even and the rows are 4-byte aligned (half the stores), else uint16 elements."""
    s_row, s_col = Out.strides
    if n % 2 or s_col != 1 or s_row % 2 or Out.byte_pointer() % 4:
        return kernel_view(Out), False
    view = arrays.raw_view(Out)
    if isinstance(view, np.ndarray):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(view.view(np.uint32)), True
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape=(Out.shape[0], n // 2), strides=(view.strides[0], 4),
                         dtype=np.dtype(np.uint32), stream=view.stream,
                         gpu_data=view.gpu_data), True


def candidates(n: int, dtype: str) -> list:
    """Every GPU config worth timing for rows of ``n``: the on-chip ones that fit, and the
    long-row ones."""
    out = [GemmSoftmaxConfig(_with_dtype(c, dtype), "smem") for c in _ON_CHIP_GPU]
    out = [c for c in out if c.fits(n)]
    for base in (_GLOBAL_GPU, *_GLOBAL_ALTERNATIVES):
        out.append(GemmSoftmaxConfig(_with_dtype(base, dtype), "global"))
    if n <= gsw.SOFTMAX_CHUNKS * 256:
        out.append(WsConfig(128, 256, 3, dtype, persistent=True, smem_epilogue=True))
    return out


def main(argv=None) -> int:
    """``python -m tilepy.ops.gemm_softmax [--m M --n N --k K --dtype D]``: on the GPU, time
    every candidate config against ``tilepy.gemm`` followed by ``tilepy.softmax`` (PyTorch
    tensors, CUDA events, one run) and check each result against the first."""
    import argparse

    import torch

    from ..ops.gemm import gemm
    from ..ops.softmax import softmax
    from ..testing.timing import time_cuda

    p = argparse.ArgumentParser(prog="python -m tilepy.ops.gemm_softmax")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args(argv)
    m, n, k = args.m, args.n, args.k
    tdt = getattr(torch, args.dtype)
    a = torch.randn(m, k, device="cuda", dtype=tdt)
    b = torch.randn(k, n, device="cuda", dtype=tdt)
    scale = 1 / math.sqrt(k)
    out = torch.empty(m, n, device="cuda", dtype=tdt)
    tmp = torch.empty_like(out)
    want = torch.softmax(scale * (a.float() @ b.float()), -1)

    def unfused():
        gemm(a, b, alpha=scale, out=tmp)
        softmax(tmp, out=tmp)

    t_ref = time_cuda(unfused, repeat=args.repeat)
    flops = 2 * m * n * k
    print(f"M={m} N={n} K={k} {args.dtype}; built-in choice: "
          f"{choose_config(n, args.dtype, simulator=False).describe(n)}")
    print(f"{'gemm + softmax':62s} {t_ref * 1e3:9.1f} us {flops / t_ref / 1e9:7.0f} TFLOPS")
    for cfg in candidates(n, args.dtype):
        def fused(cfg=cfg):
            gemm_softmax(a, b, scale=scale, out=out, config=cfg)

        t = time_cuda(fused, repeat=args.repeat)
        err = float((out.float() - want).abs().max())
        if isinstance(cfg, WsConfig):
            name = f"tma    {cfg.describe()}"[:62]
        else:
            g = cfg.gemm
            name = (f"{cfg.park:6s} {g.block.m}x{g.block.n}x{g.block.k} {g.warps.m}x"
                    f"{g.warps.n} warps {g.pipeline.stages} st, {cfg.smem_bytes(n) // 1024} KB")
        print(f"{name:62s} {t * 1e3:9.1f} us {flops / t / 1e9:7.0f} TFLOPS {t_ref / t:5.2f}x "
              f"max err {err:.2e}")
    return 0


__all__ = ["choose_config", "gemm_softmax", "output_spec"]

if __name__ == "__main__":
    raise SystemExit(main())
