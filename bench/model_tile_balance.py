"""How evenly a persistent attention grid shares the tiles out, by a model: a tile's work is
the key blocks it computes (causal: those up to its diagonal), one block per SM slot. Prints,
per shape, the busiest block's load over the mean for three ways of handing tiles out:

* ``static``: block i takes tiles i, i + grid, … of :func:`tilepy.tile.schedule.heavy_first`'s sequence (session 9);
* ``pairs``: heavy and light query blocks of a head paired, pairs handed out statically;
* ``dynamic``: each block takes the next tile when it is free (the ticket counter, and the
  hardware's block scheduler for a grid kernel) — list scheduling.

No GPU needed: ``python bench/model_tile_balance.py``. The numbers in bench/NOTES.md (session
10) come from it."""
from __future__ import annotations

import argparse
import heapq
import math

from tilepy.tile.schedule import L2_GROUP_BYTES

SHAPES = ((4, 32, 1024, 128, 128), (4, 32, 2048, 128, 128), (4, 32, 4096, 128, 128),
          (4, 32, 8192, 128, 128), (8, 16, 2048, 64, 192))


def causal_order(n_qb: int, heads: int, batch: int, sk: int, d: int, pairs: bool) -> list:
    """The query block of each tile in hand-out order: groups of heads whose K and V fit in
    L2_GROUP_BYTES, heaviest query blocks first (``pairs``: heavy, light, heavy, light …)."""
    total = heads * batch
    per = min(max(1, L2_GROUP_BYTES // (4 * d * sk)), total)
    out = []
    for t in range(n_qb * total):
        first = (t // (per * n_qb)) * per
        members = min(per, total - first)
        r = t - first * n_qb
        if not pairs:
            out.append(n_qb - 1 - r // members)
            continue
        half_count = n_qb // 2
        if r < 2 * half_count * members:
            item, half = divmod(r, 2)
            pair = item // members
            out.append(n_qb - 1 - pair if half == 0 else pair)
        else:
            out.append(half_count)          # the middle query block of an odd count
    return out


def busiest(works: list, blocks: int, how: str) -> float:
    loads = [0.0] * blocks
    if how == "dynamic":
        heap = [0.0] * blocks
        for w in works:
            heapq.heappush(heap, heapq.heappop(heap) + w)
        return max(heap)
    step = 2 if how == "pairs" else 1
    for i in range(0, len(works), step):
        loads[(i // step) % blocks] += sum(works[i:i + step])
    return max(loads)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--block-n", type=int, default=128)
    args = p.parse_args()
    print(f"{'shape':28s} {'static':>7s} {'pairs':>7s} {'dynamic':>7s}  (busiest / mean)")
    for b, h, s, d, bm in SHAPES:
        n_qb = -(-s // bm)
        rows = {}
        for how in ("static", "pairs", "dynamic"):
            qbs = causal_order(n_qb, h, b, s, d, how == "pairs")
            works = [math.ceil(min((qb + 1) * bm, s) / args.block_n) for qb in qbs]
            rows[how] = busiest(works, args.sms, how) / (sum(works) / args.sms)
        print(f"B{b} H{h} S{s} D{d} {bm}-row causal".ljust(28)
              + "".join(f" {rows[k]:7.3f}" for k in ("static", "pairs", "dynamic")))


if __name__ == "__main__":
    main()
