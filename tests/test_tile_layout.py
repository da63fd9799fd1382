import itertools

import pytest

from tilepy.tile import layout


@pytest.mark.parametrize("chunks", [2, 4, 8, 16, 32])
@pytest.mark.parametrize("swizzle", [True, False])
def test_swizzle_is_a_permutation_of_each_row(chunks, swizzle):
    for row in range(64):
        offs = sorted(layout.chunk_offset(row, c, chunks, swizzle) for c in range(chunks))
        assert offs == [(row * chunks + c) * 8 for c in range(chunks)]


@pytest.mark.parametrize("chunks", [2, 4, 8, 16, 32])
def test_ldmatrix_phases_are_conflict_free_with_swizzle(chunks):
    # one ldmatrix phase: 8 consecutive rows, same logical chunk, 16 bytes each
    for row0, chunk in itertools.product(range(0, 64, 8), range(chunks)):
        addrs = [2 * layout.chunk_offset(row0 + r, chunk, chunks) for r in range(8)]
        assert layout.bank_conflicts(addrs) == 0, (row0, chunk)


@pytest.mark.parametrize("chunks", [2, 4, 8, 16, 32])
def test_cp_async_phases_are_conflict_free_with_swizzle(chunks):
    # 8 consecutive threads copy 8 consecutive chunks of the row-major tile
    total = 64 * chunks
    for t0 in range(0, total, 8):
        addrs = [2 * layout.chunk_offset((t0 + i) // chunks, (t0 + i) % chunks, chunks)
                 for i in range(8)]
        assert layout.bank_conflicts(addrs) == 0, t0


@pytest.mark.parametrize("chunks", [8, 16, 32])
def test_unswizzled_wide_rows_conflict_eight_ways(chunks):
    # the counter can fail: 128-byte-or-wider rows without the swizzle hit one bank group
    addrs = [2 * layout.chunk_offset(r, 0, chunks, swizzle=False) for r in range(8)]
    assert layout.bank_conflicts(addrs) == 7


def test_element_offset_is_a_bijection():
    rows, cols = 32, 64
    offs = {layout.element_offset(r, c, cols) for r in range(rows) for c in range(cols)}
    assert offs == set(range(rows * cols))
