"""The GEMM config a tuning run persisted, as ``tilepy.gemm`` reads it.

``python -m tilepy tune gemm`` (:func:`tilepy.tune.spaces.tune_gemm`) writes the winner of a
timing run to the ``gemm`` file of :mod:`tilepy.cache` under :func:`gemm_key`, as
:func:`config_fields`; :func:`tuned_gemm_config` reads it back with :func:`config_from_fields`.
Both sides use these functions, so the op needs nothing of ``tilepy.tune``.

A stored choice names its kernel (``kind``): ``mma_sync`` (a
:class:`~tilepy.tile.config.GemmConfig`: block, warps, stages, swizzle) or one of the Hopper
kernels of :data:`HOPPER_KINDS` (their config's fields).
"""

from __future__ import annotations

import dataclasses

from ..cache import StoredChoices, autotune_enabled, current_gpu_name, make_key, tilepy_version
from ..tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout
from .gemm_wgmma import WgmmaConfig
from .gemm_wgmma_ws import WsConfig

OP = "gemm"

#: The Hopper kernels' config classes by the ``kind`` a stored choice names: the
#: warp-specialised TMA kernel and the cp.async wgmma kernel.
HOPPER_KINDS = {"wgmma_ws": WsConfig, "wgmma": WgmmaConfig}

_stored = StoredChoices(OP)


def gemm_key(m, n, k, batch, dtype, gpu) -> str:
    """The tuning-cache key of a GEMM problem (shapes bucketed to powers of two)."""
    return make_key(OP, (m, n, k, batch), dtype, gpu, tilepy_version())


def config_fields(cfg) -> dict:
    """What a persisted choice stores to rebuild ``cfg``: a GemmConfig's tile, warps, stages
    and swizzle, or a Hopper config's kernel (``kind``) and fields (its dtype aside)."""
    for kind, cls in HOPPER_KINDS.items():
        if isinstance(cfg, cls):
            return {"kind": kind, **{f.name: getattr(cfg, f.name)
                                     for f in dataclasses.fields(cls) if f.name != "dtype"}}
    return {"block": [cfg.block.m, cfg.block.n, cfg.block.k],
            "warps": [cfg.warps.m, cfg.warps.n], "stages": cfg.pipeline.stages,
            "swizzle": cfg.swizzle}


def config_from_fields(fields: dict, like: GemmConfig):
    """The config a persisted choice names (dtype and cc of ``like``); None if the entry is
    malformed or no longer valid (a Hopper config off a compute capability 9.0 device, too)."""
    kind = fields.get("kind", "mma_sync")
    if kind != "mma_sync":
        cls = HOPPER_KINDS.get(kind)
        if cls is None or tuple(like.cc)[:2] != (9, 0):
            return None
        try:
            return cls(**{k: v for k, v in fields.items() if k != "kind"}, dtype=like.dtype)
        except (TypeError, ValueError):
            return None
    try:
        return GemmConfig(BlockTile(*map(int, fields["block"])),
                          WarpLayout(*map(int, fields["warps"])),
                          Pipeline(int(fields["stages"])), like.dtype,
                          bool(fields.get("swizzle", True)), like.cc)
    except (KeyError, TypeError, ValueError):
        return None


def tuned_gemm_config(m: int, n: int, k: int, batch: int, dtype: str, like: GemmConfig,
                      device=None):
    """The persisted tuned choice for this problem (dtype and compute capability of ``like``,
    a GemmConfig), or None: no choice, or ``TILEPY_AUTOTUNE=0``. ``device``: the CUDA device
    id of the operands (None: the current one). Never tunes; after the first look-up for a
    problem it costs a dictionary lookup."""
    if not autotune_enabled():
        return None

    def rebuild(entry):
        fields = entry.get("fields")
        return config_from_fields(fields, like) if isinstance(fields, dict) else None

    return _stored.lookup((m, n, k, batch, dtype, device), lambda: current_gpu_name(device),
                          lambda gpu: gemm_key(m, n, k, batch, dtype, gpu), rebuild)


def forget_choices() -> None:
    """Drop this process's memory of the tuning file (after it changed)."""
    _stored.forget()


__all__ = ["HOPPER_KINDS", "OP", "config_fields", "config_from_fields", "forget_choices",
           "gemm_key", "tuned_gemm_config"]
