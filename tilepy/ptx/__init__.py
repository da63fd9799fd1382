"""tilepy.ptx — the only place in tilepy that writes PTX.

Each intrinsic is a Numba ``@intrinsic`` emitting inline PTX on the GPU and a Python twin with
the same per-lane semantics in the CUDA simulator (see :mod:`tilepy.ptx.asm`). Modules:

* :mod:`~tilepy.ptx.mma` — ``mma.sync`` (m16n8k16 / k8 / k32; f16, bf16, tf32, s8, fp8)
* :mod:`~tilepy.ptx.ldmatrix` — ``ldmatrix`` / ``stmatrix``
* :mod:`~tilepy.ptx.cp_async` — ``cp.async`` with zero-fill, commit and wait
* :mod:`~tilepy.ptx.shuffle` — warp shuffles that also work in the simulator
* :mod:`~tilepy.ptx.math` — ex2 / rcp approximations and f16 / bf16 packing
* :mod:`~tilepy.ptx.address` — shared / global addresses of array elements
* :mod:`~tilepy.ptx.fragments` — which lane holds which element of an mma operand
* :mod:`~tilepy.ptx.wgmma` — warpgroup MMA (sm_90a): ``wgmma.mma_async`` m64nNk16, fences,
  groups, matrix descriptors and their swizzles, ``setmaxnreg``
* :mod:`~tilepy.ptx.wgmma_layout` — the layouts wgmma reads (descriptors, swizzles, register
  maps) and a NumPy model of one warpgroup MMA, in plain Python
* :mod:`~tilepy.ptx.mbarrier` — shared-memory barriers with transaction counts
* :mod:`~tilepy.ptx.tma` — TMA tensor loads and stores, bulk groups, L2 cache hints, the
  tensor-map fences (host side: :mod:`tilepy.tile.tma`)
* :mod:`~tilepy.ptx.cluster` — thread-block clusters (sm_90): rank, ``mapa``, remote mbarrier
  arrivals, the cluster barrier, multicast TMA loads
* :mod:`~tilepy.ptx.barrier` — named CTA barriers (``bar.sync`` / ``bar.arrive`` id, count)
* :mod:`~tilepy.ptx.griddep` — programmatic dependent launch: ``griddepcontrol.wait`` /
  ``launch_dependents``
* :mod:`~tilepy.ptx.vector` — 4/8/16-byte shared and global vector moves
* :mod:`~tilepy.ptx.global_vector` — 16-byte global loads / stores and 8-byte stores at
  ``a[r, c]`` (LLVM vector accesses, not inline PTX)
* :mod:`~tilepy.ptx.timer` — the global nanosecond timer, the SM cycle counter, the SM id
* :mod:`~tilepy.ptx.probes` — each intrinsic alone in a tiny kernel, for offline compile checks
"""

from . import address, asm, barrier, fragments, mbarrier, mma, tma, vector, wgmma  # noqa: F401
from .address import global_addr, shared_addr  # noqa: F401
from .asm import SIMULATOR, UnsupportedTarget  # noqa: F401
from .mma import *  # noqa: F401,F403
