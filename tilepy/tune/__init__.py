"""Autotuning and its on-disk cache (see :mod:`tilepy.tune.autotune`, :mod:`tilepy.tune.cache`)."""

from .autotune import autotune, format_report  # noqa: F401
from .cache import TuneCache, cache_dir, make_key, shape_bucket  # noqa: F401
