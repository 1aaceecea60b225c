#!/usr/bin/env python3
# Side by side: epmoe_bench_ep's JSON against launch/ep_baseline.py's, for the shapes and world
# sizes both measured.
#
#   python3 launch/compare_ep.py OURS.json BASELINE.json [--markdown]
#
# Phases are grouped to the baseline's three: dispatch = layout + exchange + dispatch, experts,
# combine = combine + reduce. ratio = torch ms / ours ms (> 1: we are faster). Exit status 1 when no
# shape matches.
import argparse, json, math, sys


def load(path):
    """Records from {"results": [...]}, a list, or JSON lines."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
        recs = doc.get("results", []) if isinstance(doc, dict) else doc
    except json.JSONDecodeError:
        recs = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    return [r for r in recs if isinstance(r, dict)]


def key(r):
    g = lambda *names: next(int(r[n]) for n in names if n in r)
    return (g("world"), g("E"), g("k"), g("hidden", "D"), g("ffn", "H"), g("tokens_per_rank", "T_per_rank"))


def ours_phases(r):
    f = lambda n: float(r.get(n) or 0.0)
    return (f("layout_ms") + f("exchange_ms") + f("dispatch_ms"), f("experts_ms"), f("combine_ms") + f("reduce_ms"))


def torch_phases(r):
    return (float(r["dispatch_ms"]), float(r["experts_ms"]), float(r["combine_ms"]))


def ratio(a, b):
    return a / b if b > 0 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("ours")
    ap.add_argument("baseline")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    a = ap.parse_args()
    ours = {key(r): r for r in load(a.ours)}
    base = {key(r): r for r in load(a.baseline)}
    both = sorted(set(ours) & set(base), key=lambda k: (k[0], k[1], k[3], k[5]))

    cols = ["world", "E", "k", "hidden", "ffn", "tokens", "torch ms", "ours ms", "ratio", "torch TF/s", "ours TF/s",
            "disp torch/ours", "experts torch/ours", "comb torch/ours", "ours path", "checks"]
    rows = []
    ratios = []
    for k in both:
        o, b = ours[k], base[k]
        tms, oms = float(b["ms"]), float(o["ms"])
        r = ratio(tms, oms)
        if math.isfinite(r) and r > 0: ratios.append(r)
        tp, op = torch_phases(b), ours_phases(o)
        checks = "ok" if o.get("rows_ok", True) and o.get("check_ok", True) else "FAIL"
        rows.append([str(v) for v in k] + [f"{tms:.3f}", f"{oms:.3f}", f"{r:.2f}x", f"{float(b['tflops_per_gpu']):.1f}",
                                           f"{float(o['tflops_per_gpu']):.1f}"]
                    + [f"{t:.3f}/{p:.3f}" for t, p in zip(tp, op)] + [str(o.get("expert_path", "?")), checks])

    if a.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for row in rows: print("| " + " | ".join(row) + " |")
    else:
        w = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
        print("  ".join(c.rjust(w[i]) for i, c in enumerate(cols)))
        for row in rows: print("  ".join(v.rjust(w[i]) for i, v in enumerate(row)))
    for k in sorted(set(ours) - set(base)): print(f"# only in ours:     world {k[0]} E={k[1]} k={k[2]} hidden={k[3]} ffn={k[4]} T={k[5]}")
    for k in sorted(set(base) - set(ours)): print(f"# only in baseline: world {k[0]} E={k[1]} k={k[2]} hidden={k[3]} ffn={k[4]} T={k[5]}")
    if not both:
        print("no shape measured by both")
        return 1
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    print(f"geomean speedup torch/ours: {geo:.2f}x over {len(both)} shapes "
          f"(min {min(ratios, default=float('nan')):.2f}x, max {max(ratios, default=float('nan')):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
