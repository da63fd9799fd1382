"""Autotuning: timing candidate configs and persisting the winners; the built-in config spaces.

This package runs the ops (it imports ``tilepy.ops``); nothing in ``tilepy.ops`` or
``tilepy.tile`` imports it. What an op call needs at run time lives below the ops: the
tuning-choice files in :mod:`tilepy.cache`, each op's look-up of its persisted choice beside
the op (:mod:`tilepy.ops.gemm_tuned`, :mod:`tilepy.ops.attention_tuned`,
:mod:`tilepy.ops.softmax`), the compiled-kernel disk cache in :mod:`tilepy.kcache`. The
modules here re-export those names where they were documented before.

* :mod:`tilepy.tune.autotune` — ``autotune(launch, configs, key=…)`` for any kernel;
* :mod:`tilepy.tune.cache` — the tuning choices as JSON under the tilepy cache directory
  (:mod:`tilepy.cache`'s);
* :mod:`tilepy.tune.spaces` — the GEMM config space, ``pick_gemm_config`` (what an op call
  runs) and ``tune_gemm`` (ahead-of-time tuning, ``python -m tilepy tune gemm``);
* :mod:`tilepy.tune.attention_space`, :mod:`tilepy.tune.softmax_space` — the same for
  ``tilepy.flash_attention`` and for ``tilepy.softmax`` / ``log_softmax`` (``python -m tilepy
  tune attention|softmax``);
* :mod:`tilepy.tune.kcache` — ``cached_jit``: generated kernels cached on disk across processes
  (:mod:`tilepy.kcache`'s).
"""

from ..cache import TuneCache, cache_dir, make_key, shape_bucket
from ..kcache import cached_jit, kernel_cache_dir
from . import cache, kcache
from .autotune import autotune, current_gpu_name, format_report
from .spaces import gemm_space, pick_gemm_config, tune_gemm

__all__ = ["TuneCache", "autotune", "cache", "cache_dir", "cached_jit", "current_gpu_name",
           "format_report", "gemm_space", "kcache", "kernel_cache_dir", "make_key",
           "pick_gemm_config", "shape_bucket", "tune_gemm"]
