#!/usr/bin/env python3
"""Torch baseline for the expert pipeline: the seed's "no fused kernel" path (grouped_mm ->
silu*up -> grouped_mm -> x routing weight), adapted from shared/baselines/baseline_moe.py with the
same method (CUDA-graph replay, median) and the same shapes as src/programs/bench_experts.cu.

  seed region : grouped_mm, silu*up, grouped_mm, x weight (routing, sort, gather, scatter outside)
  full layer  : + the gather of x (index_select) and the weighted scatter-add back to token order
  dense equiv : (--dense-equiv) the layer's two GEMMs as plain dense ones of the same FLOPs,
                x[T*k, hidden] @ w1[0]^T then act[T*k, ffn] @ w2[0]^T: one expert's weights (perfect
                reuse), no gather, padding, SwiGLU or scatter - what cuBLAS reaches on these FLOPs at
                the board's power-capped steady state, a practical ceiling for any grouped layer

FLOPs = 6 * T * k * hidden * ffn. Inputs rotate among enough copies of x that consecutive replays
exceed the 60 MB L2 (like the C++ bench). Writes JSON (--json, default $OUT/baseline_moe.json)
with the keys launch/compare_experts.py reads.

  python3 launch/baseline_moe.py [--shapes quick|full] [--shape E,k,hidden,ffn,T]... [--iters 50] [--json PATH]
                                 [--ceilings] [--dense-equiv] [--dense-only] [--data normal|uniform]

--data: normal (the seed baseline's: x ~ N(0,1), w1, w2 ~ 0.02 N(0,1)) or uniform (the C++ bench's
distributions: x ~ U(-1,1), w1 ~ sqrt(3/hidden) U(-1,1), w2 ~ 2 sqrt(3/ffn) U(-1,1)). At the power cap
a kernel's time follows its energy, which can depend on the operands' bits, so a probe can time torch
on the same distributions as ours.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

QUICK = [(32, 4, 2048, 1024, [4096, 16384]), (32, 8, 7168, 2048, [2048])]
FULL = [(32, 4, 2048, 1024, [1024, 4096, 16384, 65536, 131072]),
        (128, 8, 2048, 768, [4096, 16384]),
        (32, 8, 7168, 2048, [2048, 8192])]


WARMUP_MS = 500.0  # --warmup-ms: replays before each timed region (as epmoe_bench_experts --warmup-ms)


def bench_graph(fns, iters, warm=3, before_each=None):
    """Median ms of one replay; replays rotate over the graphs of `fns` (one per input set), timed
    after at least WARMUP_MS of replays (the board is power-capped: a region timed right after an
    idle host setup would start in a power headroom that continuous training never sees).
    before_each: queued before each timed replay, outside its events (baseline_fp8.py: an L2 evict)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(s)
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    start = time.perf_counter()
    rounds = 0
    while True:
        for g in graphs:
            g.replay()
        rounds += 1
        if rounds % 8 == 0 or rounds <= 3:
            torch.cuda.synchronize()
            if rounds >= 3 and (time.perf_counter() - start) * 1e3 >= WARMUP_MS:
                break
    ts = []
    for i in range(iters):
        if before_each is not None:
            before_each()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graphs[i % len(graphs)].replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def make_tensor(shape, data, scale, dev):
    """bf16 tensor: scale * N(0,1) for --data normal; uniform: U(-1,1) times `scale` (the uniform
    scale, given by the caller)."""
    if data == "normal":
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        return t if scale == 1.0 else t * scale
    return (torch.rand(*shape, device=dev, dtype=torch.float32) * 2 - 1).mul_(scale).to(torch.bfloat16)


def dense_equiv_ms(M, D, H, w1e, w2e, iters, data="normal"):
    """Median ms of x[M, D] @ w1e^T then act[M, H] @ w2e^T (the layer's FLOPs as two dense GEMMs),
    over two input sets (each GEMM's operands exceed the L2 at the benchmark shapes anyway)."""
    sets = [(make_tensor((M, D), data, 1.0, w1e.device), make_tensor((M, H), data, 1.0, w1e.device))
            for _ in range(2)]
    t = bench_graph([lambda x=x, a=a: (x @ w1e.t(), a @ w2e.t()) for x, a in sets], iters)
    del sets
    torch.cuda.empty_cache()
    return t


def main():
    global WARMUP_MS
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", choices=["quick", "full"], default="quick")
    ap.add_argument("--shape", action="append", default=[], metavar="E,k,hidden,ffn,T",
                    help="run only these shapes (repeatable), as epmoe_bench_experts --shape")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                    help="replays before each timed region, at least this long (ms)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "baseline_moe.json"))
    ap.add_argument("--ceilings", action="store_true", help="also measure dense bf16 GEMM and copy bandwidth")
    ap.add_argument("--dense-equiv", action="store_true",
                    help="also time each shape's two GEMMs as dense ones of the same FLOPs (dense_ms)")
    ap.add_argument("--dense-only", action="store_true",
                    help="time only the dense equivalents (a probe; the layer columns are NaN)")
    ap.add_argument("--data", choices=["normal", "uniform"], default="normal",
                    help="operand distributions (see the module docstring)")
    args = ap.parse_args()
    if args.dense_only:
        args.dense_equiv = True
    WARMUP_MS = max(0.0, args.warmup_ms)

    torch.manual_seed(0)
    dev = "cuda"
    res = {"impl": "torch_grouped_mm", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "warmup_ms": WARMUP_MS, "data": args.data}
    if args.ceilings:
        M = 8192
        A = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
        B = torch.randn(M, M, device=dev, dtype=torch.bfloat16)
        t = bench_graph([lambda: A @ B], iters=20)
        res["dense_bf16_tflops"] = 2 * M ** 3 / t / 1e9
        X = torch.empty(2 * 1024 ** 3 // 2, device=dev, dtype=torch.bfloat16).normal_()
        Y = torch.empty_like(X)
        t = bench_graph([lambda: Y.copy_(X)], iters=20)
        res["copy_TBps"] = 2 * X.numel() * 2 / t / 1e9
        del X, Y, A, B

    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    rows = []
    groups = FULL if args.shapes == "full" else QUICK
    if args.shape:
        groups = []
        for spec in args.shape:
            E, k, D, H, T = (int(v) for v in spec.split(","))
            groups.append((E, k, D, H, [T]))
    for (E, k, D, H, Ts) in groups:
        uniform = args.data == "uniform"
        w1 = make_tensor((E, 2 * H, D), args.data, (3.0 / D) ** 0.5 if uniform else 0.02, dev)  # [E, N, K]
        w2 = make_tensor((E, D, H), args.data, 2 * (3.0 / H) ** 0.5 if uniform else 0.02, dev)
        w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
        for T in Ts:
            set_bytes = T * D * 2 * (1 + k)  # x and the gathered xg
            sets = max(1, min(8, (180 << 20) // set_bytes + 1))
            xs = [make_tensor((T, D), args.data, 1.0, dev) for _ in range(sets)]
            logits = torch.randn(T, E, device=dev)
            wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
            wts = (wts / wts.sum(-1, keepdim=True)).to(torch.bfloat16)
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            tok = order // k
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            wg = wts.flatten()[order].contiguous()
            xgs = [x[tok].contiguous() for x in xs]
            out_tok = torch.empty(T, D, device=dev, dtype=torch.bfloat16)

            def seed_region(xg):
                def f():
                    gu = gmm(xg, w1t, offs=offs)
                    g, u = gu.chunk(2, dim=-1)
                    a = F.silu(g) * u
                    eo = gmm(a, w2t, offs=offs)
                    return wg.unsqueeze(1) * eo
                return f

            def full_layer(x):
                def f():
                    xg2 = x.index_select(0, tok)
                    gu = gmm(xg2, w1t, offs=offs)
                    g, u = gu.chunk(2, dim=-1)
                    a = F.silu(g) * u
                    eo = gmm(a, w2t, offs=offs) * wg.unsqueeze(1)
                    out_tok.zero_()
                    out_tok.index_add_(0, tok, eo)
                return f

            try:
                t1 = t2 = float("nan")
                if not args.dense_only:
                    t1 = bench_graph([seed_region(xg) for xg in xgs], args.iters)
                    t2 = bench_graph([full_layer(x) for x in xs], args.iters)
            except Exception as ex:  # noqa: BLE001 - report and go on
                print("grouped_mm failed", E, k, D, H, T, ex)
                t1 = t2 = float("nan")
            flops = 6 * T * k * D * H
            r = dict(E=E, k=k, hidden=D, ffn=H, T=T, sets=sets, seed_ms=t1, full_ms=t2,
                     seed_tflops=flops / t1 / 1e9, full_tflops=flops / t2 / 1e9)
            if args.dense_equiv:
                try:
                    r["dense_ms"] = dense_equiv_ms(T * k, D, H, w1[0], w2[0], args.iters, args.data)
                except Exception as ex:  # noqa: BLE001 - report and go on (the comparison prints '-')
                    print("dense equivalent failed", E, k, D, H, T, ex)
                    r["dense_ms"] = float("nan")
                r["dense_tflops"] = flops / r["dense_ms"] / 1e9
            rows.append(r)
            print(json.dumps(r), flush=True)
            del xs, xgs
            torch.cuda.empty_cache()
        del w1, w2, w1t, w2t
        torch.cuda.empty_cache()
    res["moe"] = rows
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
