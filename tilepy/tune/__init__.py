"""Autotuning, its on-disk cache, built-in config spaces, and the compiled-kernel disk cache.

* :mod:`tilepy.tune.autotune` — ``autotune(launch, configs, key=…)`` for any kernel;
* :mod:`tilepy.tune.cache` — the tuning choices as JSON under the tilepy cache directory;
* :mod:`tilepy.tune.spaces` — the GEMM config space, ``pick_gemm_config`` (what an op call
  runs) and ``tune_gemm`` (ahead-of-time tuning, ``python -m tilepy tune gemm``);
* :mod:`tilepy.tune.attention_space`, :mod:`tilepy.tune.softmax_space` — the same for
  ``tilepy.flash_attention`` and for ``tilepy.softmax`` / ``log_softmax`` (``python -m tilepy
  tune attention|softmax``);
* :mod:`tilepy.tune.kcache` — ``cached_jit``: generated kernels cached on disk across processes.
"""

from .autotune import autotune, current_gpu_name, format_report  # noqa: F401
from .cache import TuneCache, cache_dir, make_key, shape_bucket  # noqa: F401
from .kcache import cached_jit, kernel_cache_dir  # noqa: F401
from .spaces import gemm_space, pick_gemm_config, tune_gemm  # noqa: F401
