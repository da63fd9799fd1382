"""Thread-block clusters (sm_90): a block's rank in its cluster, shared memory of another block
of the cluster, the cluster barrier, remote mbarrier arrivals and multicast TMA loads.

A kernel launched with a cluster shape (``tilepy.launch.LaunchPlan(..., cluster=2)``: blocks
``2i`` and ``2i + 1`` of the grid's x dimension form cluster ``i``) runs the blocks of a cluster
at the same time on SMs of one GPC, and each block can address the others' shared memory:

* ``cluster_ctarank() -> uint32`` — this block's rank in its cluster (``%cluster_ctarank``).
* ``mapa_shared(addr, rank) -> uint32`` — the ``shared::cluster`` address of the byte at
  ``shared::cta`` address ``addr`` in the shared memory of the cluster's block ``rank``
  (``mapa``). With ``rank`` = the caller's own rank it is the caller's own byte.
* ``mbarrier_arrive_cluster(addr)`` — one arrival on the mbarrier at ``shared::cluster``
  address ``addr`` (:func:`mapa_shared` of a barrier): how a consumer in one block frees a stage
  that a producer in another block waits on. The default semantics (release at CTA scope), as
  CUTLASS's cluster barriers use: ``.release.cluster`` puts a ``MEMBAR.ALL.GPU`` (a GPU-wide
  fence) before every arrival in the SASS, which made a GEMM whose consumers free each stage
  this way markedly slower (bench/NOTES.md: clusters of two sharing B). What the consumer
  read was read by wgmma, whose completion ``wgmma.wait_group`` already established.
* ``st_shared_cluster_v4_f32(addr, x0, x1, x2, x3)`` — four float32 (16 bytes, x0 first) at
  ``shared::cluster`` address ``addr`` (:func:`mapa_shared`: possibly another block's shared
  memory), a weak store: the cluster barrier's release / acquire makes it visible to the
  owning block (split-K's reduction in distributed shared memory).
* ``cluster_arrive()`` / ``cluster_wait()`` — the cluster barrier (``barrier.cluster.arrive``
  with release, ``barrier.cluster.wait`` with acquire): every thread of every block of the
  cluster arrives, and a wait returns once they all have. Used after the mbarrier inits (no
  block may signal another's barriers before they exist) and before a block exits (no block may
  leave while another can still write into its shared memory). Not ``.aligned``: the threads
  of a warp may reach them apart.
* ``tma_load_2d_multicast(dst, tmap, bar, x, y, mask)`` / ``tma_load_3d_multicast(..., z,
  mask)`` — :func:`tilepy.ptx.tma.tma_load_2d` into the shared memory of every block whose
  rank has its bit set in the 16-bit ``mask``, at the same offset ``dst`` in each, completing
  the bytes on the mbarrier at offset ``bar`` of each (``.multicast::cluster``). Each
  destination's barrier must expect the bytes (its own producer's ``arrive_expect_tx``).

Simulator: :func:`tilepy.launch.LaunchPlan` with ``cluster > 1`` runs the blocks of each
cluster at the same time, each with its own shared memory (:mod:`tilepy.ptx._simcluster`;
Numba's simulator alone runs a grid's blocks one after another, in one shared memory). The
twins then act across the blocks: ``mapa_shared`` gives the address of the same byte in the
other block's array, a remote arrival or a multicast's bytes land in the owning block's
mbarrier state (waking its waiters), and the cluster barrier counts every thread of the
cluster. A kernel launched without a cluster is a cluster of one: rank 0, ``mapa_shared`` to
rank 0 is the address itself, a multicast to mask 1 is the plain load, and the barrier is the
block's ``syncthreads`` (at ``cluster_wait``; every thread must call ``cluster_arrive`` then
``cluster_wait``).
"""

from __future__ import annotations

import numpy as np

from . import _simcluster, mbarrier, tma
from .asm import instruction

_SM90 = (9, 0)


def _rank_twin():
    return np.uint32(_simcluster.rank())


def _mapa_twin(addr, rank):
    return _simcluster.peer_address(int(addr), int(rank), "mapa_shared")


def _arrive_cluster_twin(addr):
    mbarrier._arrive("mbarrier_arrive_cluster", addr, 0)


def _st_cluster_v4_f32_twin(addr, x0, x1, x2, x3):
    from . import address

    addr = int(addr)
    address.check_range("shared", "st_shared_cluster_v4_f32", addr, 16, 16,
                        t=_simcluster.owner(addr))
    address.write_bytes(addr, np.array([x0, x1, x2, x3], np.float32).tobytes())


def _cluster_arrive_twin():
    _simcluster.barrier_arrive()


def _cluster_wait_twin():
    _simcluster.barrier_wait()


def _ranks(who, mask):
    mask = int(mask)
    cl = _simcluster.cluster_of()
    size = 1 if cl is None else len(cl["managers"])
    if not 0 < mask < (1 << size):
        raise ValueError(f"{who}: mask {mask:#x} names blocks outside the cluster of {size}")
    return [r for r in range(size) if mask >> r & 1]


def _multicast(who, dst, tmap, bar, coords, mask):
    for r in _ranks(who, mask):
        tma._load(who, _simcluster.peer_address(int(dst), r, who), tmap,
                  _simcluster.peer_address(int(bar), r, who), coords)


def _load_2d_mc_twin(dst, tmap, bar, x, y, mask):
    _multicast("tma_load_2d_multicast", dst, tmap, bar, (int(x), int(y)), mask)


def _load_3d_mc_twin(dst, tmap, bar, x, y, z, mask):
    _multicast("tma_load_3d_multicast", dst, tmap, bar, (int(x), int(y), int(z)), mask)


cluster_ctarank = instruction(
    "cluster_ctarank", "mov.u32 $0, %cluster_ctarank;", outs=("u32",), min_cc=_SM90,
    twin=_rank_twin,
    doc="``cluster_ctarank() -> uint32``: this block's rank in its cluster. sm_90+.")

mapa_shared = instruction(
    "mapa_shared", "mapa.shared::cluster.u32 $0, $1, $2;", outs=("u32",), ins=("u32", "u32"),
    min_cc=_SM90, twin=_mapa_twin,
    doc="``mapa_shared(addr, rank) -> uint32``: the shared::cluster address of shared::cta "
        "address addr in the shared memory of the cluster's block rank. sm_90+.")

mbarrier_arrive_cluster = instruction(
    "mbarrier_arrive_cluster",
    "mbarrier.arrive.shared::cluster.b64 _, [$0];", ins=("u32",),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_arrive_cluster_twin,
    doc="``mbarrier_arrive_cluster(addr)``: one arrival (release at CTA scope, the default) on "
        "the mbarrier at shared::cluster address addr (mapa_shared of a barrier, possibly "
        "another block's). sm_90+.")

st_shared_cluster_v4_f32 = instruction(
    "st_shared_cluster_v4_f32", "st.shared::cluster.v4.f32 [$0], {$1, $2, $3, $4};",
    ins=("u32", "f32", "f32", "f32", "f32"), side_effect=True, clobber_memory=True,
    min_cc=_SM90, twin=_st_cluster_v4_f32_twin,
    doc="``st_shared_cluster_v4_f32(addr, x0, x1, x2, x3)``: store four float32 at "
        "shared::cluster address addr (16-byte aligned; mapa_shared of a block's shared "
        "memory), x0 first. sm_90+.")

cluster_arrive = instruction(
    "cluster_arrive", "barrier.cluster.arrive.release;", side_effect=True, clobber_memory=True,
    min_cc=_SM90, twin=_cluster_arrive_twin,
    doc="``cluster_arrive()``: arrive on the cluster barrier (release). Every thread of the "
        "cluster's blocks, then cluster_wait(). sm_90+.")

cluster_wait = instruction(
    "cluster_wait", "barrier.cluster.wait.acquire;", side_effect=True, clobber_memory=True,
    min_cc=_SM90, twin=_cluster_wait_twin,
    doc="``cluster_wait()``: wait until every thread of the cluster has arrived (acquire). "
        "sm_90+.")

_MC = ("cp.async.bulk.tensor.{d}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
       ".multicast::cluster [$0], [$1, {{{coords}}}], [$2], ${m};")

tma_load_2d_multicast = instruction(
    "tma_load_2d_multicast", _MC.format(d=2, coords="$3, $4", m=5),
    ins=("u32", "u64", "u32", "i32", "i32", "u16"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_2d_mc_twin,
    doc="``tma_load_2d_multicast(dst, tmap, bar, x, y, mask)``: tma_load_2d into every block "
        "of the cluster whose rank bit is set in mask (same dst and bar offsets in each). "
        "sm_90+.")

tma_load_3d_multicast = instruction(
    "tma_load_3d_multicast", _MC.format(d=3, coords="$3, $4, $5", m=6),
    ins=("u32", "u64", "u32", "i32", "i32", "i32", "u16"),
    side_effect=True, clobber_memory=True, min_cc=_SM90, twin=_load_3d_mc_twin,
    doc="``tma_load_3d_multicast(dst, tmap, bar, x, y, z, mask)``: as tma_load_2d_multicast "
        "for a 3-D tensor map. sm_90+.")

__all__ = ["cluster_ctarank", "mapa_shared", "mbarrier_arrive_cluster",
           "st_shared_cluster_v4_f32", "cluster_arrive", "cluster_wait",
           "tma_load_2d_multicast", "tma_load_3d_multicast"]
