"""Thread-block clusters (tilepy.ptx.cluster): a cluster of two (rank, remote arrivals, multicast
into both blocks, the cluster barrier) launched through tilepy.launch.LaunchPlan(cluster=2), in
the simulator (whose blocks of a cluster run at the same time, tilepy.ptx._simcluster) and on
the GPU; the twins' cluster of one in a plain launch. The offline compile of each instruction
is in test_compile.py (one probe per intrinsic)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint16, uint64
from test_ptx_mbarrier_tma import device_tensor

from tilepy.launch import LaunchPlan
from tilepy.ptx import cluster as C
from tilepy.ptx import mbarrier as B
from tilepy.ptx import tma as T
from tilepy.ptx.address import shared_addr
from tilepy.ptx.asm import SIMULATOR
from tilepy.tile import tma as host

ROWS, COLS = 16, 32          # the box: 16 rows of 64 bytes, no swizzle
WORDS = ROWS * COLS
ALIGN = None if SIMULATOR else 128


def _tensor(rng):
    """(keep-alive, pointer, host copy) of a 40 × 48 float16 tensor (as uint16 words)."""
    t = rng.integers(0, 2**16, (40, 48), dtype=np.uint16)
    return (*device_tensor(t), t)


def make_kernel(nblocks, mask, remote_rank):
    """Each block: thread 0 inits a barrier for one arrival, the cluster syncs, block r's
    thread 0 arrives on the barrier of block (r + remote_rank) mod nblocks and multicasts row
    share r of the box to every block in ``mask``; all wait for both and copy the box out."""

    @cuda.jit
    def kernel(tmap, out, ranks):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, uint16, alignment=ALIGN) if ALIGN else \
            cuda.shared.array(WORDS, uint16)
        bars = cuda.shared.array(2, uint64)
        rank = C.cluster_ctarank()
        arrive = shared_addr(bars, 0)
        full = shared_addr(bars, 1)
        tm = T.tensor_map_address(tmap)
        if tid == 0:
            B.mbarrier_init(arrive, 1)
            B.mbarrier_init(full, 1)
            B.fence_mbarrier_init()
            T.fence_proxy_tensormap_acquire(tm)
        C.cluster_arrive()
        C.cluster_wait()
        if tid == 0:
            B.mbarrier_arrive_expect_tx(full, WORDS * 2)
            half = ROWS // nblocks
            C.tma_load_2d_multicast(shared_addr(smem, rank * half * COLS), tm, full, 8,
                                    4 + rank * half, mask)
            C.mbarrier_arrive_cluster(C.mapa_shared(arrive, (rank + remote_rank) % nblocks))
        B.mbarrier_wait_parity(arrive, 0)
        B.mbarrier_wait_parity(full, 0)
        blk = cuda.blockIdx.x
        for j in range(tid, WORDS, cuda.blockDim.x):
            out[blk, j] = smem[j]
        if tid == 0:
            ranks[blk] = rank
        C.cluster_arrive()   # no block leaves while another may still write into it
        C.cluster_wait()

    return kernel


def _run(nblocks, mask, remote_rank, box_rows, clusters=1):
    rng = np.random.default_rng()
    keep, ptr, t = _tensor(rng)
    tm = host.encode_tiled(ptr, np.float16, (40, 48), (96, 2), (box_rows, COLS), 0)
    grid = nblocks * clusters
    out = np.zeros((grid, WORDS), np.uint16)
    ranks = np.full(grid, 99, np.uint32)
    kern = make_kernel(nblocks, mask, remote_rank)
    if SIMULATOR:
        args = (tm.to_device(), out, ranks)
        if nblocks == 1:
            kern[grid, 64](*args)
        else:
            LaunchPlan(kern, args, (grid,), (64,), 0, cluster=nblocks).launch(0, args)
    else:
        d_out, d_ranks = cuda.to_device(out), cuda.to_device(ranks)
        args = (tm.to_device(), d_out, d_ranks)
        LaunchPlan(kern, args, (grid,), (64,), 0, cluster=nblocks).launch(0, args)
        cuda.synchronize()
        out, ranks = d_out.copy_to_host(), d_ranks.copy_to_host()
    del keep
    want = t[4:4 + ROWS, 8:8 + COLS].reshape(-1)
    return out, ranks, want


@pytest.mark.sim
def test_twins_are_a_cluster_of_one():
    """Rank 0, mapa to rank 0, a cluster-scope arrival, the cluster barrier as the block's, and
    a multicast to mask 1 that is the plain load."""
    out, ranks, want = _run(1, 1, 0, ROWS)
    np.testing.assert_array_equal(out[0], want)
    assert ranks[0] == 0


@cuda.jit
def _bad_rank_kernel(tmap, case):
    """Every thread names a block outside its cluster (no barrier: each raises on its own)."""
    smem = cuda.shared.array(WORDS, uint16)
    bars = cuda.shared.array(1, uint64)
    if case[0] == 0:
        C.tma_load_2d_multicast(shared_addr(smem, 0), T.tensor_map_address(tmap),
                                shared_addr(bars, 0), 8, 4, 3)
    else:
        C.mapa_shared(shared_addr(bars, 0), 1)


@pytest.mark.sim
@pytest.mark.parametrize("case,match", [(0, "mask 0x3"), (1, "rank 1 in a cluster of one")])
def test_twins_refuse_blocks_outside_the_cluster(case, match):
    if not SIMULATOR:
        pytest.skip("the simulator's refusal")
    tm = host.encode_tiled(np.zeros(64, np.uint8).ctypes.data, np.float16, (40, 48), (96, 2),
                           (ROWS, COLS), 0)
    with pytest.raises(ValueError, match=match):
        _bad_rank_kernel[1, 32](tm.to_device(), np.array([case], np.int32))


def test_launch_plan_needs_whole_clusters():
    kern = make_kernel(2, 3, 1)
    args = (np.zeros(128, np.uint8), np.zeros((2, WORDS), np.uint16), np.zeros(2, np.uint32))
    if not SIMULATOR:
        args = tuple(cuda.to_device(a) for a in args)
    with pytest.raises(ValueError, match="must divide"):
        LaunchPlan(kern, args, (3,), (64,), 0, cluster=2)


@pytest.mark.parametrize("clusters", [1, 3])   # the simulator's twins and the GPU alike
def test_cluster_of_two_multicasts_and_arrives_remotely(clusters):
    """Two blocks per cluster: each loads half of the box's rows into both (mask 3), and each
    block's barrier completes only with the other block's remote arrival. Several clusters:
    each its own pair of blocks."""
    if not SIMULATOR and tuple(cuda.get_current_device().compute_capability) < (9, 0):
        pytest.skip("clusters need compute capability 9.0")
    out, ranks, want = _run(2, 3, 1, ROWS // 2, clusters)
    for blk in range(2 * clusters):
        np.testing.assert_array_equal(out[blk], want)
    assert list(ranks) == [0, 1] * clusters
