#!/usr/bin/env python3
"""Side by side: epmoe_bench_train's JSON against the torch training baseline's
(launch/train_baseline.py, or ../shared/baselines/train_baseline.py: {"rows": [...]}), joined on
(E, k, hidden, ffn, T).

  python3 launch/compare_train.py OURS.json TORCH.json [--json COMBINED.json] [--png SPEEDUP.png]

Prints a markdown table, one row per shape and save policy of ours. speedup = torch fwd+bwd ms /
ours fwd+bwd ms (> 1: we are faster). bwd TF: torch's backward is its fwd+bwd minus a no-grad forward;
ours is the backward alone, timed directly (the JSON also has ours derived the torch way). peak GB:
torch's max_memory_allocated; ours is device memory in use above the bare CUDA context (weights,
inputs, gradients, NCCL and the layer's buffers: see epmoe_bench_train). Writes the joined rows and
both inputs to --json (default: train_compare.json beside OURS) and a speedup bar chart to --png
(default: train_speedup.png beside OURS) when matplotlib imports. Exit status 1 when no shape matches.
"""
import argparse
import json
import math
import os
import sys


def load(path, list_key):
    """The document and its records (under list_key, or a bare list, or JSON lines)."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
        recs = doc.get(list_key, []) if isinstance(doc, dict) else doc
    except json.JSONDecodeError:
        doc = {}
        recs = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    if not isinstance(doc, dict):
        doc = {}
    return doc, [r for r in recs if isinstance(r, dict)]


def key(r):
    g = lambda *names: next(int(r[n]) for n in names if n in r)
    return (g("E"), g("k"), g("hidden", "D"), g("ffn", "H"), g("T", "tokens_per_rank"))


def num(v):
    """A finite float, else None (JSON null, missing, NaN)."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def ratio(a, b):
    return a / b if (a is not None and b is not None and b > 0) else None


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def geomean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def shape_name(k):
    return f"{k[0]},{k[1]},{k[2]},{k[3]},{k[4]}"


def plot(path, rows, policies):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"# matplotlib not importable ({e}): no plot")
        return False
    shapes = sorted({r["shape_key"] for r in rows}, key=lambda k: (k[2], k[3], k[0], k[4]))
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(shapes)), 4.0))
    for i, pol in enumerate(policies):
        ys = []
        for s in shapes:
            hit = [r for r in rows if r["shape_key"] == s and r["policy"] == pol]
            ys.append(hit[0]["speedup_fwd_bwd"] if hit and hit[0]["speedup_fwd_bwd"] is not None else 0.0)
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(shapes))]
        bars = ax.bar(xs, ys, width, label=pol)
        for b, y in zip(bars, ys):
            if y > 0:
                ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([shape_name(s) for s in shapes], rotation=15, fontsize=8)
    ax.set_xlabel("E,k,hidden,ffn,T")
    ax.set_ylabel("speedup (torch fwd+bwd ms / ours)")
    ax.set_title("MoE layer fwd+bwd: epmoe over torch autograd (grouped_mm)")
    ax.legend(title="save policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ours")
    ap.add_argument("torch")
    ap.add_argument("--json", help="combined JSON (default: train_compare.json beside OURS)")
    ap.add_argument("--png", help="speedup plot (default: train_speedup.png beside OURS)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(a.ours))
    out_json = a.json or os.path.join(here, "train_compare.json")
    out_png = a.png or os.path.join(here, "train_speedup.png")

    odoc, ours = load(a.ours, "results")
    tdoc, base = load(a.torch, "rows")
    tmap = {key(r): r for r in base}
    okeys = {key(r) for r in ours}
    print(f"# ours : {odoc.get('program', '?')} on {odoc.get('device', '?')}, world {odoc.get('world', '?')}, "
          f"commit {odoc.get('commit', '?')}, {odoc.get('date', '?')}, dW {odoc.get('grad_dtype', '?')}")
    print(f"# torch: {tdoc.get('device', '?')} (torch {tdoc.get('torch', '?')}), "
          f"HBM read {fmt(num(tdoc.get('hbm_read_TBps')), '.2f')} TB/s")
    if int(odoc.get("world", 1) or 1) != 1:
        print("# note: ours ran on several ranks (T per rank, figures per GPU); torch is one GPU")
    print()

    cols = ["shape (E,k,hidden,ffn,T)", "policy", "torch fwd+bwd ms", "ours fwd+bwd ms", "speedup", "torch bwd TF",
            "ours bwd TF", "torch peak GB", "ours peak GB", "ours status"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    joined, policies, by_policy = [], [], {}
    for r in sorted(ours, key=lambda r: (key(r)[2], key(r)[3], key(r)[0], key(r)[4], str(r.get("policy")))):
        k = key(r)
        t = tmap.get(k)
        if t is None:
            continue
        pol = str(r.get("policy", "?"))
        if pol not in policies:
            policies.append(pol)
        o_fb, t_fb = num(r.get("fwd_bwd_ms")), num(t.get("fwd_bwd_ms"))
        o_bwd_derived = num(r.get("bwd_derived_ms"))
        row = dict(shape=dict(zip(("E", "k", "hidden", "ffn", "T"), k)), shape_key=k, policy=pol,
                   torch_fwd_ms=num(t.get("fwd_ms")), ours_fwd_ms=num(r.get("fwd_ms")),
                   torch_fwd_bwd_ms=t_fb, ours_fwd_bwd_ms=o_fb, torch_bwd_ms=num(t.get("bwd_ms")),
                   ours_bwd_ms=num(r.get("bwd_ms")), ours_bwd_derived_ms=o_bwd_derived,
                   speedup_fwd=ratio(num(t.get("fwd_ms")), num(r.get("fwd_ms"))), speedup_fwd_bwd=ratio(t_fb, o_fb),
                   speedup_bwd_derived=ratio(num(t.get("bwd_ms")), o_bwd_derived),
                   torch_fwd_bwd_TF=num(t.get("fwd_bwd_TF")), ours_fwd_bwd_TF=num(r.get("fwd_bwd_TF")),
                   torch_bwd_TF=num(t.get("bwd_TF")), ours_bwd_TF=num(r.get("bwd_TF")),
                   torch_peak_GB=num(t.get("peak_mem_GB")), ours_peak_GB=num(r.get("peak_GB")),
                   ours_saved_bytes=r.get("saved_bytes"), ours_ok=bool(r.get("ok", False)), ours_error=r.get("error"))
        joined.append(row)
        if row["speedup_fwd_bwd"] is not None:
            by_policy.setdefault(pol, []).append(row["speedup_fwd_bwd"])
        status = "ok" if row["ours_ok"] else "FAILED: " + str(row["ours_error"] or "?").replace("|", "/")[:80]
        cells = [shape_name(k), pol, fmt(t_fb, ".3f"), fmt(o_fb, ".3f"),
                 fmt(row["speedup_fwd_bwd"], ".2f") + ("x" if row["speedup_fwd_bwd"] is not None else ""),
                 fmt(row["torch_bwd_TF"], ".1f"), fmt(row["ours_bwd_TF"], ".1f"), fmt(row["torch_peak_GB"], ".2f"),
                 fmt(row["ours_peak_GB"], ".2f"), status]
        print("| " + " | ".join(cells) + " |")
    print()
    only_ours = sorted(okeys - set(tmap))
    only_torch = sorted(set(tmap) - okeys)
    for k in only_ours:
        print(f"# only in ours:  {shape_name(k)}")
    for k in only_torch:
        print(f"# only in torch: {shape_name(k)}")
    print("# torch bwd = its fwd+bwd - a no-grad forward; ours bwd = the backward alone (ours derived the torch way "
          "is in the JSON)")

    geo = {p: geomean(v) for p, v in by_policy.items()}
    if joined:
        parts = [f"{p} {geo[p]:.2f}x ({len(by_policy[p])})" for p in policies if geo.get(p)]
        print("geomean fwd+bwd speedup torch/ours: " + (", ".join(parts) if parts else "none measured")
              + f" over {len({r['shape_key'] for r in joined})} shapes")
    else:
        print("no shape measured by both")

    combined = dict(ours=odoc if odoc else {"results": ours}, torch=tdoc if tdoc else {"rows": base},
                    rows=[{k: v for k, v in r.items() if k != "shape_key"} for r in joined],
                    only_ours=[dict(zip(("E", "k", "hidden", "ffn", "T"), k)) for k in only_ours],
                    only_torch=[dict(zip(("E", "k", "hidden", "ffn", "T"), k)) for k in only_torch],
                    geomean_speedup_fwd_bwd=geo)
    with open(out_json, "w") as f:
        json.dump(combined, f, indent=1)
    print(f"# combined JSON: {out_json}")
    if joined and plot(out_png, joined, policies):
        print(f"# plot: {out_png}")
    return 0 if joined else 1


if __name__ == "__main__":
    sys.exit(main())
