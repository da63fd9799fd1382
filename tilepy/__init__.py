"""tilepy: GPU tile kernels in plain Python on Numba-CUDA.

Importing tilepy checks that NumPy and numba-cuda can work together, and — when no GPU is
present and Numba has not been imported yet — turns on Numba's CUDA simulator, in which every
PTX intrinsic runs as its Python twin. ``tilepy.SIMULATOR`` says which one this process uses.
"""

from . import _env

__version__ = "0.1.0"

_env.check_versions()
SIMULATOR: bool = _env.choose_target()
if SIMULATOR:
    from . import _simpatch

    _simpatch.install()

from . import ptx  # noqa: E402
from .ops.attention import flash_attention  # noqa: E402
from .ops.gemm import gemm  # noqa: E402
from .ops.gemm_softmax import gemm_softmax  # noqa: E402
from .ops.softmax import log_softmax, softmax  # noqa: E402

__all__ = ["SIMULATOR", "__version__", "flash_attention", "gemm", "gemm_softmax", "log_softmax",
           "ptx", "softmax"]
