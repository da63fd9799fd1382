"""The tuning-choice files, under their former name: :mod:`tilepy.cache` owns them (op calls
read them from there, below ``tilepy.tune``); these are the same classes and functions."""

from ..cache import (  # noqa: F401
    StoredChoices,
    TuneCache,
    cache_dir,
    file_lock,
    make_key,
    shape_bucket,
)

__all__ = ["StoredChoices", "TuneCache", "cache_dir", "file_lock", "make_key", "shape_bucket"]
