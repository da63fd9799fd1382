"""``tilepy.grouped_gemm``: one GEMM per group of rows, each with its own ``b`` (the experts
of a mixture-of-experts layer), in one launch.

Validation on the host, then one launch of a grouped kernel that finds each block's group
from the offsets on the device — so the group sizes need not be known on the host and a CUDA
graph that captured a call replays it for any routing:

* on sm_90, with ``b`` K-major (a transposed view of (E, N, K), ``torch._grouped_mm``'s
  layout) and rows of 16-byte multiples, the K-major TMA / wgmma kernel
  (:func:`tilepy.ops.gemm_kmajor_wgmma.kmajor_gemm_kernel` with ``grouped``: persistent, the
  tiles of each group in turn, B's 3-D tensor map indexed by the group);
* otherwise the mma.sync kernel (:func:`tilepy.ops.gemm_mma_sync.grouped_kernel`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, devices
from ..arrays import describe, kernel_view
from ..launch import LaunchPlan
from ..tile import device_write
from ..tile.config import GemmConfig
from ..tile.smem import allow_dynamic_shared
from .. import launch
from . import gemm as gm
from . import gemm_kmajor_wgmma as kw
from . import gemm_mma_sync as tc
from .gemm_wgmma_ws import tma_storable

#: The built-in Hopper config's epilogue: True stores each consumer's 64 rows that lie inside
#: their group with TMA (staged in shared memory), the rows of a tile that reach into the next
#: group from registers; False stores every tile from registers. A config passed by the
#: caller (``KMajorConfig(tma_store=...)``) chooses for itself.
TMA_STORE = True

#: Whether the built-in choice runs a row-major ``b`` (E, K, N) on the Hopper kernel (its B
#: tiles MN-major); ``KMajorConfig`` passed as ``config`` runs it either way. Off, such a
#: ``b`` runs on the mma.sync kernel.
HOPPER_ROW_MAJOR_B = True


def grouped_gemm(a, b, offsets, *, out=None, check_offsets=True, config=None):
    """``out[offsets[g-1]:offsets[g]] = a[offsets[g-1]:offsets[g]] @ b[g]`` for every group
    ``g`` (from row 0 for the first), in one launch.

    * ``a`` (total_M, K), float16 / bfloat16; ``b`` (E, K, N) of the same dtype — row-major,
      or a transposed view of a row-major (E, N, K) (``w.transpose(-2, -1)``, as
      ``torch._grouped_mm`` takes it), read in place; other strides are copied first.
    * ``offsets`` (E,) int32 on the inputs' device: the cumulative row ends of the groups
      (``torch._grouped_mm``'s ``offs``), non-decreasing, the last equal to total_M; a group
      may be empty (two equal ends).
    * ``out`` (total_M, N) of ``a``'s dtype, or None (a new array); float32 accumulation.
    * ``check_offsets=True`` copies ``offsets`` to the host (a synchronisation with the
      stream) and raises ``ValueError`` for a negative or decreasing end or a last end other
      than total_M; ``False`` skips it, as does a call being captured into a CUDA graph.
      Unchecked, the kernel clamps each end into ``previous end … total_M``: nothing is read
      or written out of bounds, and rows past the last end are left as they were.
    * ``config``: a :class:`tilepy.tile.GemmConfig` (the mma.sync kernel) or a
      :class:`tilepy.ops.gemm_kmajor_wgmma.KMajorConfig` (the Hopper kernel; ``b`` K-major or
      row-major, 16-byte aligned rows); by default on sm_90 the Hopper kernel's 128 × 256
      tiles where ``b`` is K-major (row-major too with :data:`HOPPER_ROW_MAJOR_B`), else the
      config ``tilepy.gemm``'s heuristic picks for the average group.

    CuPy arrays, PyTorch tensors (the ``torch.ops.tilepy.grouped_gemm`` operator, with
    autograd), Numba device arrays (NumPy arrays in the simulator); errors are raised before
    anything is launched. A call whose arrays have the same kinds, dtypes, shapes, strides,
    device and alignment, and the same config, as an earlier call replays that call's launch
    (:mod:`tilepy.launch`; offsets still checked when ``check_offsets``).
    """
    fps = [arrays.fingerprint(x) for x in (a, b, offsets, out)]
    cached, key = _PLANS.lookup((tuple(f for f, _ in fps), config, TMA_STORE,
                                 HOPPER_ROW_MAJOR_B))
    if cached is not None:
        bound, stream, alloc, m, device = cached
        ptrs = [p for _, p in fps]
        s = stream()
        if check_offsets and not device_write.stream_capturing(s):
            with devices.use(device, lazy=True):
                check_values(arrays.to_host(describe(offsets, "offsets",
                                                     dtypes=arrays.HOOK_DTYPES)), m)
        if out is None:
            out, ptrs[3] = alloc()
        bound(s, ptrs)
        return out
    return _grouped_gemm(a, b, offsets, out, check_offsets, config, key)


#: Launch plans of earlier calls by signature; operand slots a, b, offsets, out.
_PLANS = launch.PlanCache()


def _grouped_gemm(a, b, offsets, out, check_offsets, config, key):
    A, B, Offs, Out, (m, k, n, e), device = check_arguments(a, b, offsets, out)
    with arrays.on_device(device):
        hopper = isinstance(config, kw.KMajorConfig)
        b_layout = _hopper_b_layout(A, B, k) if k else None
        if hopper and k and b_layout is None:
            raise ValueError("config: the Hopper grouped kernel needs a row-major, K a multiple "
                             "of 8, b row-major (E, K, N) or K-major (a transposed view of a "
                             "row-major (E, N, K)), and 16-byte aligned starts and rows (row "
                             "strides multiples of 8 elements)")
        built_in = config is None
        if built_in and (b_layout == "k" or b_layout == "row" and HOPPER_ROW_MAJOR_B) and \
                not arrays.SIMULATOR and launch.is_hopper(device):
            hopper, config = True, kw.KMajorConfig()
        cfg = config if config is not None else gm.choose_config(max(m // max(e, 1), 1), n, k,
                                                                 e, A.dtype)
        if not isinstance(cfg, (GemmConfig, kw.KMajorConfig)):
            raise TypeError(f"config must be a tilepy.tile.GemmConfig (mma.sync) or a "
                            f"tilepy.ops.gemm_kmajor_wgmma.KMajorConfig (Hopper), got "
                            f"{type(cfg).__name__}")
        if not hopper and cfg.dtype != A.dtype:
            raise ValueError(f"config is for {cfg.dtype}, inputs are {A.dtype}")
        stream = arrays.stream_handle(A)
        if check_offsets and e and not device_write.stream_capturing(stream):
            check_values(arrays.to_host(Offs), m)
        caller_out = out is not None
        if out is None:
            out = arrays.empty(A, (m, n), A.dtype)
            Out = describe(out, "out")
        if m == 0 or n == 0 or e == 0:
            return out
        alloc = None if caller_out else arrays.allocator(A, (m, n), A.dtype)
        k_given = k > 0       # (K = 0 runs on zeros made for this call)
        if k == 0:
            # an empty inner dimension: zeros, through the kernel on K = 8 of zeros
            A = describe(arrays.zeros_like_matrix(A, m, 8), "a")
            B = describe(arrays.zeros_like_matrix(B, 8, n), "b")
            k = 8
            hopper, cfg = False, gm.choose_config(max(m // max(e, 1), 1), n, k, e, A.dtype)
        if hopper:
            out_v = kernel_view(Out, 2)
            if built_in and TMA_STORE and tma_storable(out_v):
                cfg = dataclasses.replace(cfg, tma_store=True)
            b_row = b_layout == "row"
            kern = kw.kmajor_gemm_kernel(cfg, A.dtype, A.dtype, grouped=True, b_row_major=b_row)
            one = arrays.placeholder(1)
            plan, args = kw.plan(kern, cfg, kernel_view(A, 2),
                                 kernel_view(B, 3, swap_last=not b_row), out_v, one,
                                 one, kernel_view(Offs), one, k, A.dtype,
                                 arrays.byte_allocator(A))
            plan.launch(stream, args)
            # array arguments a, b, out, scale_a, scale_b, offsets, bias (then the maps)
            _PLANS.put(key, (plan.bind([(0, A.byte_pointer()), (1, B.byte_pointer()),
                                        (3, Out.byte_pointer()), None, None,
                                        (2, Offs.byte_pointer()), None]),
                             arrays.stream_getter(A), alloc, m, device))
            return out
        A2 = gm.aligned_rows(A)
        layout_b = gm.matrix_layout(B)
        B2 = B if layout_b != "other" else gm.aligned_rows(B)
        layout_b = "row" if layout_b == "other" else layout_b
        b_view = kernel_view(B2, 3, swap_last=layout_b == "col")
        out_v = kernel_view(Out, 2)
        kern = tc.grouped_kernel(cfg, layout_b == "row", A.dtype)
        offs_v = kernel_view(Offs)
        args = (kernel_view(A2, 2), b_view, out_v, offs_v, arrays.placeholder(1),
                np.float32(1.0))
        allow_dynamic_shared(kern, args, cfg.smem_bytes)
        plan = LaunchPlan(kern, args, tc.grouped_grid(cfg, m, n, e), cfg.threads,
                          cfg.smem_bytes)
        plan.launch(stream, args)
        device_write.keep_during_capture(stream, *(x for x in (A2, B2, A, B) if x is not None))
        if A2 is A and B2 is B and k_given:     # (no copies: a later call may replay it)
            # array arguments a, b, out, offsets, the placeholder
            _PLANS.put(key, (plan.bind([(0, A.byte_pointer()), (1, B.byte_pointer()),
                                        (3, Out.byte_pointer()), (2, Offs.byte_pointer()),
                                        None]),
                             arrays.stream_getter(A), alloc, m, device))
        return out


def _hopper_b_layout(A, B, k: int):
    """How the Hopper grouped kernel reads ``b`` (E, K, N) through tensor maps — ``"k"``
    (K-major: the transposed view of a row-major (E, N, K)), ``"row"`` (row-major) — or None
    where it cannot: ``a`` row-major, unit strides along ``b``'s contiguous axis, the other
    strides positive (a tensor map has no broadcast axis) and, like both starts, 16-byte
    aligned, K a multiple of 8."""
    if not (k % 8 == 0 and A.strides[1] == 1 and A.strides[0] > 0 and A.strides[0] * 2 % 16 == 0
            and A.byte_pointer() % 16 == 0 and B.byte_pointer() % 16 == 0):
        return None
    for layout, unit, others in (("k", 1, (0, 2)), ("row", 2, (0, 1))):
        if B.strides[unit] == 1 and all(B.strides[d] > 0 and B.strides[d] * 2 % 16 == 0
                                        for d in others):
            return layout
    return None


def output_spec(a, b, offsets, *, out=None):
    """``(out shape, dtype)`` after the checks that read only metadata (the registered
    operator's fake implementation)."""
    A, _, _, _, (m, _, n, _), _ = check_arguments(a, b, offsets, out, data=False)
    return (m, n), A.dtype


def check_arguments(a, b, offsets, out, data: bool = True):
    """``(A, B, Offs, Out, (total_m, k, n, groups), device)``; errors name the argument.
    ``data=False``: metadata only."""
    A = describe(a, "a", allow_float32=False)
    B = describe(b, "b", allow_float32=False)
    if A.dtype != B.dtype:
        raise TypeError(f"a and b must have the same dtype; got a {A.dtype} and b {B.dtype}")
    if A.ndim != 2:
        raise ValueError(f"a must be 2-D (total_M, K), got shape {A.shape}")
    if B.ndim != 3:
        raise ValueError(f"b must be 3-D (groups, K, N), got shape {B.shape}")
    (m, k), (e, k2, n) = A.shape, B.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a {A.shape}, b {B.shape} ({k} != {k2})")
    Offs = describe(offsets, "offsets", dtypes=arrays.HOOK_DTYPES)
    if Offs.dtype != "int32":
        raise TypeError(f"offsets must be int32 (torch._grouped_mm's convention), got "
                        f"{Offs.dtype}")
    if Offs.shape != (e,):
        raise ValueError(f"offsets must have one end per group ({e},), got shape "
                         f"{Offs.shape}")
    if e == 0 and m != 0:
        raise ValueError(f"b has no groups (E = 0), but a has {m} rows for them")
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    if Out is not None and (Out.shape != (m, n) or Out.dtype != A.dtype):
        raise ValueError(f"out must be ({m}, {n}) {A.dtype}, got {Out.shape} {Out.dtype}")
    arrays.check_distinct(Out)
    device = arrays.same_device(A, B, Offs, Out)
    return A, B, Offs, Out, (m, k, n, e), device


def check_values(offsets, total_m: int) -> None:
    """``ValueError`` unless ``offsets`` are non-decreasing ends in ``0 … total_m`` and the
    last is ``total_m``."""
    ends = offsets.astype(np.int64)
    if (ends < 0).any():
        g = int(np.argmax(ends < 0))
        raise ValueError(f"offsets[{g}] = {int(ends[g])} is negative")
    drops = np.diff(ends) < 0
    if drops.any():
        g = int(np.argmax(drops)) + 1
        raise ValueError(f"offsets must be non-decreasing: offsets[{g}] = {int(ends[g])} < "
                         f"offsets[{g - 1}] = {int(ends[g - 1])}")
    if len(ends) and ends[-1] != total_m:
        raise ValueError(f"offsets must end at total_M = {total_m} (a's rows), got "
                         f"offsets[-1] = {int(ends[-1])}")


def grouped_gemm_weight_grad(a, dout, offsets, groups: int, *, out=None, one_launch=None):
    """``out[g] = a[rows of g]ᵀ @ dout[rows of g]`` (E = ``groups`` matrices (K, N)): the
    gradient of :func:`grouped_gemm` in ``b`` (row-major (E, K, N)), zeros for an empty group.
    ``a`` (total_M, K) and ``dout`` (total_M, N) of one 16-bit dtype, ``offsets`` as
    :func:`grouped_gemm`'s; ``out`` (E, K, N) row-major of that dtype, or None (a new array).

    ``one_launch=True``: one launch of the mma.sync kernel
    (:func:`tilepy.ops.gemm_mma_sync.grouped_weight_grad_kernel`), which finds each group's
    rows from the offsets on the device (clamped as :func:`grouped_gemm` clamps them), so it
    can be captured into a CUDA graph; it needs N a multiple of 8, ``out`` (if given)
    row-major and 16-byte aligned and at most 65535 groups (``a`` and ``dout`` that are not
    row-major with 16-byte aligned rows are copied first). ``False``: each group is one
    ``tilepy.gemm`` of a transposed view (on sm_90 the TMA / wgmma kernels, faster for large
    groups), the offsets read on the host. None (the default): one launch while the stream
    is being captured or where the device is not sm_90 (when it can), else the per-group
    calls. Outside a capture the offsets are read on the host and checked as
    :func:`grouped_gemm` checks them (a synchronisation with the stream), either way."""
    from . import gemm as gm_op

    A = describe(a, "a", allow_float32=False)
    D = describe(dout, "dout", allow_float32=False)
    if A.ndim != 2 or D.ndim != 2 or A.shape[0] != D.shape[0] or A.dtype != D.dtype:
        raise ValueError(f"a (total_M, K) and dout (total_M, N) must share total_M and dtype, "
                         f"got {A.shape} {A.dtype} and {D.shape} {D.dtype}")
    Offs = describe(offsets, "offsets", dtypes=arrays.HOOK_DTYPES)
    if Offs.dtype != "int32" or Offs.shape != (groups,):
        raise ValueError(f"offsets must be int32 ({groups},), got {Offs.dtype} {Offs.shape}")
    k, n = A.shape[1], D.shape[1]
    Out = describe(out, "out", allow_float32=False) if out is not None else None
    if Out is not None and (Out.shape != (groups, k, n) or Out.dtype != A.dtype):
        raise ValueError(f"out must be ({groups}, {k}, {n}) {A.dtype}, got {Out.shape} "
                         f"{Out.dtype}")
    device = arrays.same_device(A, D, Offs, Out)
    with arrays.on_device(device):
        stream = arrays.stream_handle(A)
        capturing = device_write.stream_capturing(stream)
        fits = n % 8 == 0 and groups <= launch.MAX_GRID_YZ and (Out is None or (
            Out.strides == (k * n, n, 1) and Out.byte_pointer() % 16 == 0))
        if one_launch is None:
            one_launch = fits and (capturing or arrays.SIMULATOR or
                                   not launch.is_hopper(device))
        elif one_launch and not fits:
            raise ValueError(f"one_launch: N must be a multiple of 8, out (if given) row-major "
                             f"and 16-byte aligned, and at most {launch.MAX_GRID_YZ} groups")
        if not one_launch and capturing:
            raise NotImplementedError(
                "grouped_gemm_weight_grad: the per-group path reads the offsets on the host, so "
                "it cannot be captured into a CUDA graph; the one-launch path needs N a "
                f"multiple of 8, out (if given) row-major and at most {launch.MAX_GRID_YZ} "
                "groups")
        if out is None:
            out = arrays.empty(A, (groups, k, n), A.dtype)
            Out = describe(out, "out")
        if groups == 0 or k == 0 or n == 0:
            return out
        ends = None
        if not capturing:       # (eager: the offsets checked, as grouped_gemm checks them)
            ends = arrays.to_host(Offs).astype(np.int64)
            check_values(ends, A.shape[0])
        if one_launch:
            A2, D2 = gm.aligned_rows(A), gm.aligned_rows(D)     # (copies where not row-major)
            cfg = gm.choose_config(k, n, max(A.shape[0] // groups, 1), groups, A.dtype)
            kern = tc.grouped_weight_grad_kernel(cfg, A.dtype)
            args = (kernel_view(A2, 2), kernel_view(D2, 2), kernel_view(Out, 3),
                    kernel_view(Offs), arrays.placeholder(1), np.float32(1.0))
            allow_dynamic_shared(kern, args, cfg.smem_bytes)
            LaunchPlan(kern, args, tc.grouped_weight_grad_grid(cfg, k, n, groups), cfg.threads,
                       cfg.smem_bytes).launch(stream, args)
            device_write.keep_during_capture(stream, A2, D2)
            return out
        start = 0       # (per group: never capturing, so the offsets were read above)
        for g, end in enumerate(ends):
            gm_op.gemm(a[start:end].T, dout[start:end], out=out[g])
            start = int(end)
        return out

