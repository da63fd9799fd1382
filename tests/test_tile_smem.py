"""More than 48 KB of dynamic shared memory: 160 KB filled, reversed through a barrier, read."""

import numpy as np
import pytest
from numba import cuda

from tilepy.tile.smem import allow_dynamic_shared, dynamic_shared

NBYTES = 160 * 1024
N = NBYTES // 2
THREADS = 256

buffer = dynamic_shared()


@cuda.jit
def reverse_through_smem(src, dst):
    smem = buffer()
    t = cuda.threadIdx.x
    for i in range(t, N, THREADS):
        smem[i] = src[i]
    cuda.syncthreads()
    for i in range(t, N, THREADS):
        dst[i] = smem[N - 1 - i]


def run(src, dst):
    allow_dynamic_shared(reverse_through_smem, (src, dst), NBYTES)
    reverse_through_smem[1, THREADS, 0, NBYTES](src, dst)


@pytest.mark.gpu
def test_160_kb_of_dynamic_shared_memory_on_gpu():
    src = np.random.default_rng().integers(0, 2**16, N, dtype=np.uint16)
    d_src, d_dst = cuda.to_device(src), cuda.to_device(np.zeros(N, np.uint16))
    run(d_src, d_dst)
    assert np.array_equal(d_dst.copy_to_host(), src[::-1])


@pytest.mark.gpu
def test_without_the_attribute_the_launch_is_refused():
    # the check can fail: a fresh kernel (not yet allowed) must not launch with 160 KB
    @cuda.jit
    def fresh(dst):
        smem = buffer()
        smem[0] = 1
        dst[0] = smem[0]

    with pytest.raises(Exception):
        fresh[1, 32, 0, NBYTES](cuda.to_device(np.zeros(1, np.uint16)))
        cuda.synchronize()


def test_static_limit_needs_no_attribute():
    # below 48 KB the helper does nothing and needs no GPU
    allow_dynamic_shared(reverse_through_smem, (np.zeros(1), np.zeros(1)), 1024)
