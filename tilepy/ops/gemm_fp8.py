"""``tilepy.gemm`` on 8-bit floats: ``out = (a · scale_a) @ (b · scale_b)`` for e4m3 / e5m2
``a`` and ``b``, out in bfloat16, float16 or float32 (``torch._scaled_mm``'s contract).

Validation on the host, then one launch of the FP8 kernel of
:mod:`tilepy.ops.gemm_kmajor_wgmma` (sm_90a: TMA + k32 wgmma) on the operands' bytes. The first
call of a signature (array kinds, dtypes, shapes, strides, device, alignment, arguments) builds
the launch plan; later ones launch it with their pointers (tensor maps re-encoded only for new
operand pointers, written through the caller's allocator and stream).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, launch
from ..arrays import describe
from ..launch import PlanCache
from ..tile import device_write
from ..tile.epilogue import ACTIVATIONS
from . import gemm_kmajor_wgmma as fk
from . import gemm_wgmma_ws as ws

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
#: Whether the built-in config takes the TMA-store epilogue
#: (:attr:`~tilepy.ops.gemm_kmajor_wgmma.KMajorConfig.tma_store`) for 16-bit outputs TMA can
#: store, whatever the scales. ``False``: the register epilogue;
#: ``config=KMajorConfig(tma_store=...)`` chooses per call.
TMA_STORE = True
_FMT = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def is_fp8(x) -> bool:
    """Whether ``x`` (an array) holds 8-bit floats (by its dtype's name)."""
    dt = getattr(x, "dtype", None)
    return dt is not None and str(dt).replace("torch.", "") in FP8_DTYPES


def gemm_fp8(a, b, *, scale_a=None, scale_b=None, out_dtype=None, out=None, bias=None,
             activation=None, config=None):
    """``out[i, j] = act(scale_a · scale_b · Σ_k a[i, k] b[k, j] + bias[j])`` with float32
    accumulation.

    * ``a`` (M, K) row-major, ``b`` (K, N) K-major — the transposed view of a row-major
      (N, K), as ``torch._scaled_mm`` takes it (``w.t()``) — with rows of whole 16-byte units
      and 16-byte aligned data are read in place; an operand of any other layout or alignment
      (a row-major (K, N) ``b``, a slice, a broadcast, say) is first copied into that layout
      on the GPU (one more pass over it each call, and such calls are not recorded for
      replay);
      each e4m3 or e5m2, in any combination (k32 wgmmas take the two formats separately;
      ``torch._scaled_mm`` refuses e5m2 · e5m2, this takes it).
    * ``scale_a``: float32, one scale (0-d, (1,)) or one per row ((M,), or (M, 1) as
      ``torch._scaled_mm`` takes it); ``scale_b``: one scale, or one per column ((N,) or
      (1, N)); None is 1.0. Or block scales (DeepGEMM's recipe): ``scale_a`` (M, ceil(K /
      128)) per 1 × 128 block of a row of ``a`` and ``scale_b`` (ceil(K / 128), ceil(N /
      128)) per 128 × 128 block of ``b`` (:func:`tilepy.quantize_fp8`'s ``(1, 128)`` and
      ``(128, 128)`` granularities, the latter of ``b``'s (N, K) storage transposed), each
      k block's partial product scaled and summed in float32; 128-column tiles.
    * ``out_dtype``: ``"bfloat16"`` (default; ``out``'s dtype when ``out`` is given),
      ``"float16"`` or ``"float32"``; ``out`` (M, N) of it, or None. K = 0 gives zeros
      (``act(bias)`` with a bias or an activation).
    * ``bias``: None or (N,) float32, float16 or bfloat16, added in float32 after the scales;
      ``activation``: None, ``"relu"``, ``"gelu"`` (erf form), ``"gelu_tanh"`` or ``"silu"``,
      applied last (before the cast to ``out_dtype``).
    Needs a compute capability 9.0 GPU (the simulator runs it too). Errors are raised before
    anything is launched.
    """
    fps = [arrays.fingerprint(x) for x in (a, b, scale_a, scale_b, out, bias)]
    cached, key = _PLANS.lookup((tuple(f for f, _ in fps), out_dtype, config, activation))
    if cached is not None:
        bound, stream, alloc, keep = cached
        ptrs = [p for _, p in fps]
        if out is None:
            out, ptrs[4] = alloc()
        s = stream()
        bound(s, ptrs)
        if keep is not None:
            device_write.keep_during_capture(s, keep)
        return out
    return _gemm_fp8(a, b, scale_a, scale_b, out_dtype, out, bias, activation, config, key)


_PLANS = PlanCache()


def check_arguments(a, b, scale_a, scale_b, out_dtype, out, bias, activation, config):
    """Every check :func:`gemm_fp8` makes before launching, on metadata only (so fake tensors
    pass through it too): ``(A, B, Sa, Sb, Out, Bias, (m, n, k), out_dtype, block, cfg,
    device)``, ``block`` None or the block scales' pair, ``Bias`` None without one."""
    A = describe(a, "a", dtypes=FP8_DTYPES)
    B = describe(b, "b", dtypes=FP8_DTYPES)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"gemm on float8 inputs: a and b must be 2-D, got {A.shape} and "
                         f"{B.shape}")
    (m, k), (k2, n) = A.shape, B.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a {A.shape} @ b {B.shape} ({k} != {k2})")
    if k % 16:
        raise ValueError(f"gemm on float8 inputs: K must be a multiple of 16 (rows of whole "
                         f"16-byte units, as torch._scaled_mm requires), got {k}")
    if out_dtype is None and out is not None:
        out_dtype = describe(out, "out").dtype
    out_dtype = arrays.dtype_name(out_dtype) if out_dtype is not None else "bfloat16"
    if out_dtype not in fk.OUT_KINDS:
        raise TypeError(f"out_dtype must be one of {fk.OUT_KINDS}, got {out_dtype}")
    block = _block_scales(scale_a, scale_b, m, n, k, A)
    if block is not None:
        Sa, Sb = block
    else:
        Sa = _scale(scale_a, "scale_a", m, "row", A)
        Sb = _scale(scale_b, "scale_b", n, "column", A)
    Out = describe(out, "out") if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None and (Out.shape != (m, n) or Out.dtype != out_dtype):
        raise ValueError(f"out must be ({m}, {n}) {out_dtype}, got {Out.shape} {Out.dtype}")
    Bias = describe(bias, "bias", dtypes=fk.OUT_KINDS) if bias is not None else None
    if Bias is not None and Bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {Bias.shape}")
    device = arrays.same_device(A, B, Out, *(s for s in (Sa, Sb, Bias) if s is not None))
    cfg = config if config is not None else fk.KMajorConfig(
        block_n=fk.BLOCK_SCALE if block is not None else fk.KMajorConfig.block_n)
    if not isinstance(cfg, fk.KMajorConfig):
        raise TypeError(f"config must be a tilepy.ops.gemm_kmajor_wgmma.KMajorConfig, got "
                        f"{type(cfg).__name__}")
    if block is not None and cfg.block_n > fk.BLOCK_SCALE:
        raise ValueError(f"block scales need config.block_n <= {fk.BLOCK_SCALE} (a tile's "
                         f"columns in one scale block), got {cfg.block_n}")
    return A, B, Sa, Sb, Out, Bias, (m, n, k), out_dtype, block, cfg, device


def _rows_of_units(row_stride: int, col_stride: int, rows: int) -> bool:
    """Whether a matrix of 8-bit codes with these strides (bytes) has adjacent columns and
    rows a positive multiple of 16 bytes apart (one row: any row stride)."""
    return col_stride == 1 and (rows == 1 or (row_stride > 0 and row_stride % 16 == 0))


def _rows_view(like, X, rows: int, k: int, row_stride: int, col_stride: int, stream):
    """``(copy, view)``: the (rows × k) row-major kernel view the kernel's tensor map reads
    of operand ``X`` (element ``(r, c)`` at byte ``r · row_stride + c · col_stride``) — ``X``
    itself (``copy`` None) with no K, or where :func:`_rows_of_units` and its data is 16-byte
    aligned (TMA's requirement), else :func:`_copy_rows`'s copy."""
    if not k or (_rows_of_units(row_stride, col_stride, rows) and X.byte_pointer() % 16 == 0):
        return None, arrays.device_view(arrays.restride(arrays.raw_view(X), (rows, k),
                                                        (row_stride, 1)))
    return _copy_rows(like, X, rows, k, row_stride, col_stride, stream)


def output_spec(a, b, *, scale_a=None, scale_b=None, out_dtype=None, out=None, bias=None,
                activation=None):
    """``((M, N), out dtype name)`` after every check :func:`gemm_fp8` makes before launching
    (the registered operator's fake implementation)."""
    _, _, _, _, _, _, (m, n, _), out_dtype, *_ = check_arguments(
        a, b, scale_a, scale_b, out_dtype, out, bias, activation, None)
    return (m, n), out_dtype


def _gemm_fp8(a, b, scale_a, scale_b, out_dtype, out, bias, activation, config, key):
    A, B, Sa, Sb, Out, Bias, (m, n, k), out_dtype, block, cfg, device = \
        check_arguments(a, b, scale_a, scale_b, out_dtype, out, bias, activation, config)
    with arrays.on_device(device):
        if not arrays.SIMULATOR and launch.compute_capability(device) != (9, 0):
            raise NotImplementedError("gemm on float8 inputs needs a compute capability 9.0 GPU "
                                      "(wgmma); other GPUs are not supported yet")
        caller_out = out is not None
        if out is None:
            out = arrays.empty(A, (m, n), out_dtype)
            Out = describe(out, "out")
        if m == 0 or n == 0:
            return out
        zeros = k == 0
        if zeros and Bias is None and activation is None:
            # an empty inner dimension: zeros (NumPy's answer; the scales multiply nothing)
            return arrays.fill(Out, 0)
        if zeros:
            # ... with a bias or an activation: act(0 + bias), through the kernel on K = 16 of
            # zeros (the scales multiply zeros)
            a, b = _zero_operands(A, B, m, n)
            A, B = describe(a, "a", dtypes=FP8_DTYPES), describe(b, "b", dtypes=FP8_DTYPES)
            k = 16
            Sa = Sb = block = None
        stream = arrays.stream_handle(A)
        ones = arrays.ones(A, (1,)) if Sa is None or Sb is None else None
        One = describe(ones, "ones") if ones is not None else None
        if block is not None:   # 2-D (M, K blocks) and (K blocks, N blocks)
            sa_v, sb_v = arrays.kernel_view(Sa, 2), arrays.kernel_view(Sb, 2)
        else:
            sa_v = _scale_view(Sa if Sa is not None else One)
            sb_v = _scale_view(Sb if Sb is not None else One)
        bias_v = arrays.kernel_view(Bias) if Bias is not None else arrays.placeholder(1)
        out_v = arrays.kernel_view(Out)
        if TMA_STORE and config is None and out_dtype != "float32" and \
                ws.tma_storable(out_v):
            # the TMA-store epilogue wherever TMA can store the output (with block scales
            # too: their two partial accumulators make it spill a little, and it is still
            # the faster epilogue)
            cfg = dataclasses.replace(cfg, tma_store=True)
        kern = fk.kmajor_gemm_kernel(cfg, _FMT[A.dtype], out_dtype,
                                     _per_index(Sa, m) and block is None,
                                     _per_index(Sb, n) and block is None, block is not None,
                                     b_fmt=_FMT[B.dtype], activation=activation,
                                     bias_kind=Bias.dtype if Bias is not None else None)
        # a row-major and b K-major (torch._scaled_mm's layouts), rows of whole 16-byte units
        # and the data 16-byte aligned, are read in place; any other layout is copied into
        # one first (b's K-major (K, N) view is the row-major (N, K) the kernel's map
        # describes)
        at, a_v = _rows_view(A, A, m, k, A.strides[0], A.strides[1], stream)
        bt, b_v = _rows_view(A, B, n, k, B.strides[1], B.strides[0], stream)
        plan, args = fk.plan(kern, cfg, a_v, b_v, out_v, sa_v, sb_v,
                             arrays.placeholder(1), bias_v, k, _FMT[A.dtype],
                             arrays.byte_allocator(A))
        plan.launch(stream, args)
        device_write.keep_during_capture(stream, ones, at, bt, *((a, b) if zeros else ()))
        # operand slots: a, b, scale_a, scale_b, out, bias (a None scale reads the kept ones)
        src = [(0, A.byte_pointer()), (1, B.byte_pointer()),
               (4, Out.byte_pointer()),
               (2, Sa.byte_pointer()) if Sa is not None else None,
               (3, Sb.byte_pointer()) if Sb is not None else None,
               None,      # offsets: a placeholder
               (5, Bias.byte_pointer()) if Bias is not None else None]
        if zeros or at is not None or bt is not None:
            # (the zero operands, the copies are this call's: a later call makes its own)
            return out
        if ones is None or not device_write.stream_capturing(stream):
            # (ones made during a capture are written only when the graph runs: not kept for
            # eager calls)
            _PLANS.put(key, (plan.bind(src), arrays.stream_getter(A),
                             None if caller_out else arrays.allocator(A, (m, n), out_dtype), ones))
        return out


def _scale(s, name: str, length: int, what: str, A):
    """``s`` as an Operand: float32, one scale (0-d, (1,) or (1, 1)) or one per {what}
    ((length,), or torch._scaled_mm's (M, 1) / (1, N)); None stays."""
    if s is None:
        return None
    S = _float32_array(s, name)
    size = int(np.prod(S.shape))
    if S.ndim > 2 or size not in (1, length) or (S.ndim == 2 and size != 1 and (
            S.shape != ((length, 1) if what == "row" else (1, length)))):
        raise ValueError(f"{name} must be 0-d (per tensor), ({length},) (per {what}) or a "
                         f"block scale (with the other one), got shape {S.shape}")
    arrays.same_device(A, S)
    return S


def _float32_array(s, name: str):
    """``s`` as an Operand of float32; a ``TypeError`` naming ``name`` for a number (the
    scales are arrays on the inputs' device, as ``torch._scaled_mm`` takes them) or another
    dtype."""
    if isinstance(s, (int, float, np.number)):
        raise TypeError(f"{name} must be a float32 array on the inputs' device (0-d for one "
                        f"scale), got the number {s!r}")
    S = describe(s, name, dtypes=arrays.HOOK_DTYPES + ("bfloat16",))
    if S.dtype != "float32":
        raise TypeError(f"{name} must be float32, got {S.dtype}")
    return S


def _block_scales(scale_a, scale_b, m: int, n: int, k: int, A):
    """``(Sa, Sb)`` when the scales are block scales — ``scale_a`` (M, ceil(K / 128)) and
    ``scale_b`` (ceil(K / 128), ceil(N / 128)), float32 — else None (the other forms, checked
    by :func:`_scale`). Where the shapes read both ways (one k block and one column block:
    (M, 1) and (1, 1)), they are taken as per row / per tensor (the same product). ``ValueError`` for a block ``scale_a`` without a block
    ``scale_b`` or the reverse (beyond one k block)."""
    if scale_a is None or scale_b is None:
        return None
    Sa, Sb = _float32_array(scale_a, "scale_a"), _float32_array(scale_b, "scale_b")
    kb, nb = -(-k // fk.BLOCK_SCALE), -(-n // fk.BLOCK_SCALE)
    a_block = Sa.ndim == 2 and Sa.shape == (m, kb)
    b_block = Sb.ndim == 2 and Sb.shape == (kb, nb)
    # one k block and N within one column block (or N = 1): the shapes read as per row / per
    # tensor too, with the same product — those forms, which take any tile width
    ambiguous = kb == 1 and nb in (1, n)
    if a_block and b_block and not ambiguous:
        arrays.same_device(A, Sa, Sb)
        return Sa, Sb
    if (a_block and kb > 1) or (b_block and kb > 1):
        raise ValueError(f"block scales come in pairs: scale_a ({m}, {kb}) per 1 x 128 block "
                         f"of a and scale_b ({kb}, {nb}) per 128 x 128 block of b; got "
                         f"{Sa.shape} and {Sb.shape}")
    return None


def _per_index(S, length: int) -> bool:
    """Whether scale ``S`` holds one value per row / column (not one for the tensor)."""
    return S is not None and int(np.prod(S.shape)) == length and length > 1


def _scale_view(S):
    """A float32 scale as a 1-D kernel argument: its values along the one axis that has them
    ((1,) for one scale)."""
    view = arrays.raw_view(S)
    size = int(np.prod(S.shape))
    stride = max((st for st, d in zip(S.strides, S.shape) if d > 1), default=1)
    return arrays.device_view(arrays.restride(view, (size,), (4 * stride,)))


def _copy_rows(like, X, rows: int, cols: int, row_stride: int, col_stride: int, stream):
    """``(copy, view)``: the (rows × cols) codes of ``X`` — element ``(r, c)`` at byte
    ``r · row_stride + c · col_stride`` of its data (any layout: a's rows, b's columns, a
    broadcast) — into a new row-major uint8 array of ``like``'s family and device
    (:mod:`tilepy.tile.transpose`) on ``stream``, and its (rows, cols) kernel view."""
    from ..tile import transpose as TR

    bt = arrays.empty(like, (rows, cols), "uint8")
    src = arrays.device_view(arrays.restride(arrays.raw_view(X), (1, 1, cols, rows),
                                             (0, 0, col_stride, row_stride)))
    raw = arrays.raw_view(describe(bt, X.name, dtypes=("uint8",)))
    dst = arrays.device_view(arrays.restride(raw, (1, 1, rows, cols), (0, 0, cols, 1)))
    plan, args = TR.launch_plan(src, dst)
    if plan is not None:
        plan.launch(stream, args)
    return bt, arrays.device_view(raw)


def _zero_operands(A, B, m: int, n: int):
    """``(a, b)``: zero codes of ``A``'s and ``B``'s formats, family and device, (M, 16) and
    the K-major (16, N) view of an (N, 16)."""
    return arrays.zeros_like_matrix(A, m, 16), arrays.zeros_like_matrix(B, n, 16).T

