"""Tile configurations: frozen, hashable, validated at construction with explanations.

A :class:`GemmConfig` fixes everything a tensor-core main loop is specialised on: the block
tile, how warps split it, the pipeline depth, the element type and whether shared tiles are
swizzled. Generators in :mod:`tilepy.tile` are cached on these objects, so one config compiles
once. A bad config raises ``ValueError`` naming the constraint that failed and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Shared memory per block a kernel may use on sm_90 (227 KB); sm_80: 163 KB.
SMEM_LIMIT = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024}
#: Registers per thread the hardware allows.
MAX_REGISTERS = 255

DTYPES = ("float16", "bfloat16")
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

# mma.sync m16n8k16 is the instruction all GEMM-like tiles are built from.
MMA_M, MMA_N, MMA_K = 16, 8, 16


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class BlockTile:
    """The part of C one block computes (m × n) and the K slice it loads per step (k)."""

    m: int
    n: int
    k: int

    def __post_init__(self):
        for name in ("m", "n", "k"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, f"BlockTile.{name} must be a positive int, got {v!r}")
        _require(self.m % MMA_M == 0, f"BlockTile.m={self.m} is not a multiple of {MMA_M} "
                 f"(mma.sync rows); nearest: {max(MMA_M, self.m // MMA_M * MMA_M)}")
        _require(self.n % MMA_N == 0, f"BlockTile.n={self.n} is not a multiple of {MMA_N}")
        _require(self.k % MMA_K == 0, f"BlockTile.k={self.k} is not a multiple of {MMA_K}")


@dataclass(frozen=True)
class WarpLayout:
    """How many warps split the block tile along m and n (warps × 32 threads per block)."""

    m: int
    n: int

    def __post_init__(self):
        _require(self.m >= 1 and self.n >= 1, f"WarpLayout needs at least one warp, got {self}")
        _require(self.m * self.n <= 32, f"WarpLayout {self.m}x{self.n} = {self.m * self.n} "
                 "warps; a block holds at most 32 (1024 threads)")

    @property
    def count(self) -> int:
        return self.m * self.n


@dataclass(frozen=True)
class Pipeline:
    """Number of shared-memory stages of the global→shared cp.async pipeline (≥ 2)."""

    stages: int = 3

    def __post_init__(self):
        _require(2 <= self.stages <= 8, f"Pipeline.stages must be 2..8, got {self.stages} "
                 "(one stage cannot overlap copies with math)")


@dataclass(frozen=True)
class GemmConfig:
    """A block-tiled tensor-core GEMM main loop: C[m×n] += A[m×k] · B[k×n] per block."""

    block: BlockTile = field(default_factory=lambda: BlockTile(128, 128, 32))
    warps: WarpLayout = field(default_factory=lambda: WarpLayout(2, 4))
    pipeline: Pipeline = field(default_factory=Pipeline)
    dtype: str = "float16"
    swizzle: bool = True
    cc: tuple = (9, 0)

    def __post_init__(self):
        _require(self.dtype in DTYPES, f"GemmConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        b, w = self.block, self.warps
        _require(b.m % (w.m * MMA_M) == 0,
                 f"block m={b.m} does not split into {w.m} warps of a multiple of {MMA_M} rows "
                 f"({b.m} % {w.m * MMA_M} = {b.m % (w.m * MMA_M)})")
        _require(b.n % (w.n * MMA_N * 2) == 0,
                 f"block n={b.n} does not split into {w.n} warps of a multiple of 16 columns "
                 f"({b.n} % {w.n * 16} = {b.n % (w.n * 16)}); ldmatrix.x4.trans loads B 16 "
                 "columns at a time")
        # Every thread copies whole 16-byte chunks: the tiles must hold a multiple of
        # (threads × 8) elements... or at least one chunk per thread per pass.
        chunks_a = b.m * b.k // 8
        chunks_b = b.k * b.n // 8
        _require(chunks_a % self.threads == 0 and chunks_b % self.threads == 0,
                 f"the A tile ({chunks_a} 16-byte chunks) and B tile ({chunks_b}) must split "
                 f"evenly over {self.threads} threads")
        limit = SMEM_LIMIT.get(tuple(self.cc[:2]), 99 * 1024)
        _require(self.smem_bytes <= limit,
                 f"shared memory {self.smem_bytes} B ({self.pipeline.stages} stages of "
                 f"{self.stage_bytes} B) exceeds the {limit} B a block may use on "
                 f"sm_{self.cc[0]}{self.cc[1]} by {self.smem_bytes - limit} B")
        _require(self.registers_estimate <= MAX_REGISTERS,
                 f"about {self.registers_estimate} registers per thread needed "
                 f"({self.accumulators} accumulators + fragments + addresses) exceeds "
                 f"{MAX_REGISTERS}; use more warps or a smaller block tile")

    # ---- derived sizes (closure constants for the generators) ----
    @property
    def threads(self) -> int:
        return 32 * self.warps.count

    @property
    def warp_m(self) -> int:
        return self.block.m // self.warps.m

    @property
    def warp_n(self) -> int:
        return self.block.n // self.warps.n

    @property
    def mi(self) -> int:
        """m16 tiles per warp."""
        return self.warp_m // MMA_M

    @property
    def ni(self) -> int:
        """n8 tiles per warp."""
        return self.warp_n // MMA_N

    @property
    def ki(self) -> int:
        """k16 steps per block-k slice."""
        return self.block.k // MMA_K

    @property
    def accumulators(self) -> int:
        return self.mi * self.ni * 4

    @property
    def stage_bytes(self) -> int:
        e = ELEMENT_BYTES[self.dtype]
        return (self.block.m * self.block.k + self.block.k * self.block.n) * e

    @property
    def smem_bytes(self) -> int:
        return self.pipeline.stages * self.stage_bytes

    @property
    def registers_estimate(self) -> int:
        """Accumulators + one k16 step of A/B fragments + ~40 for addresses and indices."""
        return self.accumulators + self.mi * 4 + self.ni * 2 + 40

    def describe(self) -> str:
        b, w = self.block, self.warps
        return (f"{b.m}x{b.n}x{b.k} block, {w.m}x{w.n} warps ({self.warp_m}x{self.warp_n} each), "
                f"{self.pipeline.stages} stages, {self.dtype}, {self.smem_bytes // 1024} KB smem, "
                f"~{self.registers_estimate} regs/thread")
