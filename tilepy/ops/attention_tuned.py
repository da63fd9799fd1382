"""The attention config a tuning run persisted, as ``tilepy.flash_attention`` reads it.

``python -m tilepy tune attention`` (:func:`tilepy.tune.attention_space.tune_attention`)
writes the winner of a timing run to the ``attention`` file of :mod:`tilepy.cache` under
:func:`attention_key`, as :func:`config_fields`; :func:`tuned_attention_config` reads it back
with :func:`config_from_fields`. Both sides use these functions, so the op needs nothing of
``tilepy.tune``.

A stored choice names its kernel (``kind``, :data:`KINDS`): ``mma_sync``
(:class:`~tilepy.ops.attention_mma_sync.AttentionConfig`) or ``wgmma``
(:class:`~tilepy.ops.attention_wgmma.WgmmaAttentionConfig`), with the config's fields.
"""

from __future__ import annotations

import dataclasses

from ..cache import StoredChoices, autotune_enabled, current_gpu_name, make_key, tilepy_version
from .attention_mma_sync import AttentionConfig
from .attention_wgmma import WgmmaAttentionConfig

OP = "attention"

#: The config classes by the ``kind`` a stored choice names.
KINDS = {"mma_sync": AttentionConfig, "wgmma": WgmmaAttentionConfig}

_stored = StoredChoices(OP)


def problem(batch, heads, seq_q, seq_k, head_dim):
    """The sizes a choice is keyed by: (batch × heads, seq_q, seq_k, head_dim)."""
    return (batch * heads, seq_q, seq_k, head_dim)


def attention_key(batch, heads, seq_q, seq_k, head_dim, dtype, causal, gpu) -> str:
    """The tuning-cache key of an attention problem (sizes bucketed to powers of two)."""
    return make_key(OP, problem(batch, heads, seq_q, seq_k, head_dim),
                    dtype + ("-causal" if causal else ""), gpu, tilepy_version())


def config_fields(cfg) -> dict:
    """What a persisted choice stores to rebuild ``cfg`` (its kernel and fields, dtype aside)."""
    for kind, cls in KINDS.items():
        if isinstance(cfg, cls):
            return {"kind": kind, **{f.name: list(v) if isinstance(v, tuple) else v
                                     for f in dataclasses.fields(cls)
                                     if f.name != "dtype" for v in [getattr(cfg, f.name)]}}
    raise TypeError(f"not an attention config: {cfg!r}")


def config_from_fields(fields, dtype: str, head_dim: int):
    """The config a persisted choice names, or None when it is malformed, no longer valid, or
    for another head_dim."""
    if not isinstance(fields, dict):
        return None
    cls = KINDS.get(fields.get("kind"))
    if cls is None:
        return None
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k != "kind"}
    try:
        cfg = cls(**kw, dtype=dtype)
    except (TypeError, ValueError):
        return None
    return cfg if cfg.head_dim == head_dim else None


def tuned_attention_config(batch, heads, seq_q, seq_k, head_dim, dtype, causal, device=None):
    """The persisted tuned choice for this problem, or None (none, or ``TILEPY_AUTOTUNE=0``).
    ``device``: the CUDA device id of the operands (None: the current one). Never tunes."""
    if not autotune_enabled():
        return None
    return _stored.lookup(
        (batch, heads, seq_q, seq_k, head_dim, dtype, bool(causal), device),
        lambda: current_gpu_name(device),
        lambda gpu: attention_key(batch, heads, seq_q, seq_k, head_dim, dtype, causal, gpu),
        lambda entry: config_from_fields(entry.get("fields"), dtype, head_dim))


def forget_choices() -> None:
    """Drop this process's memory of the tuning file (after it changed)."""
    _stored.forget()


__all__ = ["KINDS", "OP", "attention_key", "config_fields", "config_from_fields",
           "forget_choices", "problem", "tuned_attention_config"]
