#!/usr/bin/env python3
"""Side by side: epmoe's sm_90a split pipeline (epmoe_bench_experts --json) against the torch
grouped_mm baseline (launch/baseline_moe.py --json), for the seed region and the full layer.

  python3 launch/compare_experts.py OURS.json TORCH.json

Ratios are torch_ms / ours_ms (speedup, > 1 means ours is faster); 'x seed' is torch's seed region
over our full layer. Shapes present in only one file
are listed with '-' on the other side. Where the torch file has dense_ms (baseline_moe.py
--dense-equiv: the layer's FLOPs as two plain dense cuBLAS GEMMs, no gather, padding, SwiGLU or
scatter, one expert's weights), 'dense' is that time and 'of dense' = dense_ms / our full layer's
ms: the share of that practical ceiling our whole layer reaches (1.00 = as fast as the bare GEMMs).
"""
import json
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    rows = {}
    for r in d.get("moe", []):
        hidden = r.get("hidden", r.get("D"))
        ffn = r.get("ffn", r.get("H"))
        seed = r.get("seed_ms", r.get("seed_baseline_ms"))
        full = r.get("full_ms", r.get("full_layer_ms"))
        rows[(r["E"], r["k"], hidden, ffn, r["T"])] = dict(seed=seed, full=full, dense=r.get("dense_ms"), raw=r)
    return d, rows


def fmt(v, spec):
    if isinstance(v, (int, float)) and v == v:
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0]))


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    od, ours = load(sys.argv[1])
    td, torch_ = load(sys.argv[2])
    print(f"# ours : {od.get('impl', '?')} on {od.get('device', '?')}")
    print(f"# torch: {td.get('impl', '?')} on {td.get('device', '?')} (torch {td.get('torch', '?')})")
    dense = any(t.get("dense") for t in torch_.values())
    hdr = (f"{'E':>4} {'k':>2} {'hidden':>6} {'ffn':>5} {'T':>7} | "
           f"{'seed ours':>9} {'torch':>8} {'TF ours':>7} {'TF torch':>8} {'x':>6} | "
           f"{'full ours':>9} {'torch':>8} {'TF ours':>7} {'TF torch':>8} {'x':>6} | "
           f"{'x seed':>6}" + (f" | {'dense':>8} {'TF':>6} {'of dense':>8}" if dense else ""))
    print(hdr)
    print("-" * len(hdr))
    keys = sorted(set(ours) | set(torch_))
    geo = {"seed": [], "full": [], "dense": []}
    for key in keys:
        E, k, D, H, T = key
        flops = 6.0 * T * k * D * H
        o, t = ours.get(key), torch_.get(key)
        cols = []
        for region in ("seed", "full"):
            om = o[region] if o else None
            tm = t[region] if t else None
            otf = flops / om / 1e9 if om else None
            ttf = flops / tm / 1e9 if tm else None
            ratio = tm / om if (om and tm and om == om and tm == tm) else None
            if ratio:
                geo[region].append(ratio)
            cols.append(f"{fmt(om, '9.4f')} {fmt(tm, '8.4f')} {fmt(otf, '7.1f')} {fmt(ttf, '8.1f')} {fmt(ratio, '6.3f')}")
        # Our full layer against torch's seed region (the issue's second full-layer target).
        fs = (t["seed"] / o["full"]) if (o and t and o["full"] and t["seed"]) else None
        tail = ""
        if dense:
            dm = t.get("dense") if t else None
            eff = dm / o["full"] if (dm and dm == dm and o and o["full"]) else None
            if eff:
                geo["dense"].append(eff)
            tail = f" | {fmt(dm, '8.4f')} {fmt(flops / dm / 1e9 if dm else None, '6.1f')} {fmt(eff, '8.3f')}"
        print(f"{E:>4} {k:>2} {D:>6} {H:>5} {T:>7} | {cols[0]} | {cols[1]} | {fmt(fs, '6.3f')}{tail}")
    for region, v in geo.items():
        if v:
            g = 1.0
            for x in v:
                g *= x
            g = g ** (1.0 / len(v))
            if region == "dense":
                print(f"# full layer of the dense-GEMM equivalent (dense_ms / ours_ms): geomean {g:.3f} over {len(v)} shapes")
            else:
                print(f"# {region} region: geomean speedup (torch_ms / ours_ms) {g:.3f} over {len(v)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
