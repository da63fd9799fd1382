"""Built-in config spaces, the tuned choice an op call uses, and ahead-of-time tuning.

* :func:`gemm_space` — the candidate :class:`~tilepy.tile.config.GemmConfig` list for the
  tensor-core GEMM, pruned *before anything compiles* by the device's limits (the config's own
  validation: shared memory per block, the register estimate, warp/tile divisibility) and by
  the problem's size (no block tile far larger than the output, no more stages than k-tiles).
* :func:`pick_gemm_config` — what ``tilepy.gemm`` runs when the caller gives no config: the
  choice persisted by an earlier :func:`tune_gemm` for this (shape bucket, dtype, GPU, tilepy
  version), else the built-in heuristic. It never tunes: one candidate compiles for seconds,
  which no ordinary call should pay unasked. After its first look-up for a shape it costs a
  dictionary lookup. The look-up itself (:func:`tuned_gemm_config`, the key and the stored
  fields) belongs to the op, :mod:`tilepy.ops.gemm_tuned`; this module re-exports it.
* :func:`tune_gemm` — times every candidate on real inputs (``python -m tilepy tune gemm``
  calls it), checks each result against the heuristic config's, persists the winner and
  returns it with the table.

``TILEPY_AUTOTUNE=0``: :func:`pick_gemm_config` returns the heuristic (the tuning cache is not
read). ``TILEPY_VERBOSE=0``: no progress line or table on stderr while tuning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..ops import gemm as _gemm_op
from ..ops.gemm_tuned import (
    HOPPER_KINDS,
    OP,
    config_fields,
    config_from_fields,
    forget_choices,
    gemm_key,
    tuned_gemm_config,
)
from ..tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout
from .autotune import autotune, current_gpu_name, describe_config, format_report

#: (block m, n, k), (warps along m, n): the tile shapes worth timing on sm_80 / sm_90 — warp
#: tiles of 32×32 to 64×64 (bench/NOTES.md: 64×64 warp tiles win at large sizes), BK 32 or 64.
GEMM_TILES = (
    ((128, 128, 32), (2, 2)), ((128, 128, 32), (2, 4)), ((128, 128, 64), (2, 2)),
    ((128, 128, 64), (2, 4)), ((128, 256, 32), (2, 4)), ((256, 128, 32), (4, 2)),
    ((128, 256, 64), (2, 4)), ((64, 128, 32), (2, 2)), ((128, 64, 32), (2, 2)),
    ((64, 128, 64), (2, 2)), ((64, 64, 32), (2, 2)), ((64, 64, 64), (2, 2)),
)
#: cp.async pipeline depths tried for each tile shape.
GEMM_STAGES = (3, 4)
#: Hopper (sm_90) candidates, tried before the mma.sync ones: (kernel, keyword arguments of its
#: config) — the warp-specialised TMA kernel (``gemm_wgmma_ws.WsConfig``) and the cp.async one
#: (``gemm_wgmma.WgmmaConfig``), the configs bench/sweep_gemm_wgmma.py and
#: bench/sweep_gemm_shapes.py found worth timing.
HOPPER_CANDIDATES = (
    ("wgmma_ws", {"persistent": True, "smem_epilogue": True, "tma_store": True}),
    ("wgmma_ws", {"smem_epilogue": True}),
    # clusters of two sharing B (TMA multicast; 56 / 224 registers: no producer spills)
    ("wgmma_ws", {"persistent": True, "smem_epilogue": True, "tma_store": True, "cluster": 2,
                  "producer_regs": 56, "consumer_regs": 224}),
    ("wgmma_ws", {"smem_epilogue": True, "cluster": 2, "producer_regs": 56,
                  "consumer_regs": 224}),
    ("wgmma_ws", {"stages": 3, "persistent": True, "smem_epilogue": True}),
    ("wgmma_ws", {}), ("wgmma_ws", {"block_m": 256, "block_n": 128}),
    ("wgmma_ws", {"persistent": True}), ("wgmma_ws", {"block_n": 192, "stages": 5}),
    ("wgmma", {"block_m": 128, "block_n": 256, "stages": 4, "overlap": True}),
    ("wgmma", {"block_m": 256, "block_n": 128, "stages": 4}),
    ("wgmma", {"block_m": 128, "block_n": 128, "stages": 4}),
)


def hopper_space(dtype: str = "float16", m=None, n=None, k=None, batch: int = 1):
    """The Hopper candidates for ``dtype`` (compute capability 9.0 only), without tiles far
    larger than an (m, n) output; with ``k`` too, a problem of fewer 128 × 256 tiles than
    SMs also gets the tile × split-K configs the op's small-problem rule weighs
    (:func:`tilepy.ops.gemm.one_wave_candidates`), first — after, for one of at most
    :data:`tilepy.ops.gemm.SWAP_MAX_M` rows, the swapped-operand configs
    (:func:`tilepy.ops.gemm.swapped_candidates`, the op's own choice first)."""
    out = []
    if None not in (m, n, k) and m <= _gemm_op.SWAP_MAX_M:
        out += _gemm_op.swapped_candidates(m, n, k, batch, dtype)
    if None not in (m, n, k) and _gemm_op.few_tiles(m, n, batch):
        out += [cfg for _, cfg in _gemm_op.one_wave_candidates(m, n, k, batch, dtype)]
    for kind, kw in HOPPER_CANDIDATES:
        cfg = HOPPER_KINDS[kind](dtype=dtype, **kw)
        if (m is None or cfg.block_m <= max(64, 2 * m)) and \
                (n is None or cfg.block_n <= max(64, 2 * n)) and cfg not in out:
            out.append(cfg)
    return out


def _device_cc():
    """The current device's compute capability; (9, 0) when there is none (simulator)."""
    from .. import devices

    if devices.SIMULATOR:
        return (9, 0)
    return tuple(devices.current().cc)


def gemm_space(dtype: str = "float16", cc=None, m=None, n=None, k=None, *,
               with_rejected: bool = False, hopper: bool = False, batch: int = 1):
    """Candidate GEMM configs for ``dtype`` on compute capability ``cc`` (default: the current
    device's), that fit the device; with ``m``, ``n``, ``k`` also only those that fit the
    problem. ``hopper=True`` (and cc 9.0) puts the wgmma kernels' configs
    (:func:`hopper_space`, for a problem of ``batch`` matrices) first. ``with_rejected=True``
    returns
    ``(configs, [(what, why), …])``."""
    cc = tuple(cc) if cc is not None else _device_cc()
    kept, rejected = [], []
    if hopper and cc[:2] == (9, 0):
        kept += hopper_space(dtype, m, n, k, batch)
    for (bm, bn, bk), (wm, wn) in GEMM_TILES:
        for stages in GEMM_STAGES:
            what = f"{bm}x{bn}x{bk} block, {wm}x{wn} warps, {stages} stages"
            try:
                cfg = GemmConfig(BlockTile(bm, bn, bk), WarpLayout(wm, wn), Pipeline(stages),
                                 dtype, True, cc)
            except ValueError as e:  # over the device's shared memory or registers, …
                rejected.append((what, str(e)))
                continue
            why = _misfit(cfg, m, n, k)
            if why:
                rejected.append((what, why))
            else:
                kept.append(cfg)
    return (kept, rejected) if with_rejected else kept


def _misfit(cfg: GemmConfig, m, n, k) -> str | None:
    """Why ``cfg`` is not worth timing on an (m, n, k) problem, or None."""
    b = cfg.block
    if m is not None and b.m > max(64, 2 * m):
        return f"block m {b.m} > twice the rows ({m})"
    if n is not None and b.n > max(64, 2 * n):
        return f"block n {b.n} > twice the columns ({n})"
    if k is not None and cfg.pipeline.stages - 1 > max(1, -(-k // b.k)):
        return f"{cfg.pipeline.stages} stages for {-(-k // b.k)} k-tiles"
    return None


# ---- the choice an op call uses (the look-up: tilepy.ops.gemm_tuned) -------------------------

def pick_gemm_config(m: int, n: int, k: int, batch: int, dtype: str, heuristic,
                     device=None):
    """The config ``tilepy.gemm`` should run: the persisted tuned choice for this problem, else
    ``heuristic``. Never tunes. ``device``: the CUDA device id of the operands (None: current)."""
    choice = tuned_gemm_config(m, n, k, batch, dtype, heuristic, device)
    return heuristic if choice is None else choice


# ---- ahead-of-time tuning --------------------------------------------------------------------

@dataclass
class TuneResult:
    """What :func:`tune_gemm` (or ``tune_attention``) found: the winner, every candidate's
    row, the printed table."""

    config: GemmConfig
    rows: list
    key: str
    saved: bool
    rejected: list = field(default_factory=list)
    op: str = OP

    @property
    def table(self) -> str:
        best = next((r for r in self.rows if r.get("config") == describe_config(self.config)
                     and "ms" in r), None)
        return format_report(self.op, self.rows, best)


def _module(name):
    try:
        return __import__(name)
    except ImportError:
        return None


def gemm_inputs(m, n, k, dtype="float16", batch=1, seed=0):
    """Random ``a``, ``b`` and an ``out`` for a GEMM, on the GPU (PyTorch, else CuPy, else
    Numba device arrays; NumPy arrays in the simulator), and a function that copies an array
    back as float32 NumPy."""
    import numpy as np

    from .. import SIMULATOR

    rng = np.random.default_rng(seed)
    lead = (batch,) if batch > 1 else ()
    a = rng.uniform(-1, 1, lead + (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, lead + (k, n)).astype(np.float32)
    if SIMULATOR:
        np_dtype = np.float16 if dtype == "float16" else __import__("ml_dtypes").bfloat16
        return (a.astype(np_dtype), b.astype(np_dtype), np.empty(lead + (m, n), np_dtype),
                lambda x: np.asarray(x, dtype=np.float32))
    torch = _module("torch")
    if torch is not None and torch.cuda.is_available():
        t = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        ta, tb = (torch.from_numpy(x).to("cuda", t) for x in (a, b))
        return (ta, tb, torch.empty(lead + (m, n), dtype=t, device="cuda"),
                lambda x: x.float().cpu().numpy())
    cupy = _module("cupy")
    if cupy is not None and dtype == "float16":
        return (cupy.asarray(a.astype(np.float16)), cupy.asarray(b.astype(np.float16)),
                cupy.empty(lead + (m, n), np.float16),
                lambda x: cupy.asnumpy(x).astype(np.float32))
    from numba import cuda

    if dtype == "bfloat16":
        np_dtype = __import__("ml_dtypes").bfloat16
    else:
        np_dtype = np.float16
    try:
        da, db = cuda.to_device(a.astype(np_dtype)), cuda.to_device(b.astype(np_dtype))
        out = cuda.device_array(lead + (m, n), np_dtype)
    except Exception as e:
        raise RuntimeError(f"cannot allocate {dtype} inputs without PyTorch ({e}); install "
                           "torch to tune bfloat16") from e
    return da, db, out, lambda x: x.copy_to_host().astype(np.float32)


def _check_against_float64(a, b, ref, to_host, rows=64, seed=1) -> float:
    """Largest error of ``ref`` against a float64 product on a sample of rows, relative to
    the largest magnitude there."""
    import numpy as np

    ha, hb, hr = to_host(a), to_host(b), to_host(ref)
    if ha.ndim == 2:
        ha, hr = ha[None], hr[None]
    if hb.ndim == 2:
        hb = hb[None]
    pick = np.random.default_rng(seed).choice(ha.shape[1], min(rows, ha.shape[1]),
                                              replace=False)
    z = ha.shape[0] - 1
    exact = ha[z][pick].astype(np.float64) @ hb[min(z, hb.shape[0] - 1)].astype(np.float64)
    got = hr[z][pick]
    return float(np.abs(got - exact).max() / max(np.abs(exact).max(), 1e-30))


def tune_gemm(m: int, n: int, k: int, dtype: str = "float16", batch: int = 1, configs=None,
              *, warmup: int = 3, repeat: int = 20, timer=None, save: bool = True,
              cache_directory=None, table: bool = True) -> TuneResult:
    """Time ``tilepy.gemm`` on an (m × k) @ (k × n) problem (``batch`` of them) for every
    candidate config, keep the fastest, and persist it for :func:`pick_gemm_config`.

    ``configs``: the candidates (default: :func:`gemm_space` for this problem and device); the
    heuristic config always runs first and is the reference every other candidate's output is
    checked against (a candidate that fails to compile, fails to launch or gives a different
    answer is skipped and reported). ``timer(fn, warmup, repeat) -> ms`` replaces the CUDA-event
    timer (tests). Progress and the table go to stderr unless ``TILEPY_VERBOSE=0`` (the table
    not with ``table=False``). Returns a :class:`TuneResult`; its ``table`` is what the CLI
    prints.
    """
    import tilepy

    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be float16 or bfloat16 (the tensor-core path), got "
                         f"{dtype!r}")
    mma_heuristic = _gemm_op.choose_config(m, n, k, batch, dtype)
    # the reference is what the op runs untuned: the Hopper default where it applies
    heuristic = _gemm_op.hopper_config(m, n, batch, dtype, k=k) or mma_heuristic
    rejected = []
    if configs is None:
        configs, rejected = gemm_space(dtype, mma_heuristic.cc, m, n, k, with_rejected=True,
                                       hopper=heuristic is not mma_heuristic, batch=batch)
    candidates = [heuristic] + [c for c in configs if c != heuristic]
    kinds = (GemmConfig, *HOPPER_KINDS.values())
    for c in candidates:
        if not isinstance(c, kinds) or c.dtype != dtype:
            raise TypeError(f"configs must be GemmConfig, WgmmaConfig or WsConfig for "
                            f"{dtype}, got {c!r}")

    a, b, out, to_host = gemm_inputs(m, n, k, dtype, batch)
    launch, first_call = timing_first_calls(
        lambda cfg, a, b, out: tilepy.gemm(a, b, config=cfg, out=out))
    ref = launch(heuristic, a, b, None)   # its own output: `out` is the candidates'
    _synchronize()
    error = _check_against_float64(a, b, ref, to_host)
    limit = 2e-2 if dtype == "float16" else 4e-2
    if error > limit:
        raise RuntimeError(f"the heuristic config {heuristic.describe()} is off by {error:.3g} "
                           f"(relative) against a float64 product: not tuning a broken kernel")
    ref_host = to_host(ref)
    scale = max(float(abs(ref_host).max()), 1e-30)

    def same_as_heuristic(cfg, a, b, out):
        _synchronize()
        return float(abs(to_host(out) - ref_host).max()) <= limit * scale

    gpu = current_gpu_name()
    tuned = autotune(launch, candidates, key=lambda *args: ((m, n, k, batch), dtype), op=OP,
                     reference=same_as_heuristic, warmup=warmup, repeat=repeat, timer=timer,
                     gpu_name=lambda: gpu, cache_directory=cache_directory,
                     flops=lambda *args: 2.0 * m * n * k * batch, table=table)
    return conclude(tuned, (a, b, out), candidates, first_call,
                    gemm_key(m, n, k, batch, dtype, gpu), config_fields, [m, n, k, batch],
                    save, rejected, OP, (forget_choices, _gemm_op._PLANS.clear))


def timing_first_calls(run):
    """``(launch, first_call)``: ``launch(config, *args)`` returns ``run(config, *args)``; the
    first call for each config (it compiles, or loads from the disk cache) is synchronised and
    its seconds kept in ``first_call[describe_config(config)]``, which :func:`conclude` adds to
    that config's row."""
    first_call = {}

    def launch(cfg, *args):
        desc = describe_config(cfg)
        t = time.perf_counter()
        result = run(cfg, *args)
        if desc not in first_call:
            _synchronize()
            first_call[desc] = time.perf_counter() - t
        return result

    return launch, first_call


def conclude(tuned, args, candidates, first_call, key, fields_of, shape, save, rejected, op,
             forget) -> TuneResult:
    """The end every ``tune_*`` shares: time the candidates (``tuned.tune(*args)``), add each
    first call's seconds to its row, persist the winner under ``key`` (``fields_of(config)``
    and the problem's ``shape``) unless ``save`` is false, call each of ``forget`` (the op's
    remembered choices and its launch plans, made with the old configs), and return the
    :class:`TuneResult`."""
    best = tuned.tune(*args)
    rows = tuned.last_report
    for r in rows:
        if r["config"] in first_call:
            r["first_call_s"] = first_call[r["config"]]
    winner = candidates[best["index"]]
    entry = dict(best, fields=fields_of(winner), shape=list(shape),
                 tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    saved = tuned.cache.put(key, entry) if save else False
    for f in forget:
        f()
    return TuneResult(winner, rows, key, saved, rejected, op=op)


def _synchronize() -> None:
    from numba import cuda

    cuda.synchronize()


__all__ = ["GEMM_STAGES", "GEMM_TILES", "HOPPER_CANDIDATES", "TuneResult", "config_fields",
           "config_from_fields", "forget_choices", "gemm_inputs", "gemm_key", "gemm_space",
           "hopper_space", "pick_gemm_config", "tune_gemm", "tuned_gemm_config"]
