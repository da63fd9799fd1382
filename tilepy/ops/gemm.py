"""``tilepy.gemm``: ``act(alpha · a @ b + beta · c + bias)`` on tensor cores.

Validation and layout handling on the host, then one launch of the mma.sync kernel of
:mod:`tilepy.ops.gemm_mma_sync` (float16 / bfloat16) or of the float32 CUDA-core kernel of
:mod:`tilepy.ops.gemm_simt`, on the inputs' device and the caller's current stream.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import arrays, launch
from ..arrays import describe, kernel_view
from ..launch import PlanCache, pointer
from ..tile import device_write
from ..tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout
from ..tile.epilogue import ACTIVATIONS
from .gemm_tuned import tuned_gemm_config
from . import gemm_mma_sync as tc
from . import gemm_simt as simt
from . import gemm_wgmma as hw
from . import gemm_wgmma_ws as ws

SMS = 132  # H200; only used to pick tile sizes

# Heuristic configs (bench/sweep_gemm.py, bench/NOTES.md): 64×64 warp tiles win at large sizes.
LARGE = GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 2), Pipeline(4))
MEDIUM = GemmConfig(BlockTile(64, 128, 32), WarpLayout(2, 2), Pipeline(4))
SMALL = GemmConfig(BlockTile(64, 64, 32), WarpLayout(2, 2), Pipeline(3))
# In the simulator every thread is a Python thread: the smallest tile that is still a real
# multi-warp pipeline.
SIMULATOR_CONFIG = GemmConfig(BlockTile(32, 32, 16), WarpLayout(2, 1), Pipeline(2))


# Hopper (sm_90) configs (bench/NOTES.md: the GEMM sweeps): the warp-specialised TMA kernel
# (gemm_wgmma_ws) at 128×256, 2 consumer warpgroups, 4 stages, where its tiles fill the SMs;
# else the cp.async wgmma kernel at 256×128 (4 warpgroups, 4 stages), or 128×128 where
# 256×128 tiles would leave SMs idle; below that the mma.sync heuristic. Operands TMA cannot
# describe (rows not 16-byte aligned) are copied or take the cp.async kernel.
HOPPER_WS = (128, 256, 4)
HOPPER_LARGE = (256, 128, 4)
HOPPER_MEDIUM = (128, 128, 4)
#: Problems of fewer 128 × 256 tiles than SMs (:func:`one_wave_config`): the warp-specialised
#: kernel's tiles (block_m, block_n, stages) and split-K factors it weighs, and its time model's
#: constants, fitted to the split-K sweep and the kernel profiles on the H200 (bench/NOTES.md:
#: the GEMM shape grid) — microseconds: a launch's fixed cost, one k step of a tile (the larger
#: of its MMAs and its operand loads at one SM's share of L2 bandwidth), a split's reduction
#: (``a + b · splits · tile elements / 8192``); HBM bytes per microsecond, reached with this
#: many work items or more (fewer items: proportionally less).
ONE_WAVE_TILES = ((128, 256, 4), (128, 128, 6), (64, 256, 5), (64, 128, 8))
ONE_WAVE_SPLITS = (1, 2, 4)         # the factors measured
ONE_WAVE_FIXED_US = 6.5
ONE_WAVE_STEP_US = {(64, 128): 0.22, (128, 128): 0.30, (64, 256): 0.37, (128, 256): 0.56}
ONE_WAVE_SPLIT_US = (1.0, 0.8)
HBM_BYTES_PER_US = 3.5e6
HBM_FULL_ITEMS = 100


#: The warp-specialised TMA kernel (the Hopper default) as a programmatic dependent launch
#: (:func:`tilepy.tile.dependent.dependent_launch`): its blocks' launch and set-up overlap the
#: tail of the kernel ahead in the stream; every global access still follows that kernel's
#: end. Aimed at small problems, whose time is mostly such fixed costs.
PDL = False
#: When a PDL kernel lets the next one launch (:func:`tilepy.tile.dependent.dependent_launch`):
#: ``"early"`` right after its set-up, ``"late"`` once its last loads are issued and main loops
#: done.
PDL_TRIGGER = "late"

#: The warp-specialised kernel's thread 0 acquires and prefetches the operands' tensor maps
#: at entry, before the barriers are set up (``wgmma_ws_gemm_kernel(prefetch_maps=True)``), so
#: the producer's first loads need not fetch them; not with :data:`PDL` (whose blocks may start
#: before the maps' writer has finished). Aimed at small problems' first-stage wait; off until
#: a GPU run has measured it (bench/NOTES.md).
PREFETCH_MAPS = False

#: Split-K's partial sums added in distributed shared memory, a tile's splits one cluster
#: (``WsConfig(split_cluster=True)``: no workspace, no semaphore, no global round trip),
#: for the one-wave configs whose other splits' accumulators fit the stage buffers; False:
#: through the global workspace (the tile's last item adds them).
SPLIT_CLUSTER = False


#: Few rows (m ≤ :data:`SWAP_MAX_M`): the warp-specialised kernel with its operands swapped
#: (:func:`swapped_config`: outᵀ = bᵀ · aᵀ, B's columns on the wgmma's 64-row side, the rows on
#: its n side of 16 or 32), instead of a 64-row tile mostly of padding. Measured against the
#: one-wave configs over the shape grid's rows 1, 16 and 32 (bench/NOTES.md: small M): faster
#: at every point, by 2–38 %. At 64 rows a 64-row-side tile re-reads all of A per tile of B's
#: columns, slower than the one-wave 64 × 256 tile: not swapped.
SWAP_SMALL_M = True
SWAP_MAX_M = 32
#: The swapped configs' tile over B's columns (two consumer warpgroups of 64) and stages.
SWAP_BLOCK_M = 128
SWAP_STAGES = 6


def swapped_config(m: int, n: int, k: int, batch: int, dtype: str):
    """The swapped-operand config of a problem of few rows (``m`` ≤ 64): tiles of
    :data:`SWAP_BLOCK_M` of B's columns × the rows rounded up to 16, 32 or 64,
    :data:`SWAP_STAGES` stages; split-K (2, 4 or 8) while the work items stay within one an SM
    and each split keeps at least four k steps of 64. The problem is bound by reading B; one
    item an SM with the most k steps each was the fastest in the sweep (bench/NOTES.md)."""
    bn = next(w for w in ws.SWAP_BLOCK_N if m <= w)
    tiles = tile_count(n, m, SWAP_BLOCK_M, bn, batch)
    ksteps = -(-k // ws.BK)
    splits = 1
    for s in (2, 4, 8):
        if tiles * s <= SMS and ksteps >= 4 * s:
            splits = s
    return ws.WsConfig(SWAP_BLOCK_M, bn, SWAP_STAGES, dtype, consumers=SWAP_BLOCK_M // 64,
                       splits=splits, swap_ab=True)


def swapped_candidates(m: int, n: int, k: int, batch: int, dtype: str):
    """The swapped-operand configs the tuner weighs for a problem of few rows:
    :func:`swapped_config` first, then the same tiles with half and twice its splits, and
    64-column tiles (one consumer, 8 stages) with as many work items (half the splits) — the
    runners-up of the sweep (bench/NOTES.md: small M) — each split keeping ≥ 4 k steps."""
    best = swapped_config(m, n, k, batch, dtype)
    ksteps = -(-k // ws.BK)
    out = [best]
    for bm, stages, splits in ((best.block_m, best.stages, best.splits // 2),
                               (best.block_m, best.stages, best.splits * 2),
                               (64, 8, max(1, best.splits // 2))):
        if splits < 1 or splits > 8 or (splits > 1 and ksteps < 4 * splits):
            continue
        cfg = ws.WsConfig(bm, best.block_n, stages, dtype, consumers=bm // 64, splits=splits,
                          swap_ab=True)
        if cfg not in out:
            out.append(cfg)
    return out


def tile_count(m: int, n: int, bm: int, bn: int, batch: int = 1) -> int:
    """The ``bm`` × ``bn`` tiles of ``batch`` (m, n) outputs."""
    return -(-m // bm) * -(-n // bn) * batch


def few_tiles(m: int, n: int, batch: int = 1) -> bool:
    """Whether the default 128 × 256 tiles would leave SMs idle: the problems
    :func:`one_wave_config` (and the tuner's small-problem candidates) are for."""
    return tile_count(m, n, *HOPPER_WS[:2], batch) < SMS


def ws_default(dtype: str, tma_store: bool = True):
    """The warp-specialised 128 × 256 config of problems that fill the SMs: persistent with
    the TMA-store epilogue (staged with stmatrix), ahead of the staged epilogue of 16-byte
    stores over the benchmark shapes, which was ahead of the register one (bench/NOTES.md:
    GEMM epilogues); ``tma_store=False``: the staged epilogue, one block per tile."""
    bm, bn, st = HOPPER_WS
    if tma_store:
        return ws.WsConfig(bm, bn, st, dtype, persistent=True, smem_epilogue=True,
                           tma_store=True)
    return ws.WsConfig(bm, bn, st, dtype, smem_epilogue=True)


#: Problems that fill the SMs with 128 × 256 tiles: the persistent TMA-store tiles weighed by
#: their waves (:func:`waves_config`), with :data:`ONE_WAVE_STEP_US`' per-k-step cost of a tile.
WAVE_TILES = ((128, 256, 4), (128, 128, 6))


def waves_config(m: int, n: int, batch: int, dtype: str):
    """The persistent TMA-store config of a problem of at least one wave of 128 × 256 tiles:
    of :data:`WAVE_TILES` the one of fewest modelled k-step time — its waves
    (``ceil(tiles / SMS)``) times its tile's step cost. 128 × 256 unless its last wave is
    so empty that twice the 128 × 128 tiles finish sooner (448 tiles: 3.4 waves of 128 × 256,
    6.8 of 128 × 128 — 1024 × 14336 and 512 × 28672 rows of issue 27's grid; the H100 sweep of
    bench/sweep_gemm_grid.py --large measured 0.84 → 0.96 and 0.92 → 1.00 × cuBLAS there)."""
    def cost(tile):
        bm, bn, _ = tile
        return -(-tile_count(m, n, bm, bn, batch) // SMS) * ONE_WAVE_STEP_US[(bm, bn)]

    bm, bn, st = min(WAVE_TILES, key=cost)     # ties to the first (128 × 256)
    return ws.WsConfig(bm, bn, st, dtype, persistent=True, smem_epilogue=True, tma_store=True)


def one_wave_time_us(m: int, n: int, k: int, batch: int, bm: int, bn: int, splits: int):
    """:func:`one_wave_config`'s model of a one-wave launch's time: fixed cost, plus the larger
    of one work item's k steps and the operands' bytes at the HBM bandwidth its items reach,
    plus the split's reduction; None when the items exceed one wave (:data:`SMS`)."""
    items = tile_count(m, n, bm, bn, batch) * splits
    if items > SMS:
        return None
    steps = -(-k // ws.BK) / splits * ONE_WAVE_STEP_US[(bm, bn)]
    nbytes = 2 * batch * (m * k + k * n)
    memory = nbytes / (HBM_BYTES_PER_US * min(1.0, items / HBM_FULL_ITEMS))
    a, b = ONE_WAVE_SPLIT_US
    reduce = a + b * splits * bm * bn / 8192 if splits > 1 else 0.0
    return ONE_WAVE_FIXED_US + max(steps, memory) + reduce


def one_wave_candidates(m: int, n: int, k: int, batch: int, dtype: str):
    """``(modelled µs, config)`` of every warp-specialised config :func:`one_wave_config`
    weighs for this problem — :data:`ONE_WAVE_TILES` × :data:`ONE_WAVE_SPLITS` whose work
    items fit one wave, 128-row tiles only past M = 64, each split at least two k steps —
    fewer splits first (also the tuner's small-problem candidates)."""
    ksteps = -(-k // ws.BK)
    out = []
    for s in ONE_WAVE_SPLITS:
        if s > 1 and ksteps < 2 * s:
            break
        for bm, bn, st in ONE_WAVE_TILES:
            if bm == 128 and m <= 64:
                continue
            t = one_wave_time_us(m, n, k, batch, bm, bn, s)
            if t is not None:
                cfg = ws.WsConfig(bm, bn, st, dtype, consumers=1 if bm == 64 else 2,
                                  smem_epilogue=True, splits=s)
                out.append((t, cluster_split(cfg) if SPLIT_CLUSTER else cfg))
    return out


def cluster_split(cfg):
    """``cfg`` with its splits reduced in a cluster (:data:`SPLIT_CLUSTER`) where it has 2 … 8
    of them and the others' accumulators fit its stage buffers; else ``cfg``."""
    if not 2 <= cfg.splits <= 8:
        return cfg
    try:
        return dataclasses.replace(cfg, split_cluster=True)
    except ValueError:
        return cfg


def one_wave_config(m: int, n: int, k: int, batch: int, dtype: str, tma_store: bool = True):
    """The warp-specialised config for a problem too small for 128 × 256 tiles on every SM:
    of :func:`one_wave_candidates` the one of least modelled time (:func:`one_wave_time_us`;
    ties to fewer splits); None when there is none. 128 × 256 without a split is the
    persistent TMA-store config of large problems (with ``tma_store``)."""
    cands = one_wave_candidates(m, n, k, batch, dtype)
    if not cands:
        return None
    cfg = min(cands, key=lambda c: c[0])[1]
    if (cfg.block_m, cfg.block_n, cfg.splits) == HOPPER_WS[:2] + (1,):
        return ws_default(dtype, tma_store)
    return cfg


def hopper_config(m: int, n: int, batch: int, dtype: str, tma_store: bool = True,
                  k: int | None = None):
    """The wgmma kernel's config on a compute capability 9.0 GPU; None elsewhere (and always
    with ``TILEPY_HOPPER=0``). A problem of fewer 128 × 256 tiles than SMs takes
    :func:`one_wave_config` when ``k`` is given and a config fills a wave (one of at most
    :data:`SWAP_MAX_M` rows :func:`swapped_config`, with :data:`SWAP_SMALL_M`); else a problem
    big
    enough to fill the SMs with this kernel's tiles takes them (128 × 256 or, where its last
    wave would be mostly empty, 128 × 128: :func:`waves_config`); else None (mma.sync).
    ``tma_store=False``: the staged epilogue of 16-byte stores instead of the TMA-store one —
    for an output TMA cannot store (float32, rows not 16-byte aligned), and for epilogues with
    a bias, ``c`` or an activation (the staged epilogue keeps the tile's bias columns in
    shared memory; the TMA-store epilogue was slower there)."""
    if arrays.SIMULATOR or dtype == "float32" or not launch.is_hopper():
        return None
    if SWAP_SMALL_M and k is not None and m <= SWAP_MAX_M:
        return swapped_config(m, n, k, batch, dtype)
    if k is not None and few_tiles(m, n, batch):
        cfg = one_wave_config(m, n, k, batch, dtype, tma_store)
        if cfg is not None:
            return cfg
    for bm, bn, st in (HOPPER_WS, HOPPER_LARGE, HOPPER_MEDIUM):
        # at least one whole tile each way (a batch of small matrices would leave most of
        # every 128-row tile empty), and enough tiles for every SM
        if m >= bm and n >= bn and tile_count(m, n, bm, bn, batch) >= SMS:
            if (bm, bn, st) == HOPPER_WS:
                return waves_config(m, n, batch, dtype) if tma_store else \
                    ws_default(dtype, tma_store)
            return hw.WgmmaConfig(bm, bn, st, dtype)
    return None


def choose_config(m: int, n: int, k: int, batch: int, dtype: str) -> GemmConfig:
    """The built-in heuristic: the largest tile that still gives every SM work."""
    if arrays.SIMULATOR:
        base = SIMULATOR_CONFIG
    else:
        def tiles(cfg):
            return tile_count(m, n, cfg.block.m, cfg.block.n, batch)

        base = LARGE if tiles(LARGE) >= 2 * SMS else MEDIUM if tiles(MEDIUM) >= SMS else SMALL
    return GemmConfig(base.block, base.warps, base.pipeline, dtype, base.swizzle, base.cc)


def matrix_layout(op) -> str:
    """'row' (unit column stride, 16-byte row stride), 'col' (its transpose), or 'other';
    'row' and 'col' also need 16-byte aligned matrices (pointer and batch strides)."""
    s_row, s_col = op.strides[-2], op.strides[-1]
    rows, cols = op.shape[-2], op.shape[-1]
    item = arrays.ITEMSIZE[op.dtype]
    # every matrix of a batch must start 16-byte aligned too (cp.async and TMA move 16 bytes)
    aligned = op.byte_pointer() % 16 == 0 and all(
        (st * item) % 16 == 0 for st, d in zip(op.strides[:-2], op.shape[:-2]) if d > 1)
    if (s_col == 1 or cols == 1) and (s_row * item) % 16 == 0 and aligned:
        return "row"
    if (s_row == 1 or rows == 1) and (s_col * item) % 16 == 0 and aligned:
        return "col"
    return "other"


def gemm(a, b, *, bias=None, activation=None, alpha=1.0, beta=0.0, c=None, out=None,
         out_dtype=None, config=None, allow_tf32=False):
    """``act(alpha · a @ b + beta · c + bias)``.

    * ``a`` (M, K) or (B, M, K); ``b`` (K, N) or (B, K, N); a batch of 1 (or a 2-D operand)
      is broadcast over the other's batch. ``bias`` (N,); ``c`` (M, N) or (B, M, N), read only
      when ``beta != 0`` (as in BLAS).
    * float16 / bfloat16 inputs run on tensor cores with float32 accumulation; the result is the
      input dtype, or float32 with ``out_dtype="float32"``. float32 inputs run on the CUDA cores
      (exact float32; TF32 tensor cores are not implemented yet: ``allow_tf32=True`` raises).
    * Row-major inputs, and a column-major ``b`` (a transposed view), are read in place; other
      strides or misaligned data are first copied into an aligned buffer.
    * ``activation``: None, "relu", "gelu", "gelu_tanh" or "silu".
    * float8 (e4m3 / e5m2) inputs, or ``scale_a`` / ``scale_b`` given (``tilepy.gemm`` only):
      the scaled FP8 product ``(a · scale_a) @ (b · scale_b)`` of
      :func:`tilepy.ops.gemm_fp8.gemm_fp8` — ``b`` K-major (a transposed view of (N, K)),
      scales per tensor (0-d), per row of ``a`` (M,) / column of ``b`` (N,) or per block
      (``a`` 1 × 128, ``b`` 128 × 128), out bfloat16 by default; sm_90 only; on PyTorch
      tensors the ``tilepy::gemm_fp8`` operator, no gradient.
    * CuPy arrays, PyTorch tensors, Numba device arrays (NumPy arrays in the simulator); the
      result is of the same kind, on the inputs' device, computed on the caller's current
      stream. Errors are raised before anything is launched.

    A call whose arrays have the same kinds, dtypes, shapes, strides, device and alignment,
    and the same flags, as an earlier call reuses that call's launch plan
    (:mod:`tilepy.launch`): no validation or view building is repeated, only the pointers,
    ``alpha`` and ``beta`` change.
    """
    use_c = beta != 0
    fa, pa = arrays.fingerprint(a)
    fb, pb = arrays.fingerprint(b)
    fbias, pbias = arrays.fingerprint(bias)
    fc, pc = arrays.fingerprint(c if use_c else None)
    fo, po = arrays.fingerprint(out)
    cached, key = _PLANS.lookup(
        (fa, fb, fbias, fc, fo, activation, out_dtype, config, allow_tf32, use_c, PDL,
         PDL_TRIGGER, SPLIT_CLUSTER, SWAP_SMALL_M, PREFETCH_MAPS))
    if cached is not None:
        return cached(out, [pa, pb, pbias, pc, po], alpha, beta, bias)
    return _gemm(a, b, bias, activation, alpha, beta, c, out, out_dtype, config, allow_tf32,
                 key)


class _Cached:
    """A launch plan bound to gemm's operands (a, b, bias, c, out) plus what a call needs
    besides: the stream getter, when the caller passes no ``out`` an allocator, and whether
    ``bias`` is converted to float32 per call (a float16 bias, say: the plan then reads the
    converted copy)."""

    def __init__(self, bound, stream, alloc, convert_bias=False):
        self.bound, self.stream, self.alloc = bound, stream, alloc
        self.convert_bias = convert_bias

    def __call__(self, out, ptrs, alpha, beta, bias=None):
        if out is None:
            out, ptrs[4] = self.alloc()
        keep = None
        if self.convert_bias:
            keep, ptrs[2] = _converted_bias(bias)
        stream = self.stream()
        self.bound(stream, ptrs, (alpha, beta))
        if keep is not None:
            device_write.keep_during_capture(stream, keep)
        del keep    # stream-ordered allocators: freeing after the launch is enqueued is safe
        return out


_PLANS = PlanCache()


def output_spec(a, b, *, bias=None, activation=None, beta=0.0, c=None, out=None,
                out_dtype=None, config=None, allow_tf32=False):
    """``(shape, dtype name)`` of ``gemm``'s result for these arguments, after every check
    ``gemm`` makes before launching (the same errors); reads only shapes, strides, dtypes and
    devices, so it also takes PyTorch fake tensors (the registered operator's meta function)."""
    checked = _check(a, b, bias, activation, beta, c, out, out_dtype, config, allow_tf32)
    return checked[-1], checked[1]


def _check(a, b, bias, activation, beta, c, out, out_dtype, config, allow_tf32):
    """Validate ``gemm``'s arguments; ``(dtype, out_dtype, (m, n, k, batch), operands (a, b,
    bias, c, out; None where absent), device, out_shape)``."""
    A = describe(a, "a")
    B = describe(b, "b")
    if A.dtype != B.dtype:
        raise TypeError(f"a and b must have the same dtype; got a {A.dtype} and b {B.dtype}")
    dtype = A.dtype
    if A.ndim not in (2, 3) or B.ndim not in (2, 3):
        raise ValueError(f"a and b must be 2-D or 3-D (batched); got shapes {A.shape} and "
                         f"{B.shape}")
    m, k = A.shape[-2:]
    k2, n = B.shape[-2:]
    if k != k2:
        raise ValueError(f"inner dimensions differ: a {A.shape} @ b {B.shape} ({k} != {k2})")
    za = A.shape[0] if A.ndim == 3 else 1
    zb = B.shape[0] if B.ndim == 3 else 1
    if za != zb and 1 not in (za, zb):
        raise ValueError(f"batch sizes differ: a {A.shape} and b {B.shape}")
    batch = max(za, zb)
    batched = A.ndim == 3 or B.ndim == 3
    out_shape = (batch, m, n) if batched else (m, n)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if out_dtype is None:
        out_dtype = dtype
    out_dtype = arrays.dtype_name(out_dtype)
    if out_dtype not in (dtype, "float32"):
        allowed = "float32" if dtype == "float32" else f"{dtype} or float32"
        raise TypeError(f"out_dtype must be {allowed} for {dtype} inputs, got {out_dtype}")
    if dtype == "float32" and allow_tf32:
        raise NotImplementedError("the TF32 tensor-core path is not implemented yet; "
                                  "allow_tf32=False runs the exact float32 path")
    Bias = describe(bias, "bias") if bias is not None else None
    if Bias is not None and Bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {Bias.shape}")
    use_c = beta != 0
    C = describe(c, "c") if (c is not None and use_c) else None
    if use_c and c is None:
        raise ValueError("beta != 0 needs c")
    if C is not None:
        if C.shape not in ((m, n), (batch, m, n), (1, m, n)):
            raise ValueError(f"c must have shape {(m, n)} or {(batch, m, n)}, got {C.shape}")
        if C.dtype != out_dtype:
            raise TypeError(f"c must have the output dtype {out_dtype}, got {C.dtype}")
    Out = describe(out, "out") if out is not None else None
    arrays.check_distinct(Out)
    if Out is not None:
        if Out.shape != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {Out.shape}")
        if Out.dtype != out_dtype:
            raise ValueError(f"out must have dtype {out_dtype}, got {Out.dtype}")
    device = arrays.same_device(A, B, Bias, C, Out)
    if config is not None:
        if not isinstance(config, (GemmConfig, hw.WgmmaConfig, ws.WsConfig)):
            raise TypeError(f"config must be a tilepy.tile.GemmConfig (mma.sync), a "
                            f"tilepy.ops.gemm_wgmma.WgmmaConfig or a "
                            f"tilepy.ops.gemm_wgmma_ws.WsConfig (Hopper), got "
                            f"{type(config).__name__}")
        if dtype != "float32" and config.dtype != dtype:
            raise ValueError(f"config is for {config.dtype}, inputs are {dtype}")
        if isinstance(config, (hw.WgmmaConfig, ws.WsConfig)) and not (
                arrays.SIMULATOR or launch.compute_capability(device) == (9, 0)):
            raise ValueError("a WgmmaConfig needs a compute capability 9.0 GPU (wgmma)")
    return dtype, out_dtype, (m, n, k, batch), (A, B, Bias, C, Out), device, out_shape


def _gemm(a, b, bias, activation, alpha, beta, c, out, out_dtype, config, allow_tf32, key):
    dtype, out_dtype, (m, n, k, batch), (A, B, Bias, C, Out), device, out_shape = _check(
        a, b, bias, activation, beta, c, out, out_dtype, config, allow_tf32)
    caller_out = out is not None
    if out is None:
        out = arrays.empty(A, out_shape, out_dtype)
        Out = describe(out, "out")
    if m == 0 or n == 0 or batch == 0:
        return out
    bound, convert_bias = _run(A, B, Bias, C, Out, dtype, out_dtype, m, n, k, batch, activation,
                               alpha, beta, config, device)
    if bound is not None:
        alloc = None if caller_out else arrays.allocator(A, out_shape, out_dtype)
        _PLANS.put(key, _Cached(bound, arrays.stream_getter(A), alloc, convert_bias))
    return out


def aligned_rows(op):
    """``op`` itself when its matrices are row-major and 16-byte aligned, else an aligned copy."""
    if matrix_layout(op) == "row":
        return op
    return describe(arrays.copy_aligned(op), op.name)


def _run(A, B, Bias, C, Out, dtype, out_dtype, m, n, k, batch, activation, alpha, beta, config,
         device):
    """Launch; return (the plan bound to the operands (a, b, bias, c, out) when a later call
    with the same signature can reuse it (no copies of a, b, c or out were needed) else None,
    whether the bias is a float32 copy that such a call has to make again)."""
    with arrays.on_device(device):
        stream = arrays.stream_handle(A)
        bias_v = _bias_view(Bias)
        out_v = kernel_view(Out, 3)
        c_v = kernel_view(C, 3) if C is not None else out_v
        reusable = True
        convert_bias = Bias is not None and Bias.byte_pointer() != pointer(bias_v)
        sources = [(4, Out.byte_pointer()), (3, C.byte_pointer()) if C is not None else
                   (4, Out.byte_pointer()),
                   None if Bias is None else
                   (2, pointer(bias_v) if convert_bias else Bias.byte_pointer())]
        if dtype == "float32":
            kern = simt.simt_gemm_kernel(activation, Bias is not None, C is not None)
            plan, args = simt.plan(kern, kernel_view(A, 3), kernel_view(B, 3), out_v, c_v,
                                   bias_v, alpha, beta)
        else:
            if k == 0:
                # NumPy's answer for an empty inner dimension is zeros; run the epilogue on
                # K = 8 of zeros so that bias, c and the activation apply as usual.
                A = describe(arrays.zeros_like_matrix(A, m, 8), "a")
                B = describe(arrays.zeros_like_matrix(B, 8, n), "b")
                k, reusable = 8, False
            A2 = aligned_rows(A)
            layout_b = matrix_layout(B)
            B2 = B if layout_b != "other" else aligned_rows(B)
            reusable = reusable and A2 is A and B2 is B
            layout_b = "row" if layout_b == "other" else layout_b
            # the caller's config, else a tuned choice persisted by `python -m tilepy tune
            # gemm` (any kernel), else the Hopper default, else the mma.sync heuristic
            mma_cfg = choose_config(m, n, k, batch, dtype)
            # the TMA-store epilogue for a plain product; with a bias, c or an activation the
            # staged one (bias columns in shared memory), faster on the fused bias + GELU
            # benchmark (bench/NOTES.md: GEMM epilogues)
            plain = Bias is None and C is None and activation is None
            storable = ws.tma_storable(out_v)
            cfg = config or tuned_gemm_config(m, n, k, batch, dtype, mma_cfg, device) or \
                hopper_config(m, n, batch, dtype, tma_store=plain and storable, k=k) or mma_cfg
            b_view = kernel_view(B2, 3, swap_last=layout_b == "col")  # col: (Z, N, K) row-major
            a_view = kernel_view(A2, 3)
            if isinstance(cfg, ws.WsConfig) and cfg.tma_store and not (plain and storable):
                if config is None:
                    # a tuned choice (timed on plain products) for a fused epilogue, or an out
                    # TMA cannot store: the staged epilogue instead
                    cfg = hopper_config(m, n, batch, dtype, tma_store=False, k=k) or mma_cfg
                elif not storable:
                    raise ValueError("config: tma_store needs a 16-bit out whose rows TMA can "
                                     "store (unit column stride, rows and start 16-byte "
                                     f"aligned); got {out_dtype} with strides {Out.strides}")
            if config is None and isinstance(cfg, ws.WsConfig) and not ws.tma_ready(
                    cfg, layout_b == "row", a_view, b_view):
                # operands TMA cannot describe: the cp.async wgmma kernel where its 256 x 128
                # tiles fill the SMs, else the mma.sync heuristic
                big = tile_count(m, n, *HOPPER_LARGE[:2], batch) >= SMS
                cfg = hw.WgmmaConfig(*HOPPER_LARGE, dtype) if big else mma_cfg
            # a TMA grid kernel cannot launch a batch past the grid's y limit in chunks: its
            # persistent variant, else the cp.async wgmma kernel (see _grid_safe)
            cfg = _grid_safe(cfg, batch)
            gen = hw if isinstance(cfg, hw.WgmmaConfig) else \
                ws if isinstance(cfg, ws.WsConfig) else tc
            extra = {"stream": stream, "alloc": arrays.byte_allocator(A)} if gen is ws else {}

            def planned(cfg):
                kern = {hw: hw.wgmma_gemm_kernel, ws: ws.wgmma_ws_gemm_kernel,
                        tc: tc.gemm_kernel}[gen](
                    cfg, layout_b == "row", out_dtype, activation, Bias is not None,
                    C is not None, **({"pdl": PDL and PDL_TRIGGER,
                                       "prefetch_maps": PREFETCH_MAPS and not PDL}
                                      if gen is ws else {}))
                return gen.plan(kern, cfg, a_view, b_view, out_v, c_v, bias_v, alpha, beta,
                                **extra)

            try:
                plan, args = planned(cfg)
            except ValueError:
                if config is not None or not getattr(cfg, "split_cluster", False):
                    raise
                # clusters of the splits this device cannot hold: the workspace reduction
                plan, args = planned(dataclasses.replace(cfg, split_cluster=False))
        plan.launch(stream, args)
        # temporaries the launch reads (a float32 bias, aligned copies, zero matrices): kept
        # when a CUDA graph captured it
        temps = [bias_v if convert_bias else None]
        if not reusable and dtype != "float32":
            temps += [A2, B2, A, B]
        device_write.keep_during_capture(stream, *temps)
    if not reusable:
        return None, convert_bias
    return plan.bind([(0, A.byte_pointer()), (1, B.byte_pointer())] + sources), convert_bias


def _grid_safe(cfg, batch: int):
    """``cfg``, unless it is a non-persistent :class:`~tilepy.ops.gemm_wgmma_ws.WsConfig` and
    ``batch`` exceeds the grid's y limit (:data:`tilepy.launch.MAX_GRID_YZ`).

    The rule (the caller's config included): the TMA kernel's tensor maps describe the whole
    batch and its blocks take their matrix from ``blockIdx``, so its grid cannot be launched in
    chunks of pointer-shifted operands as the other kernels' are; a batch past the limit runs
    its persistent variant instead (a one-dimensional grid, the same results), or where that
    config is invalid (the persistent staging does not fit beside the stages) the cp.async
    wgmma kernel of the same tile (else :data:`HOPPER_LARGE`), whose batch launches in
    chunks."""
    if not isinstance(cfg, ws.WsConfig) or cfg.persistent or batch <= launch.MAX_GRID_YZ:
        return cfg
    try:   # (split-K in clusters wants one item per block: the workspace reduction then)
        return dataclasses.replace(cfg, persistent=True, split_cluster=False)
    except ValueError:
        pass
    try:
        return hw.WgmmaConfig(cfg.block_m, cfg.block_n, cfg.stages, cfg.dtype)
    except ValueError:
        return hw.WgmmaConfig(*HOPPER_LARGE, cfg.dtype)


def _converted_bias(bias):
    """(a float32 copy of ``bias``, its device pointer) for a cached plan's call: the
    framework's own conversion, no Numba array (importing one costs ~50 us of host time)."""
    mod = type(bias).__module__.split(".")[0]
    if mod == "torch":
        import torch

        x = bias.to(torch.float32).contiguous()
        return x, x.data_ptr()
    if mod == "cupy":
        x = bias.astype("float32", order="C")
        return x, x.data.ptr
    keep = _bias_view(describe(bias, "bias"))
    return keep, pointer(keep)


def _bias_view(Bias):
    """bias as a contiguous float32 kernel argument (a tiny copy if it is not one already)."""
    if Bias is None:
        return arrays.placeholder(1)
    x = Bias.raw
    if Bias.family == "torch":
        import torch

        x = x.to(torch.float32).contiguous()
    elif Bias.family == "cupy":
        x = x.astype("float32", copy=False)
    elif Bias.family == "numba":
        if Bias.dtype != "float32":
            raise TypeError("bias: Numba device arrays must be float32")
    else:
        x = np.ascontiguousarray(x, dtype=np.float32) if Bias.dtype != "bfloat16" else \
            x.astype(np.float32)
    return kernel_view(describe(x, "bias"))
