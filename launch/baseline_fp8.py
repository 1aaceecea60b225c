#!/usr/bin/env python3
"""Torch baseline for the MXFP8 expert layer (issue 50), on Hopper: the seed's "no fused kernel" path
with torch's scaled grouped GEMM, requantizing the activation between the GEMMs as the kernel does.

torch 2.11's torch._scaled_grouped_mm on sm_90 takes E4M3 operands with rowwise fp32 scales (one per
row of A, one per output column of each group's B); OCP MX (1x32 E8M0 blocks) needs sm_100. So this
is the closest Hopper form of the seed's MXFP8 baseline, with coarser (cheaper) scales than ours:

  setup   w1, w2 -> E4M3 with one scale per output row; x -> E4M3 rows with one scale each (as our
          bench's x arrives packed); routing sorted, each expert's rows padded to --align rows (the
          grouped GEMM's group alignment; pad rows point at a scratch row with weight 0)
  region  gather x rows + scales (index_select) -> scaled_grouped_mm UP (bf16 out) -> silu(g) * u ->
          act requantized rowwise (amax, scale, cast) -> scaled_grouped_mm DOWN -> x routing weight ->
          index_add_ into token order (out zeroed first)

Timed like epmoe_bench_mxfp8: CUDA-graph replays after baseline_moe.py's warm-up, each replay after a
256 MB write that evicts the L2 (outside the timed events), median. Writes JSON (--json,
default $OUT/baseline_fp8.json): {"impl", "torch", "device", "points": [{E, k, hidden, ffn, T,
fp8_us, error}]}; a shape torch refuses gets fp8_us NaN and the error text.

  python3 launch/baseline_fp8.py [--shapes "E,k,H,F;..."] [--tokens 1,8,...] [--iters 50] [--align 16]
                                 [--json PATH]
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baseline_moe  # noqa: E402  (bench_graph: the same timing method)

E4M3_MAX = 448.0


def quant_rows(t):
    """bf16 [..., K] -> (E4M3 [..., K], fp32 scale [...]) with one scale per row: amax / 448."""
    s = t.abs().amax(dim=-1).float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def run_shape(E, k, D, H, T, iters, align, dev):
    w1 = (torch.randn(E, 2 * H, D, device=dev) * 0.02).to(torch.bfloat16)  # [E, N, K]
    w2 = (torch.randn(E, D, H, device=dev) * 0.02).to(torch.bfloat16)
    w1q, s1 = quant_rows(w1)
    w2q, s2 = quant_rows(w2)
    w1t, w2t = w1q.transpose(1, 2), w2q.transpose(1, 2)  # [E, K, N] column-major, as torch asks
    del w1, w2
    sets = max(1, min(8, (180 << 20) // max(1, T * D * (1 + k)) + 1))
    xs = [quant_rows(torch.randn(T, D, device=dev).to(torch.bfloat16)) for _ in range(sets)]
    wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device=dev), -1), k, dim=-1)
    wts = wts / wts.sum(-1, keepdim=True)
    flat = ids.flatten().cpu()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    # Padded groups: expert e's rows, then pad rows (token T: a scratch row, weight 0).
    src, wsel, offs, pos = [], [], [], 0
    flat_w = wts.flatten().cpu()
    for e in range(E):
        mine = order[pos:pos + counts[e]]
        pos += counts[e]
        pad = (-counts[e]) % align
        src += (mine // k).tolist() + [T] * pad
        wsel += flat_w[mine].tolist() + [0.0] * pad
        offs.append(len(src))
    src_t = torch.tensor(src, device=dev, dtype=torch.long)
    wsel_t = torch.tensor(wsel, device=dev, dtype=torch.float32).unsqueeze(1)
    offs_t = torch.tensor(offs, device=dev, dtype=torch.int32)
    out = torch.empty(T + 1, D, device=dev, dtype=torch.bfloat16)

    def layer(xq, xs_):
        xq1 = torch.cat([xq, torch.zeros(1, D, device=dev, dtype=xq.dtype)])  # row T: the pad rows' source
        xs1 = torch.cat([xs_, torch.ones(1, device=dev)])

        def f():
            a_q = xq1.index_select(0, src_t)
            a_s = xs1.index_select(0, src_t)
            gu = torch._scaled_grouped_mm(a_q, w1t, a_s, s1, offs=offs_t, out_dtype=torch.bfloat16)
            g, u = gu.chunk(2, dim=-1)
            act_q, act_s = quant_rows(F.silu(g) * u)
            eo = torch._scaled_grouped_mm(act_q, w2t, act_s, s2, offs=offs_t, out_dtype=torch.bfloat16)
            out.zero_()
            out.index_add_(0, src_t, (eo.float() * wsel_t).to(torch.bfloat16))
        return f

    evict = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # written before each timed replay
    return baseline_moe.bench_graph([layer(xq, s) for xq, s in xs], iters, before_each=evict.zero_)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32,4,2048,1024;128,8,2048,768")
    ap.add_argument("--tokens", default="1,8,64,128")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--align", type=int, default=16, help="rows each expert's group is padded to")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "baseline_fp8.json"))
    args = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    res = {"impl": "torch._scaled_grouped_mm (E4M3, rowwise scales)", "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "align": args.align, "points": []}
    for spec in args.shapes.split(";"):
        E, k, D, H = (int(v) for v in spec.split(","))
        for T in (int(t) for t in args.tokens.split(",")):
            p = {"E": E, "k": k, "hidden": D, "ffn": H, "T": T, "fp8_us": math.nan, "error": ""}
            try:
                p["fp8_us"] = run_shape(E, k, D, H, T, args.iters, args.align, dev) * 1e3
            except Exception as ex:  # noqa: BLE001 - record and go on
                p["error"] = f"{type(ex).__name__}: {ex}"[:300]
            print(json.dumps(p), flush=True)
            res["points"].append(p)
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
