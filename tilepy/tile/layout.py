"""Shared-memory layouts and fragment maps, as plain Python functions (CPU-testable).

Shared tiles are row-major arrays of 16-byte *chunks* (8 f16/bf16 elements). With ``C`` chunks
per row, the XOR swizzle stores logical chunk ``c`` of row ``r`` at physical chunk
``c ^ ((r // max(1, 8 // C)) % min(C, 8))``. Eight 16-byte accesses at the same logical chunk
of eight consecutive rows — one ldmatrix phase, or one cp.async phase of 8 threads — then land
in 8 different 16-byte bank groups: no shared-memory bank conflicts (``tests/test_tile_layout``
counts them). Without the swizzle, rows of 128 bytes or more put such a phase in one group.
"""

from __future__ import annotations

from ..ptx.fragments import a_map, b_map, c_map, table  # noqa: F401  (re-exported)

CHUNK_BYTES = 16
BANK_GROUPS = 8  # 32 banks × 4 bytes = 128 bytes = 8 chunks


def check_swizzle(chunks_per_row: int, swizzle: bool = True) -> None:
    """The XOR swizzle keeps a chunk inside its row only for 1, 2, 4 or a multiple of 8 chunks."""
    if swizzle and not (chunks_per_row in (1, 2, 4) or chunks_per_row % 8 == 0):
        raise ValueError(f"a swizzled tile row must hold 1, 2, 4 or a multiple of 8 chunks of "
                         f"16 bytes; {chunks_per_row} chunks ({chunks_per_row * 8} elements) "
                         "do not")


def swizzle_mask(row: int, chunks_per_row: int) -> int:
    rows_per_line = max(1, BANK_GROUPS // chunks_per_row)
    return (row // rows_per_line) % min(chunks_per_row, BANK_GROUPS)


def swizzled_chunk(row: int, chunk: int, chunks_per_row: int) -> int:
    """Physical chunk of logical (row, chunk) in a swizzled tile."""
    return chunk ^ swizzle_mask(row, chunks_per_row)


def chunk_offset(row: int, chunk: int, chunks_per_row: int, swizzle: bool = True) -> int:
    """Element offset (8 elements per chunk) of logical (row, chunk) from the tile start."""
    c = swizzled_chunk(row, chunk, chunks_per_row) if swizzle else chunk
    return (row * chunks_per_row + c) * 8


def element_offset(row: int, col: int, cols: int, swizzle: bool = True) -> int:
    """Element offset of logical (row, col) in a tile of ``cols`` 2-byte elements per row."""
    return chunk_offset(row, col // 8, cols // 8, swizzle) + col % 8


def bank_conflicts(byte_addresses) -> int:
    """Extra shared-memory wavefronts one access phase costs (0 = conflict free).

    ``byte_addresses`` are the start addresses of the 16-byte accesses of one phase (8 of
    them for ldmatrix / cp.async.16). Each access covers 4 consecutive banks; a phase needs
    as many wavefronts as the most-used bank is hit by different 16-byte lines.
    """
    use: dict[int, set] = {}
    for addr in byte_addresses:
        for w in range(4):
            word = addr // 4 + w
            use.setdefault(word % 32, set()).add(word)
    return max(len(words) for words in use.values()) - 1
