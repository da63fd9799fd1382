"""tilepy: GPU tile kernels in plain Python on Numba-CUDA.

Importing tilepy checks that NumPy and numba-cuda can work together, and — when no GPU is
present and Numba has not been imported yet — turns on Numba's CUDA simulator, in which every
PTX intrinsic runs as its Python twin. ``tilepy.SIMULATOR`` says which one this process uses.
"""

import sys as _sys

from . import _env

__version__ = "0.1.0"

_env.check_versions()
SIMULATOR: bool = _env.choose_target()
if SIMULATOR:
    from . import _simpatch

    _simpatch.install()

from . import ptx  # noqa: E402
from .api import (BlockMask, create_block_mask, flash_attention,  # noqa: E402
                  flash_attention_backward,
                  flash_attention_varlen, flash_attention_with_kvcache, gemm,
                  gemm_softmax, grouped_gemm, log_softmax, log_softmax_backward,
                  quantize_fp8, softmax, softmax_backward)

if "torch" in _sys.modules:   # PyTorch in use: its operators (torch.ops.tilepy.*) now
    from .integrations import pytorch as _pytorch  # noqa: E402,F401

__all__ = ["SIMULATOR", "__version__", "BlockMask", "create_block_mask", "flash_attention", "flash_attention_backward",
           "flash_attention_varlen", "flash_attention_with_kvcache", "gemm",
           "gemm_softmax", "grouped_gemm", "log_softmax", "log_softmax_backward", "ptx",
           "quantize_fp8", "softmax", "softmax_backward"]
