#!/usr/bin/env python3
"""Joins epmoe_bench_mxfp8's JSON (ours: bf16 auto, MXFP8) with launch/baseline_fp8.py's (torch's
scaled grouped GEMM, E4M3 rowwise, act requantized) on (E, k, hidden, ffn, T): an nccl-tests-style
table, µs (b128 = our FP8 block-128 layer); torch / ours > 1 means ours is faster. Both time the local expert layer with the L2
evicted before each replay.

  usage: compare_fp8.py BENCH_MXFP8_JSON BASELINE_FP8_JSON
"""
import json
import math
import sys


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    ours = json.load(open(sys.argv[1]))["points"]
    torch_pts = {(p["E"], p["k"], p["hidden"], p["ffn"], p["T"]): p for p in json.load(open(sys.argv[2]))["points"]}
    print("#  E  k  hidden   ffn      T | bf16 auto us  mxfp8 us  form  b128 us | torch fp8 us | torch fp8 / mxfp8"
          "  torch fp8 / b128  torch fp8 / bf16")
    for p in ours:
        t = torch_pts.get((p["E"], p["k"], p["hidden"], p["ffn"], p["T"]))
        tf = t["fp8_us"] if t else math.nan
        err = f"  ({t['error']})" if t and t.get("error") else ""
        b128 = p.get("fp8_block_us") or math.nan  # the block-128 layer (absent in older JSON)
        print(f"{p['E']:4d} {p['k']:2d} {p['hidden']:7d} {p['ffn']:5d} {p['T']:6d} | {p['bf16_auto_us']:12.1f} "
              f"{p['mxfp8_us']:9.1f}  {p.get('mx_form', 'swap'):4s} {b128:8.1f} | {tf:12.1f} | {tf / p['mxfp8_us']:17.2f} "
              f"{tf / b128:16.2f} {tf / p['bf16_auto_us']:17.2f}{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
