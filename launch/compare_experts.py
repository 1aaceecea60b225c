#!/usr/bin/env python3
"""Side by side: epmoe's sm_90a split pipeline (epmoe_bench_experts --json) against the torch
grouped_mm baseline (launch/baseline_moe.py --json): our full layer against torch's full layer and
against torch's seed region.

  python3 launch/compare_experts.py OURS.json TORCH.json

Ratios are torch_ms / ours_ms (speedup, > 1 means ours is faster). 'x torch full' is torch's full
layer over ours; 'x torch seed' is torch's seed region (grouped GEMMs, SwiGLU and the weighting only:
routing, sort, gather, scatter outside) over our full layer, which does more work (it gathers,
zeroes and scatter-adds too): our bench has no seed region, its UP always gathers from x. Shapes
present in only one file are listed with '-' on the other side. Where the torch file has dense_ms
(baseline_moe.py --dense-equiv: the layer's FLOPs as two plain dense cuBLAS GEMMs, no gather,
padding, SwiGLU or scatter, one expert's weights), 'dense' is that time and 'of dense' = dense_ms /
our full layer's ms: the share of that practical ceiling our whole layer reaches (1.00 = as fast as
the bare GEMMs). Where our file has forms_ms (epmoe_bench_experts --forms), a second table puts the
automatic plan, the 128-row kernels, split swap-AB and fused swap-AB (µs, one run, interleaved)
beside torch's full layer and the weight-streaming floor (touched experts' weights / the HBM read
rate of that run).
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


def ok(v):
    return isinstance(v, (int, float)) and v == v and v > 0


def fmt(v, spec):
    if isinstance(v, (int, float)) and v == v:
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0]))


def geomean(v):
    g = 1.0
    for x in v:
        g *= x
    return g ** (1.0 / len(v))


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    od, ours = load(sys.argv[1])
    td, torch_ = load(sys.argv[2])
    print(f"# ours : {od.get('impl', '?')} on {od.get('device', '?')}"
          + (f" (--plan '{od['plan_override']}')" if od.get("plan_override") else ""))
    print(f"# torch: {td.get('impl', '?')} on {td.get('device', '?')} (torch {td.get('torch', '?')})")
    dense = any(t.get("dense") for t in torch_.values())
    hdr = (f"{'E':>4} {'k':>2} {'hidden':>6} {'ffn':>5} {'T':>7} | "
           f"{'full ours':>9} {'torch':>8} {'TF ours':>7} {'TF torch':>8} {'x torch full':>12} | "
           f"{'seed torch':>10} {'TF torch':>8} {'x torch seed':>12}"
           + (f" | {'dense':>8} {'TF':>6} {'of dense':>8}" if dense else ""))
    print(hdr)
    print("-" * len(hdr))
    keys = sorted(set(ours) | set(torch_))
    geo = {"full": [], "seed": [], "dense": []}
    for key in keys:
        E, k, D, H, T = key
        flops = 6.0 * T * k * D * H
        o, t = ours.get(key), torch_.get(key)
        om = o["full"] if o and ok(o["full"]) else None
        tf = t["full"] if t and ok(t["full"]) else None
        ts = t["seed"] if t and ok(t["seed"]) else None
        xf = tf / om if (om and tf) else None
        xs = ts / om if (om and ts) else None  # torch's seed region against our full layer
        if xf:
            geo["full"].append(xf)
        if xs:
            geo["seed"].append(xs)
        cols = (f"{fmt(om, '9.4f')} {fmt(tf, '8.4f')} {fmt(flops / om / 1e9 if om else None, '7.1f')} "
                f"{fmt(flops / tf / 1e9 if tf else None, '8.1f')} {fmt(xf, '12.3f')} | "
                f"{fmt(ts, '10.4f')} {fmt(flops / ts / 1e9 if ts else None, '8.1f')} {fmt(xs, '12.3f')}")
        tail = ""
        if dense:
            dm = t.get("dense") if t else None
            dm = dm if ok(dm) else None
            eff = dm / om if (dm and om) else None
            if eff:
                geo["dense"].append(eff)
            tail = f" | {fmt(dm, '8.4f')} {fmt(flops / dm / 1e9 if dm else None, '6.1f')} {fmt(eff, '8.3f')}"
        print(f"{E:>4} {k:>2} {D:>6} {H:>5} {T:>7} | {cols}{tail}")
    forms = [key for key in keys if ours.get(key) and ours[key]["raw"].get("forms_ms")]
    if forms:
        print()
        hdr = (f"{'E':>4} {'k':>2} {'hidden':>6} {'ffn':>5} {'T':>7} | {'auto us':>8} {'128-row':>8} {'swap':>8} "
               f"{'fused':>8} | {'torch us':>8} {'x torch':>7} | {'floor us':>8} {'auto/floor':>10} {'auto/best':>9}")
        print(hdr)
        print("-" * len(hdr))
        for key in forms:
            E, k, D, H, T = key
            r = ours[key]["raw"]
            fm = r["forms_ms"]
            us = {n: fm.get(n, 0) * 1e3 for n in ("auto", "row128", "swap", "fused")}
            valid = [v for v in us.values() if v > 0]
            best = min(valid) if valid else None
            t = torch_.get(key)
            tf = t["full"] * 1e3 if t and ok(t["full"]) else None
            fl = r.get("floor_ms", 0) * 1e3
            a = us["auto"] if us["auto"] > 0 else None
            print(f"{E:>4} {k:>2} {D:>6} {H:>5} {T:>7} | " + " ".join(fmt(us[n] or None, "8.1f") for n in us)
                  + f" | {fmt(tf, '8.1f')} {fmt(tf / a if (tf and a) else None, '7.2f')} | {fmt(fl or None, '8.1f')} "
                  f"{fmt(a / fl if (a and fl) else None, '10.2f')} {fmt(a / best if (a and best) else None, '9.3f')}")
    if geo["full"]:
        print(f"# full region: geomean speedup (torch_ms / ours_ms) {geomean(geo['full']):.3f} over {len(geo['full'])} shapes")
    if geo["seed"]:
        print(f"# seed region: geomean of torch's seed ms / our full ms {geomean(geo['seed']):.3f} over "
              f"{len(geo['seed'])} shapes (ours does more work)")
    if geo["dense"]:
        print(f"# full layer of the dense-GEMM equivalent (dense_ms / ours_ms): geomean {geomean(geo['dense']):.3f} "
              f"over {len(geo['dense'])} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
