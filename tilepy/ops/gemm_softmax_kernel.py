"""The former name of :mod:`tilepy.ops.gemm_softmax_mma_sync` (kernel files are named by
their mechanism): importing it gives that module itself, so its names, its caches and what a
test patches are the same objects."""

import sys

from . import gemm_softmax_mma_sync as _module

sys.modules[__name__] = _module
