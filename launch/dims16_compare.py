#!/usr/bin/env python3
"""Issue 48's dims check: time per FLOP of shapes whose hidden or ffn is not a multiple of 128
against the nearest multiple-of-128 shape measured in the same epmoe_bench_experts run.

usage: dims16_compare.py BENCH_EXPERTS_JSON

Every row of the JSON with hidden % 128 or ffn % 128 != 0 is matched with the row of the same E, k
and T whose hidden and ffn are rounded to the nearest multiple of 128 (ties down). Time per FLOP =
full_ms / (6 T k hidden ffn); the ratio > 1 means the odd shape pays more per FLOP (the target:
<= 1.10). Prints an nccl-tests-style table; exit 1 when a row has no partner, 0 otherwise (the
ratio is a goal measured here, not a gate).
"""
import json
import sys


def nearest128(n):
    lo = n // 128 * 128
    hi = lo + 128
    return lo if lo > 0 and n - lo <= hi - n else hi


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    rows = json.load(open(sys.argv[1]))["moe"]
    by_key = {(r["E"], r["k"], r["hidden"], r["ffn"], r["T"]): r for r in rows}
    print("#  E  k  hidden   ffn       T |  full ms  TFLOP/s | partner       ms  TFLOP/s | time/FLOP ratio  plan")
    missing = 0
    for r in rows:
        if r["hidden"] % 128 == 0 and r["ffn"] % 128 == 0:
            continue
        key = (r["E"], r["k"], nearest128(r["hidden"]), nearest128(r["ffn"]), r["T"])
        p = by_key.get(key)
        if p is None:
            print(f"{r['E']:4d} {r['k']:2d} {r['hidden']:7d} {r['ffn']:5d} {r['T']:7d} | no partner {key[2]}/{key[3]}")
            missing += 1
            continue
        flops = 6.0 * r["T"] * r["k"] * r["hidden"] * r["ffn"]
        pflops = 6.0 * p["T"] * p["k"] * p["hidden"] * p["ffn"]
        ratio = (r["full_ms"] / flops) / (p["full_ms"] / pflops)
        print(f"{r['E']:4d} {r['k']:2d} {r['hidden']:7d} {r['ffn']:5d} {r['T']:7d} | {r['full_ms']:8.4f} "
              f"{r['full_tflops']:8.1f} | {p['hidden']:4d}/{p['ffn']:<4d} {p['full_ms']:8.4f} {p['full_tflops']:8.1f} | "
              f"{ratio:15.3f}  {r['plan']}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
