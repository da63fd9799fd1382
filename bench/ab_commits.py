"""A/B of two tilepy trees in one GPU session: the same public ops timed from tree A and from
tree B in turn, round after round, each round a fresh process per tree (two versions of one
package cannot share a process), and the medians compared.

    python bench/ab_commits.py --a OLD_TREE --b NEW_TREE [--rounds 3] [--suites gemm,attention]
        [--env-a KEY=VALUE] [--env-b KEY=VALUE] [--json FILE]

Suites: gemm, attention, attention_backward, fp8, gemm_softmax.

A tree is a directory holding a ``tilepy`` package (e.g. ``git archive COMMIT tilepy | tar -x
-C DIR``). Each worker times every case of its suites with CUDA events around back-to-back
calls (the time as called, host included; these sizes are GPU-bound, so it is also the GPU
time), and the PyTorch peer beside each case, so a ratio carries no drift between processes. Results are
checked against PyTorch once per worker before timing. The report: per case, A's and B's
median TFLOPS, B / A, and each side's ratio to its peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

GEMM = [(4096, 4096, 4096), (8192, 8192, 8192)] + [
    (m, n, k) for m in (4096, 16384)
    for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))][1:]
# (batch, heads_q, heads_kv, seq, head_dim, causal)
ATTENTION = [(4, 32, 32, s, 128, c) for s in (1024, 4096, 8192) for c in (False, True)] + [
    (8, 16, 16, 2048, 64, False), (8, 16, 16, 2048, 64, True), (4, 32, 8, 4096, 128, False)]
GEMM_SOFTMAX = [(16384, 1024, 1024)]
# (batch, heads_q, heads_kv, seq, head_dim, causal): bf16, dq / dk / dv against SDPA's autograd
ATTENTION_BACKWARD = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
                      (8, 16, 16, 2048, 64, True)]
# (M = N = K, block scales): e4m3, bf16 out
FP8 = [(4096, True), (8192, True), (8192, False)]


def _time(torch, fn, repeat=20):
    """ms per call: CUDA events around ``repeat`` back-to-back calls after a warm-up, the
    median of 3 such runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / repeat)
    return statistics.median(runs)


def worker(suites, out_path):
    import torch

    import tilepy

    rows = []
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    _time(torch, lambda: torch.matmul(x, x))            # clocks up before the first case
    del x
    if "gemm" in suites:
        for m, n, k in GEMM:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(k, n, device="cuda", dtype=torch.float16)
            out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            tilepy.gemm(a, b, out=out)
            err = ((out.float() - a.float() @ b.float()).abs().max()
                   / (a.float() @ b.float()).abs().max()).item()
            ms = _time(torch, lambda: tilepy.gemm(a, b, out=out))
            peer = _time(torch, lambda: torch.matmul(a, b, out=out))
            rows.append({"suite": "gemm", "case": f"{m}x{n}x{k}", "flop": 2 * m * n * k,
                         "ms": ms, "peer_ms": peer, "err": err})
            del a, b, out
    if "attention" in suites:
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        for bsz, hq, hk, s, d, causal in ATTENTION:
            q = torch.randn(bsz, hq, s, d, device="cuda", dtype=torch.float16)
            k = torch.randn(bsz, hk, s, d, device="cuda", dtype=torch.float16)
            v = torch.randn(bsz, hk, s, d, device="cuda", dtype=torch.float16)
            o = tilepy.flash_attention(q, k, v, causal=causal)
            kw = {"enable_gqa": True} if hq != hk else {}
            want = sdpa(q, k, v, is_causal=causal, **kw)
            err = ((o.float() - want.float()).abs().max() / v.float().abs().max()).item()
            ms = _time(torch, lambda: tilepy.flash_attention(q, k, v, causal=causal))
            peer = _time(torch, lambda: sdpa(q, k, v, is_causal=causal, **kw))
            flop = 4 * bsz * hq * s * s * d // (2 if causal else 1)
            rows.append({"suite": "attention",
                         "case": f"B{bsz} H{hq}/{hk} S{s} D{d}{' causal' if causal else ''}",
                         "flop": flop, "ms": ms, "peer_ms": peer, "err": err})
            del q, k, v, o, want
    if "attention_backward" in suites:
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        for bsz, hq, hk, s, d, causal in ATTENTION_BACKWARD:
            q, k, v, dout = (torch.randn(bsz, hq, s, d, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            o, lse = tilepy.flash_attention(q, k, v, causal=causal, return_lse=True)

            def ours():
                return tilepy.flash_attention_backward(dout, q, k, v, o, lse, causal=causal)

            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            ref = sdpa(qq, kk, vv, is_causal=causal)
            want = torch.autograd.grad(ref, (qq, kk, vv), dout, retain_graph=True)
            err = max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
                      for g, w in zip(ours(), want))
            ms = _time(torch, ours)
            peer = _time(torch, lambda: torch.autograd.grad(ref, (qq, kk, vv), dout,
                                                            retain_graph=True))
            flop = 10 * bsz * hq * s * s * d // (2 if causal else 1)   # 2.5x the forward
            rows.append({"suite": "attention_backward",
                         "case": f"B{bsz} H{hq} S{s} D{d}{' causal' if causal else ''}",
                         "flop": flop, "ms": ms, "peer_ms": peer, "err": err})
            del q, k, v, dout, o, lse, qq, kk, vv, ref, want
    if "fp8" in suites:
        for n, block in FP8:
            a = (torch.randn(n, n, device="cuda") * 3).to(torch.float8_e4m3fn)
            w = (torch.randn(n, n, device="cuda") * 3).to(torch.float8_e4m3fn)
            if block:   # 1 x 128 / 128 x 128 scales (DeepGEMM's recipe); the bf16 peer
                sa = torch.rand(n, n // 128, device="cuda") + 0.5
                sb = torch.rand(n // 128, n // 128, device="cuda") + 0.5
                want = (a.float() * sa.repeat_interleave(128, 1)) @ (
                    w.float().t() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1))
                ab, wb = a.bfloat16(), w.bfloat16()
                peer_fn = lambda: torch.matmul(ab, wb.t())   # noqa: E731
            else:
                sa, sb = torch.rand(n, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
                want = (a.float() * sa[:, None]) @ (w.float().t() * sb[None, :])
                sa2, sb2 = sa[:, None].contiguous(), sb[None, :].contiguous()
                peer_fn = lambda: torch._scaled_mm(  # noqa: E731
                    a, w.t(), scale_a=sa2, scale_b=sb2, out_dtype=torch.bfloat16)

            def ours():
                return tilepy.gemm(a, w.t(), scale_a=sa, scale_b=sb)

            err = ((ours().float() - want).abs().max() / want.abs().max()).item()
            ms = _time(torch, ours)
            peer = _time(torch, peer_fn)
            rows.append({"suite": "fp8", "case": f"{n}^3 {'block' if block else 'row/col'}"
                         f" scales (peer: {'bf16 matmul' if block else '_scaled_mm'})",
                         "flop": 2 * n ** 3, "ms": ms, "peer_ms": peer, "err": err})
            del a, w, want
    if "gemm_softmax" in suites:
        for m, n, k in GEMM_SOFTMAX:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(k, n, device="cuda", dtype=torch.float16)
            out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            tilepy.gemm_softmax(a, b, out=out)
            want = torch.softmax(a.float() @ b.float(), -1)
            err = (out.float() - want).abs().max().item()
            ms = _time(torch, lambda: tilepy.gemm_softmax(a, b, out=out))
            peer = _time(torch, lambda: torch.softmax(torch.matmul(a, b), -1))
            rows.append({"suite": "gemm_softmax", "case": f"{m}x{n}x{k}", "flop": 2 * m * n * k,
                         "ms": ms, "peer_ms": peer, "err": err})
    with open(out_path, "w") as f:
        json.dump(rows, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--a", help="tree A (the old code)")
    p.add_argument("--b", help="tree B (the new code)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--suites", default="gemm,attention,gemm_softmax")
    p.add_argument("--cases", help="only attention cases of this sequence length (e.g. 4096)")
    p.add_argument("--json")
    p.add_argument("--env-a", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for tree A's workers (repeatable): e.g. "
                        "the same tree twice, A and B differing in one setting")
    p.add_argument("--env-b", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    suites = set(args.suites.split(","))
    if args.cases:
        ATTENTION[:] = [c for c in ATTENTION if str(c[3]) == args.cases]
    if args.worker:
        worker(suites, args.out)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    results = {"A": [], "B": []}
    for rnd in range(args.rounds):
        for side, tree in (("A", args.a), ("B", args.b)) if rnd % 2 == 0 else \
                (("B", args.b), ("A", args.a)):
            out = os.path.join(here, f".ab_{side}_{rnd}.json")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                    os.pathsep) if p and os.path.abspath(p) != os.path.dirname(here)]))
            env.update(kv.split("=", 1) for kv in (args.env_a if side == "A" else args.env_b))
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                   "--suites", args.suites, "--out", out]
                                  + (["--cases", args.cases] if args.cases else []),
                                  env=env, cwd="/tmp")
            if proc.returncode != 0:
                print(f"round {rnd} side {side}: worker failed ({proc.returncode})", flush=True)
                continue
            with open(out) as f:
                results[side].append(json.load(f))
            os.remove(out)
            print(f"round {rnd} side {side} done", flush=True)
    table = []
    keys = [(r["suite"], r["case"]) for r in (results["A"] or results["B"])[0]] \
        if results["A"] or results["B"] else []
    for suite, case in keys:
        row = {"suite": suite, "case": case}
        for side in ("A", "B"):
            runs = [r for rs in results[side] for r in rs
                    if (r["suite"], r["case"]) == (suite, case)]
            if not runs:
                continue
            ms = statistics.median(r["ms"] for r in runs)
            peer = statistics.median(r["peer_ms"] for r in runs)
            row[side] = {"tflops": runs[0]["flop"] / ms / 1e9, "ms": ms, "peer_ms": peer,
                         "ratio_to_peer": peer / ms, "err": max(r["err"] for r in runs),
                         "ms_rounds": [r["ms"] for r in runs]}
        if "A" in row and "B" in row:
            row["b_over_a"] = row["A"]["ms"] / row["B"]["ms"]
        table.append(row)
        a, b = row.get("A"), row.get("B")
        print(f"{suite:12s} {case:28s} A {a['tflops'] if a else 0:7.1f} B "
              f"{b['tflops'] if b else 0:7.1f} TFLOPS  B/A {row.get('b_over_a', 0):.3f}  "
              f"peer ratio A {a['ratio_to_peer'] if a else 0:.3f} B "
              f"{b['ratio_to_peer'] if b else 0:.3f}", flush=True)
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "a": args.a, "b": args.b,
                       "env_a": args.env_a, "env_b": args.env_b,
                       "rounds": args.rounds, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
