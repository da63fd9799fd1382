"""tilepy on several GPUs: every op on the device that holds its inputs, and a tensor-parallel
transformer block over NCCL.

    python bench/multi_gpu.py devices --src 1 [--json FILE]
        every public op with its inputs on cuda:SRC while the current device is the other
        one: the result on cuda:SRC and right (against PyTorch in float32 on the same
        device), the same calls captured into a CUDA graph on SRC's stream and replayed on new
        inputs, and the other GPU never touched — no primary context made on it where it had
        none, no memory of this process on it grown (nvidia-smi), nothing allocated on it by
        PyTorch. One process per direction (a context once made stays).

    torchrun --nproc-per-node 2 bench/multi_gpu.py tp [--json FILE] [--seq 1024] ...
        a transformer block — attention heads split over the ranks (tilepy.flash_attention,
        causal), the output projection row-parallel; the MLP column-parallel (tilepy.gemm with
        the fused bias + GELU) then row-parallel, an all-reduce after each half — against the
        same block on one GPU with the whole weights: forward output and the gradients of the
        input and of every weight shard (float16 tolerance), a CUDA graph of the forward
        captured per rank and replayed on a new input, and the step time (forward + backward)
        on one GPU and on two. Rank 0 writes the JSON.

    torchrun --nproc-per-node 2 bench/multi_gpu.py tp --cpu --seq 40 --hidden 64 --heads 4
        the same block on CPU over gloo, tilepy in the CUDA simulator (a check of the sharding
        arithmetic on a machine without GPUs; no graphs, no timing).

NVLink multicast stays off in everything this starts (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the lent machines require.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


# ---- devices: every op on its inputs' device ---------------------------------------------------

def _smi_memory(index: int) -> int:
    """MiB this process holds on GPU ``index`` (nvidia-smi's compute apps), 0 if none."""
    try:
        uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout
        uuid = dict(line.split(", ") for line in uuids.strip().splitlines()).get(str(index))
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return -1
    total = 0
    for line in apps.strip().splitlines():
        pid, gpu, mib = [x.strip() for x in line.split(",")]
        if int(pid) == os.getpid() and gpu == uuid:
            total += int(mib)
    return total


def _has_context(torch, index: int):
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return None if probe is None else bool(probe(index))


def _op_cases(torch, tilepy, dev):
    """``name -> (run, reference)``: ``run()`` calls tilepy on inputs made on ``dev`` (the same
    inputs every call: a graph replays them), ``reference()`` PyTorch's float32 answer."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float16):
        return torch.randn(*shape, device=dev, generator=g, dtype=torch.float32).to(dtype)

    f32 = lambda x: x.float()   # noqa: E731
    a, b, bias = rnd(300, 256), rnd(256, 520), rnd(520)
    x = rnd(64, 1000)
    y = torch.softmax(rnd(64, 1000).float(), -1)
    dy = rnd(64, 1000).float()
    q, k, v = rnd(2, 8, 300, 128, dtype=torch.bfloat16), rnd(2, 2, 300, 128,
                                                            dtype=torch.bfloat16), \
        rnd(2, 2, 300, 128, dtype=torch.bfloat16)
    ga, gb = rnd(100, 128), rnd(3, 128, 256)
    ends = torch.tensor([30, 30, 100], device=dev, dtype=torch.int32)
    cu = torch.tensor([0, 70, 300], device=dev, dtype=torch.int32)
    qv, kv_, vv = (rnd(300, 4, 64) for _ in range(3))
    kc, vc = rnd(2, 512, 2, 128, dtype=torch.bfloat16), rnd(2, 512, 2, 128,
                                                            dtype=torch.bfloat16)
    qd = rnd(2, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([300, 512], device=dev, dtype=torch.int32)

    def sdpa(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(
            f32(q), f32(k), f32(v), is_causal=causal, enable_gqa=True)

    def grouped_ref():
        return torch.cat([f32(ga[:30]) @ f32(gb[0]), f32(ga[30:]) @ f32(gb[2])])

    def varlen_ref():
        outs = []
        for s, e in ((0, 70), (70, 300)):
            t = lambda z: f32(z[s:e]).transpose(0, 1)[None]   # noqa: E731
            outs.append(sdpa(t(qv), t(kv_), t(vv), True)[0].transpose(0, 1))
        return torch.cat(outs)

    def kv_ref():
        outs = []
        for z in range(2):
            n = int(lens[z])
            t = lambda u: f32(u).transpose(0, 1)[None]   # noqa: E731
            outs.append(sdpa(t(qd[z]), t(kc[z, :n]), t(vc[z, :n]), False)[0].transpose(0, 1))
        return torch.stack(outs)

    def backward_case():
        qq, kk, vv2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = tilepy.flash_attention(qq, kk, vv2, causal=True)
        o.float().square().sum().backward()
        return torch.cat([t.grad.flatten().float() for t in (qq, kk, vv2)])

    def backward_ref():
        qq, kk, vv2 = (f32(t).detach().clone().requires_grad_() for t in (q, k, v))
        sdpa(qq, kk, vv2, True).square().sum().backward()
        return torch.cat([t.grad.flatten() for t in (qq, kk, vv2)])

    cases = {
        "gemm_bias_gelu": (lambda: tilepy.gemm(a, b, bias=bias, activation="gelu"),
                           lambda: torch.nn.functional.gelu(f32(a) @ f32(b) + f32(bias))),
        "grouped_gemm": (lambda: tilepy.grouped_gemm(ga, gb, ends, check_offsets=False),
                         grouped_ref),
        "softmax": (lambda: tilepy.softmax(x), lambda: torch.softmax(f32(x), -1)),
        "softmax_backward": (lambda: tilepy.softmax_backward(dy, y),
                             lambda: y * (dy - (dy * y).sum(-1, keepdim=True))),
        "gemm_softmax": (lambda: tilepy.gemm_softmax(a, b),
                         lambda: torch.softmax(f32(a) @ f32(b), -1)),
        "flash_attention": (lambda: tilepy.flash_attention(q, k, v, causal=True),
                            lambda: sdpa(q, k, v, True)),
        "flash_attention_varlen": (
            lambda: tilepy.flash_attention_varlen(qv, kv_, vv, cu, cu, 230, 230, causal=True,
                                                  check_seqlens=False),
            varlen_ref),
        "flash_attention_with_kvcache": (
            lambda: tilepy.flash_attention_with_kvcache(qd, kc, vc, lens, causal=False,
                                                        check_seqlens=False),
            kv_ref),
        "flash_attention_backward": (backward_case, backward_ref),
    }
    if torch.cuda.get_device_capability(dev) >= (9, 0):
        xs = rnd(256, 512)
        cases["quantize_fp8"] = (
            lambda: tilepy.quantize_fp8(xs, granularity="row")[0].float()
            * tilepy.quantize_fp8(xs, granularity="row")[1][:, None],
            lambda: f32(xs))
    return cases


def _close(got, want, name):
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch_isfinite(got):
        return f"{name}: NaN or inf in the result"
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-3)
    tol = 0.08 if "quantize" in name else 0.03
    return None if err <= tol * scale else f"{name}: max error {err:.3g} over {scale:.3g}"


def torch_isfinite(t):
    import torch

    return bool(torch.isfinite(t).all())


def run_devices(src: int, as_json):
    import torch

    if torch.cuda.device_count() < 2:
        print("devices: needs two GPUs", file=sys.stderr)
        return 2
    other = 1 - src
    if src == 0:
        torch.cuda.set_device(1)     # the current device is the other one
    import tilepy

    rows, failures = [], []
    cases = _op_cases(torch, tilepy, torch.device("cuda", src))
    refs = {name: ref() for name, (_, ref) in cases.items()}   # PyTorch's own work first
    torch.cuda.synchronize(src)
    # the idle GPU after PyTorch's set-up: what tilepy's calls must leave as it is
    ctx_before = _has_context(torch, other)
    smi_before = _smi_memory(other)
    alloc_before = torch.cuda.memory_allocated(other) if ctx_before else 0
    assert torch.cuda.current_device() == other
    for name, (run, _) in cases.items():
        row = {"op": name, "src": src}
        try:
            got = run()
            torch.cuda.synchronize(src)
            row["device"] = str(got.device)
            bad = None if got.device == torch.device("cuda", src) else \
                f"{name}: result on {got.device}"
            bad = bad or _close(got, refs[name], name)
            if name != "flash_attention_backward":   # (autograd: not graph-captured here)
                with torch.cuda.device(src):
                    run()                              # (plans made before the capture)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = run()
                graph.replay()
                torch.cuda.synchronize(src)
                bad = bad or _close(captured, refs[name], name + " (graph replay)")
                row["graph"] = True
        except Exception as e:  # noqa: BLE001 - reported per op
            bad = f"{name}: {type(e).__name__}: {e}"
        assert torch.cuda.current_device() == other, f"{name} changed the current device"
        row["ok"] = bad is None
        if bad:
            failures.append(bad)
            row["error"] = bad
        rows.append(row)
    ctx_after = _has_context(torch, other)
    smi_after = _smi_memory(other)
    alloc_after = torch.cuda.memory_allocated(other) if ctx_after else 0
    probe = {"other": other, "context_before": ctx_before, "context_after": ctx_after,
             "smi_mib_before": smi_before, "smi_mib_after": smi_after,
             "allocated_before": alloc_before, "allocated_after": alloc_after}
    if ctx_before is False and ctx_after:
        failures.append(f"a primary context was made on the idle GPU {other}")
    if smi_after > smi_before >= 0:
        failures.append(f"this process's memory on the idle GPU {other} grew {smi_before} -> "
                        f"{smi_after} MiB")
    if alloc_after != alloc_before:
        failures.append(f"PyTorch allocations on the idle GPU {other}: {alloc_before} -> "
                        f"{alloc_after} B")
    for r in rows:
        print(("ok   " if r["ok"] else "FAIL ") + r["op"] + ("" if r["ok"] else
                                                            "  " + r["error"]))
    print("idle GPU probe:", probe)
    for f in failures:
        print("FAIL", f)
    if as_json:
        with open(as_json, "w") as fh:
            json.dump({"mode": "devices", "src": src, "gpu": torch.cuda.get_device_name(src),
                       "rows": rows, "probe": probe, "failures": failures}, fh, indent=1)
    return 1 if failures else 0


# ---- tp: a tensor-parallel block over NCCL ------------------------------------------------------

def _weights(torch, hidden, heads, head_dim, ffn, dtype, dev):
    """The block's whole weights, the same on every rank (fixed seed)."""
    g = torch.Generator(device="cpu").manual_seed(1234)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    inner = heads * head_dim
    return {"wqkv": w(hidden, 3 * inner, scale=hidden ** -0.5),
            "wo": w(inner, hidden, scale=inner ** -0.5),
            "w1": w(hidden, ffn, scale=hidden ** -0.5), "b1": w(ffn, scale=0.1),
            "w2": w(ffn, hidden, scale=ffn ** -0.5), "b2": w(hidden, scale=0.1)}


def _shard(torch, full, rank, world, heads, head_dim):
    """Rank ``rank``'s part: the q / k / v columns of its heads, the rows of the output
    projection they feed, a column block of w1 (and b1), the matching row block of w2; b2 whole
    (added once, after the all-reduce)."""
    inner = heads * head_dim
    per = inner // world
    cols = slice(rank * per, (rank + 1) * per)
    wqkv = torch.cat([full["wqkv"][:, i * inner:(i + 1) * inner][:, cols] for i in range(3)], 1)
    f = full["w1"].shape[1] // world
    fc = slice(rank * f, (rank + 1) * f)
    return {"wqkv": wqkv, "wo": full["wo"][cols], "w1": full["w1"][:, fc],
            "b1": full["b1"][fc], "w2": full["w2"][fc], "b2": full["b2"]}


def block(torch, tilepy, x, p, heads, head_dim, enter=None, leave=None):
    """x (B, S, hidden) -> (B, S, hidden): x + attn(x), then + mlp(·). On several ranks
    (Megatron's pair): ``enter`` at the input of each parallel half (identity forward,
    all-reduce of the input's gradient backward), ``leave`` at its output (all-reduce of the
    partial products forward, identity backward); None on one GPU."""
    enter = enter or (lambda t: t)
    leave = leave or (lambda t: t)
    b, s, hidden = x.shape
    x2 = x.reshape(b * s, hidden)
    qkv = tilepy.gemm(enter(x2), p["wqkv"])                 # (B·S, 3 · heads · D)
    q, k, v = qkv.reshape(b, s, 3, heads, head_dim).unbind(2)
    o = tilepy.flash_attention(q, k, v, causal=True, layout="bshd")
    y = leave(tilepy.gemm(o.reshape(b * s, heads * head_dim), p["wo"]))
    x1 = x2 + y
    h = tilepy.gemm(enter(x1), p["w1"], bias=p["b1"], activation="gelu")
    z = leave(tilepy.gemm(h, p["w2"]))
    return (x1 + z + p["b2"]).reshape(b, s, hidden)


def _megatron_pair(torch, dist):
    """``(enter, leave)``: the autograd functions at a tensor-parallel region's input and
    output."""

    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class Leave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            t = t.contiguous().clone()
            dist.all_reduce(t)
            return t

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Enter.apply, Leave.apply


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def run_tp(args):
    import torch
    import torch.distributed as dist

    cpu = args.cpu
    if cpu:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(dev)
    import tilepy

    dtype = torch.float16
    heads, d, hidden = args.heads, args.head_dim, args.hidden
    if heads % world:
        raise SystemExit(f"tp: {heads} heads do not split over {world} ranks")
    full = _weights(torch, hidden, heads, d, 4 * hidden, dtype, dev)
    mine = _shard(torch, full, rank, world, heads, d)
    g = torch.Generator(device="cpu").manual_seed(7)
    x0 = (torch.randn(args.batch, args.seq, hidden, generator=g) * 0.5).to(dtype).to(dev)

    pair = _megatron_pair(torch, dist)

    def step(params, local_heads, tp, x):
        ps = {n: w.detach().clone().requires_grad_() for n, w in params.items()}
        xx = x.detach().clone().requires_grad_()
        out = block(torch, tilepy, xx, ps, local_heads, d, *(pair if tp else (None, None)))
        out.float().square().mean().backward()
        return out.detach(), xx.grad, {n: w.grad for n, w in ps.items()}

    # one GPU: the whole block on every rank (identical), the reference
    out1, gx1, gw1 = step(full, heads, False, x0)
    outt, gxt, gwt = step(mine, heads // world, True, x0)
    ref_shard = _shard(torch, gw1, rank, world, heads, d)
    errs = {"out": _rel(outt, out1), "dx": _rel(gxt, gx1)}
    for n in gwt:
        errs["d" + n] = _rel(gwt[n], ref_shard[n])
    tol = 2e-2
    failures = [f"rank {rank}: {n} differs by {e:.3g} (relative to its largest value)"
                for n, e in errs.items() if not e <= tol]

    result = {"mode": "tp", "world": world, "rank": rank, "batch": args.batch,
              "seq": args.seq, "hidden": hidden, "heads": heads, "head_dim": d,
              "dtype": "float16", "errors": errs}
    if not cpu:
        # a graph of the TP forward per rank, replayed on a new input
        static_x = x0.clone()
        with torch.no_grad():
            block(torch, tilepy, static_x, mine, heads // world, d, leave=reduce_nograd)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = block(torch, tilepy, static_x, mine, heads // world, d,
                                   leave=reduce_nograd)
            x_new = (torch.randn(args.batch, args.seq, hidden, generator=g) * 0.5).to(
                dtype).to(dev)
            static_x.copy_(x_new)
            graph.replay()
            torch.cuda.synchronize()
            eager = block(torch, tilepy, x_new, full, heads, d)
        errs["graph_replay"] = _rel(static_out, eager)
        if not errs["graph_replay"] <= tol:
            failures.append(f"rank {rank}: the graph replay differs by "
                            f"{errs['graph_replay']:.3g}")
        # step times: forward + backward, one GPU (whole weights) and two (TP)
        def timed(fn, reps=args.reps):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / reps * 1e3
        result["step_ms_one_gpu"] = timed(lambda: step(full, heads, False, x0))
        result["step_ms_tp"] = timed(lambda: step(mine, heads // world, True, x0))
        result["gpu"] = torch.cuda.get_device_name(dev)
    result["failures"] = failures
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    rc = 0
    if rank == 0:
        for r in gathered:
            print(json.dumps(r))
            rc = rc or (1 if r["failures"] else 0)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"mode": "tp", "ranks": gathered}, fh, indent=1)
    dist.destroy_process_group()
    return rc


def reduce_nograd(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("devices")
    d.add_argument("--src", type=int, choices=(0, 1), default=1)
    d.add_argument("--json")
    t = sub.add_parser("tp")
    t.add_argument("--json")
    t.add_argument("--cpu", action="store_true")
    t.add_argument("--batch", type=int, default=2)
    t.add_argument("--seq", type=int, default=1024)
    t.add_argument("--hidden", type=int, default=2048)
    t.add_argument("--heads", type=int, default=16)
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if args.mode == "devices":
        return run_devices(args.src, args.json)
    return run_tp(args)


if __name__ == "__main__":
    sys.exit(main())
