#!/usr/bin/env python3
"""CPU smoke test of the scaling benchmark (launch/scaling_bench.py over epmoe_bench_scaling) on mock
ranks: runs the driver at worlds 1, 2, 4 (weak and strong) on a small shape, then checks what it
wrote: one JSON row per (mode, world) with the driver's token arithmetic, positive times and passing
reference checks, the table's rows, and a PNG (where matplotlib imports).

    python3 tests/scaling_smoke.py BUILD_DIR OUT_DIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(msg):
    print(f"scaling_smoke: FAIL: {msg}")
    sys.exit(1)


def main():
    build, out = sys.argv[1], sys.argv[2]
    E, k, H, F, T = 8, 2, 256, 128, 32
    cmd = [sys.executable, os.path.join(HERE, "..", "launch", "scaling_bench.py"), "--build", build, "--cpu",
           "--worlds", "1,2,4", "--shape", f"{E},{k},{H},{F},{T}", "--iters", "2", "--warmup-ms", "0",
           "--out-dir", out]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        fail(f"the driver exited with {rc}")
    doc = json.load(open(os.path.join(out, "scaling.json")))
    rows = doc["rows"]
    want = [(m, w) for m in ("weak", "strong") for w in (1, 2, 4)]
    got = [(r["mode"], r["world"]) for r in rows]
    if got != want:
        fail(f"rows {got}, expected {want}")
    for r in rows:
        tokens = T if r["mode"] == "weak" else T * 4 // r["world"]
        if r["tokens_per_rank"] != tokens:
            fail(f"{r['mode']} world {r['world']}: {r['tokens_per_rank']} tokens per rank, expected {tokens}")
        # every slot routes to an expert: T k pairs per rank in all
        if r.get("pairs") != tokens * k * r["world"]:
            fail(f"{r['mode']} world {r['world']}: {r.get('pairs')} pairs, expected {tokens * k * r['world']}")
        if not (r["ours_fwd_ms"] > 0 and r["ours_fwdbwd_ms"] > 0 and r["check_ok"]):
            fail(f"row {r}")
        if r["torch_fwd_ms"] is not None:
            fail("a torch baseline on CPU mock ranks")
    table = open(os.path.join(out, "scaling.txt")).read().splitlines()
    if sum(1 for line in table if not line.startswith("#")) != len(want):
        fail("the table does not have one line per row")
    png = os.path.join(out, "scaling.png")
    try:
        import matplotlib  # noqa: F401
        if open(png, "rb").read(8) != b"\x89PNG\r\n\x1a\n":
            fail(f"{png} is not a PNG")
    except ImportError:
        print("scaling_smoke: matplotlib does not import here: the plot is not checked")
    print("scaling_smoke: PASS")


if __name__ == "__main__":
    main()
