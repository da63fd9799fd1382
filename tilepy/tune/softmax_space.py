"""The softmax ops' config space, their persisted choice, and ahead-of-time tuning — the
counterpart of :mod:`tilepy.tune.spaces` for ``tilepy.softmax`` and ``tilepy.log_softmax``.

A softmax config is a :class:`tilepy.ops.softmax.Plan`: the kernel path (``warp``: one warp
per row; ``block``: one block per row, the row in registers; ``online``: one block per row,
two reads), warps per block, and values per thread.

* :func:`softmax_space` — candidate plans for rows of ``n`` values of a dtype: the built-in
  :func:`~tilepy.ops.softmax.plan` first, then other block sizes of the paths that can run
  such rows; invalid ones (too short to cover a row, more registers than fit) are pruned by
  :func:`~tilepy.ops.softmax.check_plan` before anything compiles.
* :func:`tuned_softmax_plan` — the persisted choice for (rows, n — bucketed to powers of two
  —, dtype, GPU, tilepy version), or None. The ops ask it before their built-in plan; it
  never tunes. It belongs to the op (:mod:`tilepy.ops.softmax`, with the key and the stored
  fields); this module re-exports it.
* :func:`tune_softmax` — times every candidate (``python -m tilepy tune softmax``), checks
  each output against the built-in plan's, which is itself checked against a float64 softmax
  on a sample of rows, persists the winner and returns it with the table (GB/s counts one
  read and one write of the tensor).
"""

from __future__ import annotations

from .. import arrays
from ..arrays import ITEMSIZE
from ..ops import softmax as sm
from ..ops.softmax import (
    TUNED_OP as OP,
    forget_choices,
    plan_fields,
    plan_from_fields,
    softmax_key,
    tuned_softmax_plan,
)
from .autotune import autotune, current_gpu_name
from .spaces import TuneResult, _module, _synchronize, conclude, timing_first_calls

DTYPES = ("float32", "float16", "bfloat16")
#: Relative error allowed against float64 (and between two plans' outputs), per dtype.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

#: Warps per block of the warp path worth timing (one row per warp).
WARP_PATH_WARPS = (1, 2, 4, 8, 16)
#: Threads per block of the block path worth timing (values per thread follow from the row).
BLOCK_PATH_THREADS = (128, 256, 512, 1024)
#: (warps, values per thread per step) of the online path worth timing.
ONLINE_PATH = ((8, 16), (16, 8), (16, 16), (32, 8), (32, 16))
#: The simulator's versions (every thread is a Python thread: small blocks only).
SIM_WARP_PATH_WARPS = (1, 2, 4)
SIM_BLOCK_PATH_THREADS = (32, 64, 128)
SIM_ONLINE_PATH = ((2, 2), (2, 4), (4, 2))


def softmax_space(n: int, dtype: str = "float32", *, simulator: bool | None = None,
                  with_rejected: bool = False):
    """Candidate plans for rows of ``n`` values of ``dtype``, the built-in plan first.
    ``with_rejected=True`` returns ``(plans, [(what, why), …])``."""
    from ..ops.softmax import (
        MEDIUM_MAX,
        SHORT_MAX,
        VECTOR_BYTES,
        Plan,
        _pow2_at_least,
        check_plan,
        plan,
    )

    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    sim = arrays.SIMULATOR if simulator is None else simulator
    size = ITEMSIZE[dtype]
    bucket = _pow2_at_least(n)
    tries = [plan(n, simulator=sim, itemsize=size)]
    if n <= SHORT_MAX:
        per_lane = max(32, bucket) // 32
        tries += [Plan("warp", w, per_lane)
                  for w in (SIM_WARP_PATH_WARPS if sim else WARP_PATH_WARPS)]
    if 256 <= n <= MEDIUM_MAX:   # at least one 16-byte vector per thread
        tries += [Plan("block", t // 32, bucket // t)
                  for t in (SIM_BLOCK_PATH_THREADS if sim else BLOCK_PATH_THREADS)
                  if bucket // t * size >= VECTOR_BYTES]
    if n > SHORT_MAX:
        tries += [Plan("online", w, u) for w, u in (SIM_ONLINE_PATH if sim else ONLINE_PATH)]
    kept, rejected = [], []
    for p in tries:
        if p in kept:
            continue
        try:
            check_plan(p, n, size, simulator=sim)
        except ValueError as e:
            rejected.append((p.describe(), str(e)))
            continue
        kept.append(p)
    return (kept, rejected) if with_rejected else kept


def softmax_inputs(rows: int, n: int, dtype: str = "float32", seed: int = 0):
    """Random ``x`` (rows, n) and an ``out`` on the GPU (PyTorch, else CuPy; NumPy arrays in
    the simulator), and a function copying an array back as float32 NumPy."""
    import numpy as np

    from .. import SIMULATOR

    host = np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32) * 4
    if SIMULATOR:
        np_dtype = __import__("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype
        x = host.astype(np_dtype)
        return x, np.empty_like(x), lambda a: np.array(a, dtype=np.float32)   # a copy
    torch = _module("torch")
    if torch is not None and torch.cuda.is_available():
        x = torch.from_numpy(host).to("cuda", getattr(torch, dtype))
        return x, torch.empty_like(x), lambda a: a.float().cpu().numpy()
    cupy = _module("cupy")
    if cupy is None or dtype == "bfloat16":
        raise RuntimeError("tuning softmax needs PyTorch (or CuPy for float32 / float16)")
    x = cupy.asarray(host.astype(dtype))
    return x, cupy.empty_like(x), lambda a: cupy.asnumpy(a).astype(np.float32)


def _reference_error(x, out, to_host, rows: int = 64) -> float:
    """Largest error of ``out`` against a float64 softmax of ``x`` on a sample of rows,
    relative to the largest value there."""
    import numpy as np

    hx, ho = to_host(x), to_host(out)
    pick = np.random.default_rng(1).choice(hx.shape[0], min(rows, hx.shape[0]), replace=False)
    v = hx[pick].astype(np.float64)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    return float(np.abs(ho[pick] - ref).max() / max(np.abs(ref).max(), 1e-30))


def tune_softmax(rows: int, n: int, dtype: str = "float32", configs=None, *, log: bool = False,
                 warmup: int = 3, repeat: int = 20, timer=None, save: bool = True,
                 cache_directory=None, table: bool = True) -> TuneResult:
    """Time ``tilepy.softmax`` (``log=True``: ``log_softmax``) on ``rows`` rows of ``n`` values
    for every candidate plan, keep the fastest, and persist it for :func:`tuned_softmax_plan`
    (one choice serves both ops).

    ``configs``: the candidate plans (default: :func:`softmax_space`); the built-in plan runs
    first and is the reference every other candidate's output is checked against.
    ``timer(fn, warmup, repeat) -> ms`` replaces the CUDA-event timer (tests). Returns a
    :class:`~tilepy.tune.spaces.TuneResult`.
    """
    import tilepy

    for name, val in (("rows", rows), ("n", n)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    rejected = []
    if configs is None:
        configs, rejected = softmax_space(n, dtype, with_rejected=True)
    default = sm.plan(n, itemsize=ITEMSIZE[dtype])
    candidates = [default] + [c for c in configs if c != default]
    for c in candidates:
        sm.check_plan(c, n, ITEMSIZE[dtype])   # TypeError / ValueError before anything runs
    op = tilepy.log_softmax if log else tilepy.softmax

    x, out, to_host = softmax_inputs(rows, n, dtype)
    launch, first_call = timing_first_calls(lambda p, x, out: op(x, out=out, config=p))

    launch(default, x, out)
    _synchronize()
    tol = TOL[dtype]
    if not log:
        error = _reference_error(x, out, to_host)
        if not error <= tol:
            raise RuntimeError(f"the built-in plan {default.describe()} is off by {error:.3g} "
                               "(relative) against a float64 softmax: not tuning a broken "
                               "kernel")
    ref_host = to_host(out)
    scale = max(float(abs(ref_host).max()), 1e-30)

    def same_as_default(p, x, out):
        _synchronize()
        return float(abs(to_host(out) - ref_host).max()) <= tol * scale

    gpu = current_gpu_name()
    key = softmax_key(rows, n, dtype, gpu)
    tuned = autotune(launch, candidates, op=OP, reference=same_as_default, warmup=warmup,
                     repeat=repeat, timer=timer, gpu_name=lambda: gpu,
                     key=lambda *args: ((rows, n), dtype), cache_directory=cache_directory,
                     nbytes=lambda *args: 2.0 * rows * n * ITEMSIZE[dtype], table=table)
    return conclude(tuned, (x, out), candidates, first_call, key, plan_fields, [rows, n],
                    save, rejected, OP, (forget_choices, sm._PLANS.clear))


__all__ = ["BLOCK_PATH_THREADS", "ONLINE_PATH", "WARP_PATH_WARPS", "forget_choices",
           "plan_fields", "plan_from_fields", "softmax_inputs", "softmax_key", "softmax_space",
           "tune_softmax", "tuned_softmax_plan"]
