"""The compiled-kernel disk cache, under its former name: :mod:`tilepy.kcache` owns it (the
ops import it from there, below ``tilepy.tune``); these are the same functions."""

from ..kcache import (  # noqa: F401
    ENV,
    cached_jit,
    clear,
    enable_disk_cache,
    enabled,
    file_stamp,
    is_cached,
    kernel_cache_dir,
    source_hash,
    stale_dirs,
    version_tag,
)

__all__ = ["ENV", "cached_jit", "clear", "enable_disk_cache", "enabled", "file_stamp",
           "is_cached", "kernel_cache_dir", "source_hash", "stale_dirs", "version_tag"]
