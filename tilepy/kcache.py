"""Compiled kernels on disk: a second process loads a generated kernel instead of compiling it.

``@cached_jit`` (or ``@cached_jit(launch_bounds=…)``) is ``@cuda.jit`` plus this cache, for
kernels — device functions are compiled into their kernels and need none. It uses Numba-CUDA's
own kernel cache (index + data files holding the PTX and cubin, keyed by signature, compute
capability, CUDA version and numba-cuda version), with four changes, all in this module:

* **Where**: ``<tilepy cache dir>/kernels/<tilepy version>-<source hash>/`` (the cache dir of
  :func:`tilepy.cache.cache_dir`: ``$TILEPY_CACHE_DIR``, else the user cache dir). The
  source hash covers every ``.py`` file of the tilepy package, so an edit anywhere in tilepy
  (``tile/``, ``ptx/``, …) starts a new directory. Numba's own key only sees the defining
  file's timestamp and the closure cells.
* **A stable closure key**: Numba hashes a closure's cells by pickling them, and a pickled
  Numba ``@intrinsic`` carries a per-process uuid — so with plain ``cache=True`` no tilepy
  kernel (their closures reach tilepy's PTX intrinsics) would ever be found again by another
  process. Here intrinsics are keyed by name and declaration instead (tilepy's by their
  ``tilepy.ptx`` instruction spec, others by their pickled definition). Distinct configs of one
  generator get distinct entries (their closure constants differ); the kernel's jit options
  (``launch_bounds``, …) are in the key too.
* **Safe concurrent writes**: data files are named after a hash of their key (Numba numbers
  them, and two processes saving different kernels of one generator at once could leave an
  index entry pointing at the other's code); index updates are serialised by a lock file.
* **Never a crash**: a directory that cannot be written means no disk cache and one warning;
  an unreadable entry is set aside with a warning and compiled afresh.

``TILEPY_KERNEL_CACHE=0`` turns it off. In the CUDA simulator it does nothing (nothing is
compiled there). It reaches into Numba-CUDA internals (``CUDACache``, ``_CacheLocator``,
``IndexDataCacheFile``); if those change shape the cache turns itself off with one warning.

The kernel modules of ``tilepy.ops`` and ``tilepy.tile`` import it from here (it imports no
op); ``tilepy.tune.kcache`` offers the same functions under their former module name.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time

from .cache import _warn_once, cache_dir, file_lock

ENV = "TILEPY_KERNEL_CACHE"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def enabled() -> bool:
    """False when ``TILEPY_KERNEL_CACHE`` is 0 / false / no / off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _simulator() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@functools.cache
def source_hash(package_dir: str = _PACKAGE) -> str:
    """16 hex digits of SHA-256 over the relative path and bytes of every ``.py`` file of the
    package (sorted), computed once per process."""
    h = hashlib.sha256()
    paths = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        h.update(os.path.relpath(path, package_dir).replace(os.sep, "/").encode())
        h.update(b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()[:16]


def version_tag() -> str:
    """``<tilepy version>-<source hash>``: the name of this build's kernel directory."""
    from . import __version__

    return f"{__version__}-{source_hash()}"


def kernel_cache_dir(root: str | None = None) -> str:
    """Where this build of tilepy keeps compiled kernels."""
    return os.path.join(root or cache_dir(), "kernels", version_tag())


def _subdir(py_file: str) -> str:
    """Kernels of tilepy's own files by package-relative folder (``ops``); others by a hash
    of their folder (as Numba does), under ``user/``."""
    path = os.path.abspath(py_file)
    folder = os.path.dirname(path)
    if os.path.commonpath([path, _PACKAGE]) == _PACKAGE:
        rel = os.path.relpath(folder, _PACKAGE)
        return "tilepy" if rel == "." else "tilepy-" + rel.replace(os.sep, "-")
    digest = hashlib.sha1(folder.encode()).hexdigest()[:16]
    return os.path.join("user", f"{os.path.basename(folder)}_{digest}")


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def file_stamp(path: str):
    """What makes the defining file's entries stale: its content (not its timestamp, so a
    reinstall of the same sources keeps the cache) and tilepy's source hash."""
    st = os.stat(path)
    return (source_hash(), _file_digest(path, st.st_mtime_ns, st.st_size))


def cached_jit(func=None, **jit_kwargs):
    """``cuda.jit`` for a kernel, with tilepy's disk cache (see the module docstring)::

        @cached_jit
        def kernel(...): ...

        @cached_jit(launch_bounds=256)
        def kernel(...): ...
    """
    if func is None:
        return lambda f: cached_jit(f, **jit_kwargs)
    from numba import cuda

    dispatcher = cuda.jit(**jit_kwargs)(func) if jit_kwargs else cuda.jit(func)
    return enable_disk_cache(dispatcher)


def enable_disk_cache(dispatcher):
    """Give a ``cuda.jit`` kernel dispatcher tilepy's disk cache; returns the dispatcher.

    Does nothing in the simulator, with ``TILEPY_KERNEL_CACHE=0``, or for device functions.
    A cache directory that cannot be written means one warning and no disk cache.
    """
    if _simulator() or not enabled():
        return dispatcher
    if getattr(dispatcher, "targetoptions", {}).get("device"):
        return dispatcher
    try:
        machinery = _machinery()
    except Exception as e:  # noqa: BLE001 - Numba-CUDA internals moved: no disk cache
        _warn_once("kcache-internals", f"tilepy: the kernel disk cache is off: this "
                   f"numba-cuda does not offer the cache internals it uses ({e!r})")
        return dispatcher
    try:
        dispatcher._cache = machinery.Cache(dispatcher.py_func,
                                            getattr(dispatcher, "targetoptions", {}))
    except OSError as e:
        directory = kernel_cache_dir()
        _warn_once(("kcache", directory), f"tilepy: kernel cache directory {directory} is not "
                   f"writable ({e}); compiled kernels will not be reused by other processes")
    return dispatcher


def is_cached(dispatcher) -> bool:
    """Whether ``dispatcher`` has tilepy's disk cache."""
    if _simulator():
        return False
    try:
        return isinstance(dispatcher._cache, _machinery().Cache)
    except Exception:  # noqa: BLE001 - no machinery, no cache
        return False


def stale_dirs(root: str | None = None) -> list:
    """Kernel directories of other tilepy builds (versions or sources) under the cache dir."""
    base = os.path.join(root or cache_dir(), "kernels")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [os.path.join(base, n) for n in names if n != version_tag()]


def clear(root: str | None = None, *, stale_only: bool = True) -> list:
    """Delete the kernel directories of other tilepy builds (or all, ``stale_only=False``);
    returns the paths removed."""
    import shutil

    paths = stale_dirs(root)
    if not stale_only:
        current = kernel_cache_dir(root)
        if os.path.isdir(current):
            paths.append(current)
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    return paths


# ---- the Numba-CUDA side, built on first use -----------------------------------------------

def _intrinsic_classes():
    classes = []
    for mod in ("numba.cuda.extending", "numba.core.extending"):
        with contextlib.suppress(Exception):
            classes.append(__import__(mod, fromlist=["_Intrinsic"])._Intrinsic)
    return tuple(classes)


class _Machinery:
    """The subclasses of Numba-CUDA's cache classes (made once, on first use)."""

    def __init__(self):
        import io

        import numba_cuda
        from numba.cuda import dispatcher as cuda_dispatcher
        from numba.cuda.core import caching
        from numba.cuda.serialize import NumbaPickler

        from .ptx.asm import Instruction

        intrinsics = _intrinsic_classes()
        intrinsic_ids: dict = {}

        class StablePickler(NumbaPickler):
            """Numba's pickler, with intrinsics by name and definition instead of by uuid."""

            def persistent_id(self, obj):
                if intrinsics and isinstance(obj, intrinsics):
                    known = intrinsic_ids.get(id(obj))
                    if known is None or known[0] is not obj:
                        spec = getattr(obj, "spec", None)
                        if isinstance(spec, Instruction):  # tilepy.ptx's: the declaration
                            what = repr(spec)
                        else:
                            what = stable_digest(getattr(obj, "_defn", None))
                        known = (obj, ("intrinsic", obj._name, what))
                        intrinsic_ids[id(obj)] = known
                    return known[1]
                return None

        def stable_digest(value) -> str:
            with io.BytesIO() as buf:
                StablePickler(buf, protocol=4).dump(value)
                return hashlib.sha256(buf.getvalue()).hexdigest()

        self.stable_digest = stable_digest

        class Locator(caching._CacheLocator):
            def __init__(self, py_func, py_file):
                self._py_file = py_file
                self._lineno = py_func.__code__.co_firstlineno
                self._cache_path = os.path.join(kernel_cache_dir(), _subdir(py_file))

            def get_cache_path(self):
                return self._cache_path

            def get_source_stamp(self):
                return file_stamp(self._py_file)

            def get_disambiguator(self):
                return str(self._lineno)

            @classmethod
            def from_function(cls, py_func, py_file):
                if not os.path.isfile(py_file):
                    return None  # e.g. "<stdin>": nothing to key the entries on
                self = cls(py_func, py_file)
                self.ensure_cache_path()  # OSError: not writable (the caller warns)
                return self

        class Impl(cuda_dispatcher.CUDACacheImpl):
            _locator_classes = (Locator,)

        class IndexFile(caching.IndexDataCacheFile):
            """Data files named by a hash of their key; index updates under a lock."""

            def __init__(self, cache_path, filename_base, source_stamp):
                super().__init__(cache_path, filename_base, source_stamp)
                self._base = filename_base

            def data_name(self, key) -> str:
                digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
                return f"{self._base}.{digest}.nbc"

            def save(self, key, data):
                name = self.data_name(key)
                self._save_data(name, data)  # before the index names it
                with file_lock(self._index_path + ".lock"):
                    try:
                        overloads = self._load_index()
                    except Exception:  # noqa: BLE001 - an unreadable index is rebuilt
                        overloads = {}
                    if overloads.get(key) != name:
                        overloads[key] = name
                        self._save_index(overloads)

            def set_aside(self) -> str:
                aside = f"{self._index_path}.corrupt-{int(time.time() * 1000)}"
                with contextlib.suppress(OSError):
                    os.replace(self._index_path, aside)
                return aside

        class Cache(cuda_dispatcher.CUDACache):
            _impl_class = Impl

            def __init__(self, py_func, targetoptions=None):
                self._options = repr(sorted((targetoptions or {}).items()))
                self._closure_digest = None
                super().__init__(py_func)
                self._cache_file = IndexFile(self._cache_path, self._impl.filename_base,
                                             self._impl.locator.get_source_stamp())

            def closure_digest(self) -> str:
                if self._closure_digest is None:
                    closure = self._py_func.__closure__
                    cells = tuple(c.cell_contents for c in closure) if closure else ()
                    self._closure_digest = stable_digest(cells)
                return self._closure_digest

            def _index_key(self, sig, codegen):
                code = self._py_func.__code__
                key = (sig, codegen.magic_tuple(), numba_cuda.__version__,
                       (hashlib.sha256(code.co_code).hexdigest(), self.closure_digest(),
                        self._options))
                if getattr(self, "_launch_config_key", None) is not None:
                    key += (("launch_config", self._launch_config_key),)
                return key

            def load_overload(self, sig, target_context):
                try:
                    return super().load_overload(sig, target_context)
                except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                    aside = self._cache_file.set_aside()
                    _warn_once(("kcache-load", self._cache_path),
                               f"tilepy: kernel cache entry in {self._cache_path} was "
                               f"unreadable ({type(e).__name__}: {e}); index moved to "
                               f"{aside}, compiling afresh")
                    return None

            def save_overload(self, sig, data):
                try:
                    super().save_overload(sig, data)
                except Exception as e:  # noqa: BLE001 - read-only now, disk full, …
                    self.disable()
                    _warn_once(("kcache", self._cache_path),
                               f"tilepy: could not save a compiled kernel in "
                               f"{self._cache_path} ({type(e).__name__}: {e}); it will be "
                               "compiled again by the next process")

        self.Locator, self.Impl, self.IndexFile, self.Cache = Locator, Impl, IndexFile, Cache


@functools.cache
def _machinery() -> _Machinery:
    return _Machinery()
