"""``tilepy.quantize_fp8``: a float16 / bfloat16 / float32 matrix as 8-bit float codes and the
float32 scales that bring them back, in the shapes the FP8 GEMMs take.

Validation on the host, then the CUDA-core kernels of :mod:`tilepy.ops.quantize_simt`: one
launch per group granularity (rows, 1 × 128, 128 × 128 blocks), two for one scale over the
tensor (the blocks' absolute maxima first, then the codes). An ``x`` whose rows are
contiguous and 16-byte aligned (data pointer and row stride) with K a multiple of 8 runs the
vector kernel (16-byte loads, 8-byte stores of codes, the maxima through warp shuffles); any
other ``x`` runs the scalar one.

The first call of a signature (``x``'s kind, dtype, shape, strides, device and 16-byte
alignment, the granularity and the format) checks everything, launches, and records the
launches (:class:`tilepy.launch.CallPlan`: the kernels bound to the operand slots of
:data:`SLOTS`); later calls of that signature replay them from ``x``'s data pointer, with
new result arrays (and partial maxima for ``"tensor"``) made per call. The record keeps no
reference to the caller's arrays.
"""

from __future__ import annotations

import numpy as np

from .. import arrays, launch
from ..arrays import describe
from ..launch import LaunchPlan, sm_count
from . import quantize_simt as qs

#: The formats by name, as PyTorch and ml_dtypes name them.
FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
GRANULARITIES = ("tensor", "row", (1, 128), (128, 128))
#: Warps a block of the scalar kernel (one in the simulator, where every thread is a Python
#: thread).
WARPS = 1 if arrays.SIMULATOR else 4
#: Bytes the vector kernel reads at once: the alignment of ``x``'s data and row stride it needs.
VECTOR_BYTES = 16

#: The operand slots of a recorded call (:class:`tilepy.launch.CallPlan`): the caller's ``x``,
#: then the arrays each call makes.
SLOTS = ("x", "values", "scales", "partials")
X_, VALUES, SCALES, PARTIALS = range(len(SLOTS))

_PLANS = launch.PlanCache()


def output_spec(x, *, granularity="tensor", dtype="e4m3"):
    """``(values shape, scales shape)`` after the checks that read only metadata (the
    registered operator's fake implementation)."""
    X, gran = check_arguments(x, granularity, dtype)
    return X.shape, scales_shape(X.shape, gran)


def scales_shape(shape, gran) -> tuple:
    m, k = shape
    if gran == "tensor":
        return ()
    if gran == "row":
        return (m,)
    return (-(-m // gran[0]), -(-k // gran[1]))


def check_arguments(x, granularity, dtype):
    """``(X, granularity as a str or a tuple)``; errors name the argument."""
    X = describe(x, "x")
    if dtype not in FORMATS:
        raise ValueError(f"dtype must be one of {tuple(FORMATS)}, got {dtype!r}")
    if X.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {X.shape}")
    gran = granularity if isinstance(granularity, str) or not isinstance(
        granularity, (tuple, list)) else tuple(granularity)
    if gran not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if isinstance(gran, tuple) and -(-X.shape[1] // gran[1]) > 65535:
        raise NotImplementedError(f"quantize_fp8: at most 65535 groups along K (K = "
                                  f"{X.shape[1]}, groups of {gran[1]})")
    return X, gran


def vectorizable(X) -> bool:
    """Whether the vector kernel reads ``X`` (M, K): a unit element stride, K a multiple of
    :data:`quantize_simt.CHUNK`, data pointer and row stride multiples of 16 bytes."""
    m, k = X.shape
    item = arrays.ITEMSIZE[X.dtype]
    return (k > 0 and k % qs.CHUNK == 0 and X.strides[1] == 1
            and (m == 1 or X.strides[0] * item % VECTOR_BYTES == 0)
            and X.byte_pointer() % VECTOR_BYTES == 0)


def quantize_fp8(x, *, granularity="tensor", dtype="e4m3"):
    """``(values, scales)`` with ``values · scales ≈ x`` for a 2-D ``x`` (M, K), float16,
    bfloat16 or float32.

    * ``dtype``: ``"e4m3"`` (``float8_e4m3fn``, largest finite 448) or ``"e5m2"``
      (``float8_e5m2``, 57344). ``values`` (M, K) is of that dtype for PyTorch tensors and
      NumPy arrays (ml_dtypes), of ``uint8`` codes for CuPy and Numba arrays (neither has
      the type).
    * ``granularity`` — what one scale covers, and the shape of ``scales`` (float32):
      ``"tensor"``: everything, a 0-d array; ``"row"``: each row, (M,); ``(1, 128)``: each
      1 × 128 block of a row, (M, ceil(K / 128)) (``scale_a`` of a block-scaled GEMM);
      ``(128, 128)``: each 128 × 128 block, (ceil(M / 128), ceil(K / 128)) (``scale_b``).
    * Each scale is ``amax · fl(1 / largest finite value)`` (float32; at least 2**-126) of the
      elements it covers, so the largest of them becomes ± that value; ``values = round(x ·
      fl(1 / scale))``: the product with the scale's float32 reciprocal (correctly rounded,
      once per group), rounded in float32 and then to the format to nearest even, never past
      the largest finite value. A group of zeros gets scale 1.0 and zero codes. A NaN element
      gives the NaN code; a non-finite element makes its group's scale non-finite.

    The absolute maxima are fused with the rounding: one pass over ``x`` per granularity (rows
    longer than a thread block's registers hold are read twice, the second time from L2), two
    for ``"tensor"``. CuPy arrays, PyTorch tensors, Numba device arrays (NumPy arrays in the
    simulator); errors are raised before anything is launched. A repeated call with the same
    signature replays the first one's launches (the module docstring).
    """
    fp, ptr = arrays.fingerprint(x)
    cached, key = _PLANS.lookup((fp, granularity, dtype))
    if cached is not None:
        call, stream = cached
        made = call(stream(), (ptr, 0, 0, 0))
        return made[VALUES], made[SCALES]
    return _run(x, granularity, dtype, key)


def _run(x, granularity, dtype, key):
    """The first call of a signature: every check, the launches, and the recorded call
    (:data:`_PLANS`) that later calls of the signature replay from ``x``'s pointer."""
    X, gran = check_arguments(x, granularity, dtype)
    with arrays.on_device(X.device):
        if not arrays.SIMULATOR and launch.compute_capability(X.device) < (8, 9):
            raise NotImplementedError(f"quantize_fp8 needs compute capability 8.9 or newer (the "
                                      f"float8 conversions), this GPU is "
                                      f"{'.'.join(map(str, launch.compute_capability(X.device)))}")
        m, k = X.shape
        new_values = _codes_allocator(X, dtype)
        if m == 0 or k == 0:
            # nothing to scale: every scale (a row's of no column too) is 1.0 (not recorded)
            return new_values()[0], arrays.ones(X, scales_shape(X.shape, gran))
        fast = vectorizable(X)
        allocs = {VALUES: new_values,
                  SCALES: arrays.allocator(X, scales_shape(X.shape, gran), "float32")}
        if fast:
            tiling = qs.choose_tiling(gran, X.dtype, k, arrays.SIMULATOR)
            grids = _vector_grids(gran, tiling, X.dtype, m, k)
        else:
            grids = None
        parts = (grids[-1] if fast else _fallback_blocks(m)) if gran == "tensor" else 0
        if parts:
            allocs[PARTIALS] = arrays.allocator(X, (parts,), "float32")
        made = {}
        ptrs = [X.byte_pointer(), 0, 0, 0]
        for slot, alloc in allocs.items():
            made[slot], ptrs[slot] = alloc()
        stream = arrays.stream_handle(X)
        xv = arrays.kernel_view(X)
        cv = arrays.device_view(_codes_raw(made[VALUES]))
        sv = arrays.raw_view(describe(made[SCALES], "scales"))
        sv = arrays.device_view(arrays.restride(sv, (1, 1), (4, 4)) if gran == "tensor"
                                else sv.reshape(m, 1) if gran == "row" else sv)
        pv = arrays.device_view(arrays.raw_view(describe(made[PARTIALS], "partials"))) \
            if parts else arrays.placeholder(1)
        sources = [X_, VALUES, SCALES, PARTIALS if parts else None]
        modes = ("amax", "apply") if gran == "tensor" else ("group",)
        steps = []
        for mode, grid in zip(modes, grids if fast else [None] * len(modes)):
            if fast:
                segs = grid[2] if mode == "group" else 1
                kern = qs.vector_kernel(X.dtype, dtype, mode, tiling, segs > 1)
                args = (xv, cv, sv, pv, np.int64(segs))
                plan = LaunchPlan(kern, args, grid[:2], tiling.threads)
            else:
                kern = qs.quantize_kernel(X.dtype, dtype, mode, WARPS)
                if gran == "tensor":
                    gr, gc, grid = 1, k, (parts, 1, 1)
                else:
                    gr, gc = (1, k) if gran == "row" else gran
                    grid = (-(-m // gr), -(-k // gc), 1)
                args = (xv, cv, sv, pv, np.int64(gr), np.int64(gc))
                plan = LaunchPlan(kern, args, grid, 32 * WARPS)
            plan.launch(stream, args)
            steps.append((plan.bind([None if s is None else (s, ptrs[s]) for s in sources]),
                          ()))
        _PLANS.put(key, (launch.CallPlan(steps, allocs), arrays.stream_getter(X)))
        return made[VALUES], made[SCALES]


def _vector_grids(gran, tiling, src: str, m: int, k: int):
    """The vector kernel's launches for ``gran``: ``[(grid x, grid y, segs)]`` of the
    ``"group"`` launch, or for ``"tensor"`` those of ``"amax"`` and ``"apply"`` followed by
    the number of blocks (of partial maxima). Groups along K on grid x, blocks along M on grid
    y (at most CUDA's limit; the blocks stride over the rest); one scale over the tensor: one wave
    of the blocks the kernel's launch bounds keep resident, striding."""
    kc = k // qs.CHUNK
    tiles_k = -(-kc // (tiling.tile_cols // qs.CHUNK))
    tiles_m = -(-m // tiling.tile_rows)
    blocks_m = -(-tiles_m // tiling.teams)
    if gran == "tensor":
        resident = 1 if arrays.SIMULATOR else qs.blocks_per_sm(tiling, src)
        wave = sm_count(132) * resident
        by = max(1, min(blocks_m, -(-wave // tiles_k), launch.MAX_GRID_YZ))
        return [(tiles_k, by, 1), (tiles_k, by, 1), tiles_k * by]
    by = min(blocks_m, launch.MAX_GRID_YZ)
    if gran == "row":          # one group a row: its tiles one after another
        return [(1, by, tiles_k)]
    return [(tiles_k, by, 1)]


def _fallback_blocks(m: int) -> int:
    """Blocks of the scalar kernel's ``"amax"`` / ``"apply"`` launches (each strides over
    rows)."""
    return max(1, min(m, 4 * sm_count(4)))


def _codes_allocator(X, fmt: str):
    """``alloc() -> (array, data pointer)``: a new (M, K) array for the codes, the format's
    dtype where the family has it, 16-byte aligned (the vector kernel's 8-byte stores; the
    GPU families' allocators align to 256 bytes or more). Holds no reference to ``X``'s
    array."""
    shape = X.shape
    if X.family == "torch":
        return arrays.allocator(X, shape, FORMATS[fmt])
    if X.family == "numpy":
        import ml_dtypes

        dt = np.dtype(getattr(ml_dtypes, FORMATS[fmt]))
        n = int(np.prod(shape))

        def numpy_codes():
            buf = np.empty(n + 16, np.uint8)
            off = -buf.ctypes.data % 16
            a = buf[off:off + n].view(dt).reshape(shape)
            return a, a.ctypes.data

        return numpy_codes
    return arrays.allocator(X, shape, "uint8")


def _codes_raw(values):
    """The codes array as the kernels write it, no copy: uint8 (M, K) (a NumPy array in the
    simulator, else a Numba device array)."""
    if type(values).__module__.split(".")[0] == "torch":
        import torch

        v = values.view(torch.uint8)
        raw = v.numpy() if arrays.SIMULATOR else arrays.import_device_array(v)
    elif isinstance(values, np.ndarray):
        raw = values.view(np.uint8)
    elif type(values).__module__.split(".")[0] == "cupy":
        raw = arrays.import_device_array(values)
    else:
        raw = values._ary if arrays.SIMULATOR and hasattr(values, "_ary") else values
    return raw
