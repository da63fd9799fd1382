"""Where a decoding launch's time goes (issue 26: the caches of ~134 MB at 0.55-0.75x copy
bandwidth): ``flash_attention_with_kvcache``'s launches for each shape built by
``attention_kvcache.decode_launches`` — the decoding kernel once untraced and once traced
(:mod:`tilepy.tile.trace`, a row per warp) and the combine kernel — timed one by one and
back to back, beside the op in a CUDA graph and a device copy of the same bytes in the same
run.

    python bench/trace_decode.py [--shapes B:S[:page[:seq_q]],...] [--json FILE]

Per shape (bf16, 32 query heads over 8 KV heads, head_dim 128, seq_q 1 unless given — page 0
is the contiguous cache —, every cache full):
event µs of the decoding kernel (untraced / traced), of the combine kernel, of both back to
back, graph-replay µs per call of the op and of the copy; and from the trace (global timer,
µs): the start spread (the last warp's entry after the first's), entry → Q landed → first key
block landed → last key block done → stored (mean / min / max over warps), the span (first
entry → last store) against the decoding kernel's event time.
"""

import argparse
import json
import statistics

SHAPES = "1:32768,8:4096,8:4096:16,1:131072,8:32768"
RUNS = 7
PHASES = (("Q load", "entry", "q_landed"), ("first key block", "q_landed", "first_kv"),
          ("key loop", "first_kv", "loop_end"), ("store", "loop_end", "stored"),
          ("entry to stored", "entry", "stored"))


def event_us(torch, fn, runs=RUNS):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--json")
    args = p.parse_args()
    import numpy as np
    import torch
    from measure import graph_ms
    from numba import cuda

    import tilepy
    from tilepy.ops import attention_decode_mma_sync as dec
    from tilepy.ops.attention_kvcache import decode_launches
    from tilepy.tile import trace as TR

    hq, hk, d = 32, 8, 128
    tdt = torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        parts = [int(x) for x in shape.split(":")]
        b, s = parts[:2]
        page = parts[2] if len(parts) > 2 and parts[2] else None
        sq = parts[3] if len(parts) > 3 else 1
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=tdt)
        lens = torch.full((b,), s, device="cuda", dtype=torch.int32)
        table = None
        if page:
            pages = b * s // page
            kc = torch.randn(pages, page, hk, d, device="cuda", dtype=tdt)
            vc = torch.randn(pages, page, hk, d, device="cuda", dtype=tdt)
            table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, s // page)
        else:
            kc = torch.randn(b, s, hk, d, device="cuda", dtype=tdt)
            vc = torch.randn(b, s, hk, d, device="cuda", dtype=tdt)
        nbytes = 2 * kc.numel() * kc.element_size()
        stream = torch.cuda.current_stream().cuda_stream
        steps, out, cfg, splits, keep = decode_launches(q, kc, vc, lens, block_table=table)
        g = dec.grid(sq, hq // hk, hk, b, splits, cfg.warps)
        warps = g[0] * g[1] * g[2] * cfg.warps
        trace = cuda.to_device(np.zeros((warps, TR.WIDTH), np.uint64))
        tsteps, tout, _, _, tkeep = decode_launches(q, kc, vc, lens, block_table=table,
                                                    trace=trace)

        def run(which, sel=None):
            for i, (plan, pargs) in enumerate(which):
                if sel is None or i == sel:
                    plan.launch(stream, pargs)

        t_dec = event_us(torch, lambda: run(steps, 0))
        t_dec_traced = event_us(torch, lambda: run(tsteps, 0))
        t_comb = event_us(torch, lambda: run(steps, 1)) if len(steps) > 1 else 0.0
        t_both = event_us(torch, lambda: run(steps))
        want = tilepy.flash_attention_with_kvcache(q, kc, vc, lens, block_table=table)
        run(steps)
        run(tsteps)
        torch.cuda.synchronize()
        same = bool(torch.equal(out, want) and torch.equal(tout, want))
        op_us = graph_ms(torch, lambda: tilepy.flash_attention_with_kvcache(
            q, kc, vc, lens, block_table=table)) * 1e3
        src = torch.empty(nbytes // 2, device="cuda", dtype=tdt)
        dst = torch.empty_like(src)
        copy_us = graph_ms(torch, lambda: dst.copy_(src)) * 1e3
        summaries = []
        for _ in range(RUNS):
            trace.copy_to_device(np.zeros(trace.shape, np.uint64))
            torch.cuda.synchronize()
            run(tsteps, 0)
            torch.cuda.synchronize()
            summaries.append(TR.summary(trace.copy_to_host(), dec.TRACE_MARKS, PHASES,
                                        {"key_blocks": dec.TRACE_MARKS["key_blocks"]}))
        mid = sorted(summaries, key=lambda x: x["span_us"])[len(summaries) // 2]
        row = {"batch": b, "seq": s, "page": page, "seq_q": sq, "mb": nbytes / 1e6,
               "config": cfg.describe(),
               "splits": splits, "grid": list(g), "warps": warps, "same_as_op": same,
               "decode_us": t_dec, "decode_traced_us": t_dec_traced, "combine_us": t_comb,
               "both_us": t_both, "op_graph_us": op_us, "copy_graph_us": copy_us,
               "ratio_to_copy": copy_us / op_us, "median_run": mid}
        rows.append(row)
        print(f"\nB{b} S{s} page {page} seq_q {sq} ({nbytes / 1e6:.0f} MB)  {cfg.describe()}  splits "
              f"{splits}, grid {g}, {warps} warps; outputs equal to the op's: {same}")
        print(f"  events: decode {t_dec:.1f} us (traced {t_dec_traced:.1f}), combine "
              f"{t_comb:.1f}, both {t_both:.1f}; graph per call: op {op_us:.1f} us, copy "
              f"{copy_us:.1f} us ({copy_us / op_us:.2f}x copy)")
        print(f"  trace: span {mid['span_us']:.1f} us, start spread "
              f"{mid['start_spread_us']:.2f} us, timer step {mid['timer_step_ns']} ns, key "
              f"blocks per warp {mid['values']['key_blocks']}")
        for name, ph in mid["phases"].items():
            if ph.get("blocks"):
                print(f"  {name:20} mean {ph['mean_us']:7.2f}  min {ph['min_us']:7.2f}  max "
                      f"{ph['max_us']:7.2f} us  ({ph['blocks']} warps)", flush=True)
        del keep, tkeep
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
