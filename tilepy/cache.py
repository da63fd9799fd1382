"""tilepy's cache directory, and the tuning choices kept in it: one JSON file per op.

This is the store both sides share: ``tilepy.tune`` writes a choice after timing the
candidates, and an op call reads it (``tilepy.ops``, which import nothing of ``tilepy.tune``).
Each op turns its configs into stored fields and back itself; this module knows only keys,
files and JSON-able dicts.

* Location: ``$TILEPY_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/tilepy`` or ``~/.cache/tilepy``
  (tuning choices under ``tune/``, compiled kernels under ``kernels/``: :mod:`tilepy.kcache`).
* Keys say what a choice is valid for: op, shape bucket, dtype, GPU name and tilepy version
  (see :func:`make_key`, :func:`current_gpu_name`).
* Writes are atomic (a temporary file renamed over the old one) and serialised by an advisory
  lock on a side file, so concurrent processes neither corrupt the file nor lose each other's
  entries.
* A file that does not parse is moved aside (``<op>.json.corrupt-<time>``) with one warning,
  and the cache starts empty. A directory that cannot be written means no caching, with one
  warning per directory — never an exception.
* ``TILEPY_AUTOTUNE=0`` (:func:`autotune_enabled`): ops read no stored choice and
  ``tilepy.tune.autotune`` never tunes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: atomic replace only
    fcntl = None

_warned: set = set()


def cache_dir() -> str:
    env = os.environ.get("TILEPY_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tilepy")


def autotune_enabled() -> bool:
    """False when ``TILEPY_AUTOTUNE`` is 0 / false / no: no stored choice is read, nothing is
    tuned."""
    return os.environ.get("TILEPY_AUTOTUNE", "1").strip() not in ("0", "false", "no")


def tilepy_version() -> str:
    """The running tilepy's version: part of every tuning-cache key."""
    from . import __version__

    return __version__


def current_gpu_name(device=None) -> str:
    """The name of CUDA device ``device`` (default: the current one); "simulator" in the
    CUDA simulator. Part of every tuning-cache key."""
    from . import devices

    return devices.info(device).name


def shape_bucket(n: int) -> int:
    """Sizes round up to a power of two (min 16): nearby shapes share one tuning result."""
    b = 16
    while b < n:
        b *= 2
    return b


def make_key(op: str, shape, dtype: str, gpu: str, version: str) -> str:
    buckets = "x".join(str(shape_bucket(int(s))) for s in shape)
    return f"{op}|{buckets}|{dtype}|{gpu}|{version}"


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive advisory lock on ``path`` (created if need be) for the ``with`` block;
    serialises read-modify-write of a cache file across processes."""
    with open(path, "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _warn_once(tag, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class TuneCache:
    """``get(key)`` / ``put(key, value)`` for one op's file; values are JSON-able dicts."""

    def __init__(self, op: str, directory: str | None = None):
        self.op = op
        self.directory = os.path.join(directory or cache_dir(), "tune")
        self.path = os.path.join(self.directory, f"{op}.json")
        self.enabled = True

    # ---- reading ----
    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise TypeError("top level is not an object")
            return data
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            aside = f"{self.path}.corrupt-{int(time.time() * 1000)}"
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            warnings.warn(f"tilepy: tuning cache {self.path} was unreadable ({e}); moved to "
                          f"{aside} and starting afresh", RuntimeWarning, stacklevel=3)
            return {}
        except OSError as e:
            _warn_once(self.directory, f"tilepy: cannot read tuning cache {self.path} ({e}); "
                       "tuning results will not be reused")
            return {}

    def get(self, key: str):
        return self._read().get(key)

    def entries(self) -> dict:
        return self._read()

    # ---- writing ----
    def put(self, key: str, value) -> bool:
        """Store ``value`` under ``key``; False (and one warning) if the cache is not writable."""
        if not self.enabled:
            return False
        try:
            os.makedirs(self.directory, exist_ok=True)
            with file_lock(self.path + ".lock"):
                data = self._read()
                data[key] = value
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.op}.",
                                           suffix=".tmp")
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(data, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            return True
        except OSError as e:
            self.enabled = False
            _warn_once(self.directory, f"tilepy: tuning cache directory {self.directory} is "
                       f"not writable ({e}); tuning results will not be saved")
            return False


class StoredChoices:
    """One op's persisted tuning choices as op calls ask for them: each GPU's file is read once
    per process and each problem's answer is remembered (at most ``limit`` answers; then the
    memory starts afresh). ``forget()`` after the file changed."""

    def __init__(self, op: str, limit: int = 4096):
        self.op, self.limit = op, limit
        self._entries: dict = {}   # gpu name -> the op's file, as read
        self._answers: dict = {}   # problem -> config or None

    def lookup(self, problem, gpu_name, key_of, rebuild):
        """The config for ``problem`` (hashable): ``gpu_name()`` names the GPU, ``key_of(gpu)``
        gives the tuning-file key, ``rebuild(entry)`` turns a stored dict into a config or
        None (malformed, no longer valid)."""
        try:
            return self._answers[problem]
        except KeyError:
            pass
        if len(self._answers) >= self.limit:
            self._answers.clear()
        gpu = gpu_name()
        entries = self._entries.get(gpu)
        if entries is None:
            entries = self._entries[gpu] = TuneCache(self.op).entries()
        entry = entries.get(key_of(gpu))
        answer = rebuild(entry) if isinstance(entry, dict) else None
        self._answers[problem] = answer
        return answer

    def forget(self) -> None:
        self._entries.clear()
        self._answers.clear()


__all__ = ["StoredChoices", "TuneCache", "autotune_enabled", "cache_dir", "current_gpu_name",
           "file_lock", "make_key", "shape_bucket", "tilepy_version"]
