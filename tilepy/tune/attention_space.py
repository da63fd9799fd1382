"""The attention op's config space, its persisted choice, and ahead-of-time tuning — the
counterpart of :mod:`tilepy.tune.spaces` for ``tilepy.flash_attention``.

* :func:`attention_space` — candidate configs for a head dimension: the mma.sync kernel's
  (:class:`~tilepy.ops.attention_mma_sync.AttentionConfig`, block shapes that compile without
  spilling) and, on compute capability 9.0, the wgmma kernel's
  (:class:`~tilepy.ops.attention_wgmma.WgmmaAttentionConfig`) first. Invalid configs are pruned
  by their own validation before anything compiles.
* :func:`tuned_attention_config` — the persisted choice for a problem (batch × heads, query
  and key lengths, head_dim — bucketed to powers of two — causal or not, dtype, GPU, tilepy
  version), or None. ``tilepy.flash_attention`` asks it before its built-in choice; it never
  tunes. It belongs to the op (:mod:`tilepy.ops.attention_tuned`, with the key and the stored
  fields); this module re-exports it.
* :func:`tune_attention` — times every candidate (``python -m tilepy tune attention`` calls
  it), checks each output against the default config's, which is itself checked against a
  float64 reference on a few heads, persists the winner and returns it with the table.
"""

from __future__ import annotations

import math

from ..ops import attention as att
from ..ops.attention_tuned import (
    KINDS,
    OP,
    attention_key,
    config_fields,
    config_from_fields,
    forget_choices,
    problem,
    tuned_attention_config,
)
from .autotune import autotune, current_gpu_name
from .spaces import TuneResult, _device_cc, _module, _synchronize, conclude, timing_first_calls

#: (block_m, block_n, warp_rows) of the mma.sync kernel worth timing (bench/sweep_attention.py;
#: warp_rows 32 spills at head_dim > 64 in the offline compile).
MMA_SYNC_SHAPES = ((128, 64, 16), (128, 128, 16), (64, 64, 16), (128, 32, 16), (192, 64, 16))
MMA_SYNC_SHAPES_D64 = ((64, 128, 16), (128, 64, 32), (256, 64, 32))
#: (block_m, block_n) of the wgmma kernel (sm_90; every head dim, the cp.async kernels at 64
#: and 128 only; the built-in choice is a candidate too), each without and with
#: the softmax overlapped with P·V, on a grid and persistent, with cp.async or TMA loads, the
#: TMA ones with and without ping-pong and a producer warpgroup (where those are valid and
#: compile without spilling).
WGMMA_SHAPES = ((128, 64), (128, 128))


def attention_space(head_dim: int, dtype: str = "float16", cc=None, *,
                    hopper: bool | None = None, with_rejected: bool = False):
    """Candidate configs for ``head_dim`` and ``dtype`` on compute capability ``cc`` (default:
    the current device's). ``hopper`` (default: cc is 9.0) puts the wgmma kernel's configs
    first. ``with_rejected=True`` returns ``(configs, [(what, why), …])``."""
    cc = tuple(cc) if cc is not None else _device_cc()
    if hopper is None:
        hopper = cc[:2] == (9, 0)
    tries = []
    if hopper and cc[:2] == (9, 0):
        tries += [("wgmma", {"head_dim": head_dim, "block_m": bm, "block_n": bn, "dtype": dtype,
                             "overlap": overlap, "persistent": persistent, "tma": tma})
                  for bm, bn in WGMMA_SHAPES for overlap in (False, True)
                  for persistent in (False, True) for tma in (False, True)]
        # with a producer warpgroup also persistent (tiles handed out at run time)
        tries += [("wgmma", {"head_dim": head_dim, "block_m": 128, "block_n": bn,
                             "dtype": dtype, "overlap": True, "tma": True, "pingpong": pp,
                             "producer": pr, "persistent": ps})
                  for bn in (64, 128) for pp, pr in ((True, False), (False, True), (True, True))
                  for ps in ((False, True) if pr else (False,))]
        tries += [("wgmma", {"head_dim": head_dim, "block_m": 192, "block_n": bn,
                             "dtype": dtype, "overlap": True, "tma": True, "pingpong": pp,
                             "producer": True, "persistent": ps})  # three consumer warpgroups
                  for bn in (64, 128) for pp in (False, True) for ps in (False, True)]
    shapes = MMA_SYNC_SHAPES + (MMA_SYNC_SHAPES_D64 if head_dim <= 64 else ())
    tries += [("mma_sync", {"head_dim": head_dim, "block_m": bm, "block_n": bn, "warp_rows": wr,
                                "dtype": dtype, "cc": cc[:2]}) for bm, bn, wr in shapes]
    kept, rejected = [], []
    for kind, kw in tries:
        try:
            kept.append(KINDS[kind](**kw))
        except ValueError as e:
            rejected.append((f"{kind} {kw}", str(e)))
    return (kept, rejected) if with_rejected else kept


def attention_inputs(batch, heads, seq_q, seq_k, head_dim, dtype="float16", heads_kv=None,
                     seed=0):
    """Random q, k, v and an out on the GPU (PyTorch, else CuPy for float16; NumPy arrays in
    the simulator), and a function copying an array back as float32 NumPy."""
    import numpy as np

    from .. import SIMULATOR

    rng = np.random.default_rng(seed)
    hkv = heads_kv or heads
    host = [rng.standard_normal(s).astype(np.float32) for s in
            ((batch, heads, seq_q, head_dim), (batch, hkv, seq_k, head_dim),
             (batch, hkv, seq_k, head_dim))]
    if SIMULATOR:
        np_dtype = np.float16 if dtype == "float16" else __import__("ml_dtypes").bfloat16
        q, k, v = (x.astype(np_dtype) for x in host)
        return q, k, v, np.empty_like(q), lambda x: np.asarray(x, dtype=np.float32)
    torch = _module("torch")
    if torch is not None and torch.cuda.is_available():
        t = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        q, k, v = (torch.from_numpy(x).to("cuda", t) for x in host)
        return q, k, v, torch.empty_like(q), lambda x: x.float().cpu().numpy()
    cupy = _module("cupy")
    if cupy is None or dtype != "float16":
        raise RuntimeError("tuning attention needs PyTorch (or CuPy for float16)")
    q, k, v = (cupy.asarray(x.astype(np.float16)) for x in host)
    return q, k, v, cupy.empty_like(q), lambda x: cupy.asnumpy(x).astype(np.float32)


def _reference_error(q, k, v, out, causal, to_host, heads=2) -> float:
    """Largest error of ``out`` against a float64 attention on the first ``heads`` heads of the
    first batch, relative to the largest magnitude there (GQA: heads map as the op maps them)."""
    import numpy as np

    hq, hk, hv, ho = (to_host(x)[0].astype(np.float64) for x in (q, k, v, out))
    group = hq.shape[0] // hk.shape[0]
    sq, sk = hq.shape[1], hk.shape[1]
    worst, scale = 0.0, 1e-30
    for h in range(min(heads, hq.shape[0])):
        s = hq[h] @ hk[h // group].T / math.sqrt(hq.shape[2])
        if causal:  # bottom-right aligned
            s = np.where(np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq), -np.inf, s)
        m = s.max(axis=1, keepdims=True)
        p = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        den = p.sum(axis=1, keepdims=True)
        ref = (p / np.where(den > 0, den, 1)) @ hv[h // group]
        worst = max(worst, float(np.abs(ho[h] - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
    return worst / scale


def tune_attention(batch: int, heads: int, seq_q: int, seq_k: int | None = None,
                   head_dim: int = 128, dtype: str = "float16", causal: bool = False,
                   heads_kv: int | None = None, configs=None, *, warmup: int = 3,
                   repeat: int = 20, timer=None, save: bool = True, cache_directory=None,
                   table: bool = True) -> TuneResult:
    """Time ``tilepy.flash_attention`` on a (batch, heads, seq_q, head_dim) problem (keys:
    ``seq_k``, default ``seq_q``; ``heads_kv`` KV heads, default ``heads``) for every candidate
    config, keep the fastest, and persist it for :func:`tuned_attention_config`.

    ``configs``: the candidates (default: :func:`attention_space`); the op's default config
    runs first and is the reference every other candidate's output is checked against.
    ``timer(fn, warmup, repeat) -> ms`` replaces the CUDA-event timer (tests). Returns a
    :class:`~tilepy.tune.spaces.TuneResult`.
    """
    import tilepy

    seq_k = seq_q if seq_k is None else seq_k
    for name, val in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k),
                      ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    default = att.choose_config(head_dim, dtype, causal)
    rejected = []
    if configs is None:
        configs, rejected = attention_space(head_dim, dtype, with_rejected=True)
    candidates = [default] + [c for c in configs if c != default]
    kinds = tuple(KINDS.values())
    for c in candidates:
        if not isinstance(c, kinds) or c.dtype != dtype or c.head_dim != head_dim:
            raise TypeError(f"configs must be AttentionConfig or WgmmaAttentionConfig for "
                            f"head_dim {head_dim} and {dtype}, got {c!r}")

    q, k, v, out, to_host = attention_inputs(batch, heads, seq_q, seq_k, head_dim, dtype,
                                             heads_kv)
    launch, first_call = timing_first_calls(
        lambda cfg, q, k, v, out: tilepy.flash_attention(q, k, v, causal=causal, config=cfg,
                                                         out=out))

    launch(default, q, k, v, out)
    _synchronize()
    error = _reference_error(q, k, v, out, causal, to_host)
    limit = 2e-2 if dtype == "float16" else 4e-2
    if not error <= limit:
        raise RuntimeError(f"the default config {default.describe()} is off by {error:.3g} "
                           "(relative) against a float64 attention: not tuning a broken kernel")
    ref_host = to_host(out)
    scale = max(float(abs(ref_host).max()), 1e-30)

    def same_as_default(cfg, q, k, v, out):
        _synchronize()
        return float(abs(to_host(out) - ref_host).max()) <= limit * scale

    flop = 4.0 * batch * heads * seq_q * seq_k * head_dim * (0.5 if causal else 1.0)
    gpu = current_gpu_name()
    key = attention_key(batch, heads, seq_q, seq_k, head_dim, dtype, causal, gpu)
    tuned = autotune(launch, candidates, op=OP, reference=same_as_default, warmup=warmup,
                     repeat=repeat, timer=timer, gpu_name=lambda: gpu,
                     key=lambda *args: (problem(batch, heads, seq_q, seq_k, head_dim),
                                        dtype + ("-causal" if causal else "")),
                     cache_directory=cache_directory, flops=lambda *args: flop, table=table)
    return conclude(tuned, (q, k, v, out), candidates, first_call, key, config_fields,
                    [batch, heads, seq_q, seq_k, head_dim, bool(causal)], save, rejected, OP,
                    (forget_choices, att._PLANS.clear))


__all__ = ["MMA_SYNC_SHAPES", "WGMMA_SHAPES", "attention_inputs", "attention_key",
           "attention_space", "config_fields", "config_from_fields", "forget_choices",
           "tune_attention", "tuned_attention_config"]
