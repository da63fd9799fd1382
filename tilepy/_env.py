"""Where tilepy runs: GPU or CUDA simulator, and the checks that must pass before Numba loads.

This module imports neither Numba nor NumPy at module level, so that ``import tilepy`` can
decide whether to turn on Numba's CUDA simulator *before* ``numba.cuda`` is first imported
(the choice is made once per process, at that import).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

SIM_ENV = "NUMBA_ENABLE_CUDASIM"


@functools.cache
def gpu_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or no device.

    Uses the driver library directly (``cuInit`` + ``cuDeviceGetCount``) so that it costs a few
    milliseconds and does not import Numba.
    """
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except AttributeError:
            return 0
    return 0


def simulator_requested() -> bool | None:
    """True/False when the environment decides explicitly, None when it leaves it to us."""
    value = os.environ.get(SIM_ENV)
    if value is None or value.strip() == "":
        return None
    return value.strip() not in ("0", "false", "False", "no")


def choose_target() -> bool:
    """Turn on the CUDA simulator when there is no GPU; return True if the simulator is used.

    Respects an explicit ``NUMBA_ENABLE_CUDASIM``. If ``numba.cuda`` was already imported the
    choice was made by whoever imported it, and we only report it.
    """
    if "numba.cuda" in sys.modules:
        from numba import config

        return bool(config.ENABLE_CUDASIM)
    requested = simulator_requested()
    if requested is None:
        requested = gpu_count() == 0
        os.environ[SIM_ENV] = "1" if requested else "0"
    # The interpreter's switch interval is left as it is: with the simulator's barrier counted
    # by its threads (tilepy._simpatch), a short one only adds lock traffic.
    return requested


# numba-cuda 0.30.x calls numpy.row_stack, which NumPy 2.5 removed: the first compile dies
# with an AttributeError deep inside Numba. We refuse up front with the fix in one line.
_NUMPY_LIMIT = (2, 5)
_NUMBA_CUDA_FIXED = (0, 31)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 3:
            break
    return tuple(parts)


def check_versions(numpy_version: str | None = None, numba_cuda_version: str | None = None) -> None:
    """Raise ImportError when NumPy >= 2.5 sits beside numba-cuda < 0.31 (known crash)."""
    if numpy_version is None:
        import numpy

        numpy_version = numpy.__version__
    if numba_cuda_version is None:
        from importlib import metadata

        try:
            numba_cuda_version = metadata.version("numba-cuda")
        except metadata.PackageNotFoundError:
            raise ImportError(
                "tilepy needs numba-cuda: pip install 'numba-cuda[cu13]' (or [cu12])"
            ) from None
    if (_version_tuple(numpy_version)[:2] >= _NUMPY_LIMIT
            and _version_tuple(numba_cuda_version)[:2] < _NUMBA_CUDA_FIXED):
        raise ImportError(
            f"tilepy: numba-cuda {numba_cuda_version} crashes with NumPy {numpy_version} "
            "(numpy.row_stack was removed in 2.5); install 'numpy<2.5', e.g. "
            "pip install 'numpy==2.4.6'"
        )
