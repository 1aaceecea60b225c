#!/usr/bin/env python3
"""ab_builds.py: A/B of two builds of the sm_90a kernels (compile-time variants) on one H200.

  python3 launch/ab_builds.py --b-flags "-DEPMOE_SM90_WAIT_HINT_NS=10000000" [--a-flags ""]
          [--shape E,k,hidden,ffn,T]... [--rounds 3] [--warmup-ms 1500] [--iters 100]
          [--timeout 170] [--out DIR] [--no-check]
  python3 launch/ab_builds.py --self-test

launch/ab_steady.sh A/Bs runtime knobs (environment variables) inside one process; a change that
exists only at compile time (session 37: the uniform descriptors, behind -D flags while measured)
needs two builds. This configures build-ab-a and build-ab-b (Release, sm_90a, CMAKE_CUDA_FLAGS = the
variant's flags), builds epmoe_bench_experts in both at once, runs B's bench once with its reference
check (unless --no-check), then `rounds` rounds of one process per variant in the order AB, BA,
AB, ... (each process warms up before each shape, so each variant is timed at its own steady state),
and prints per shape and region the ms of every round, B/A per round (the pair of one round) and
the rounds B won. Default shapes: 16k and 7168/T=2k. A process that exceeds --timeout is killed
and its finished rows still count (size --timeout for the shapes: ~20 s per shape and process).
Logs and ab_builds.json go to --out (default $OUT or ./ab_builds_out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCH = "src/programs/epmoe_bench_experts"
NCCL_DIR = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl"
REGIONS = ("full", "seed", "up", "upG", "down")


def parse_rows(text):
    """{(E, k, hidden, ffn, T): {region: ms}} from epmoe_bench_experts' table rows."""
    rows = {}
    for line in text.splitlines():
        if not line.startswith(" ") or "|" not in line:
            continue
        parts = [p.split() for p in line.split("|")]
        try:
            shape = tuple(int(v) for v in parts[0])
            seed, full, kernels = float(parts[1][0]), float(parts[2][0]), [float(v) for v in parts[4]]
        except (ValueError, IndexError):
            continue
        if len(shape) != 5 or len(kernels) != 4:
            continue
        rows[shape] = {"full": full, "seed": seed, "up": kernels[1], "upG": kernels[2], "down": kernels[3]}
    return rows


def summarize(runs):
    """runs: [(round, variant, rows)] in run order -> {shape: {region: {a, b, ratios, wins}}}."""
    out = {}
    shapes = sorted({s for _, _, rows in runs for s in rows})
    nrounds = max((r for r, _, _ in runs), default=-1) + 1
    for shape in shapes:
        out[shape] = {}
        for region in REGIONS:
            a, b, ratios = [], [], []
            for r in range(nrounds):
                va = [rows[shape][region] for rr, v, rows in runs if rr == r and v == "a" and shape in rows]
                vb = [rows[shape][region] for rr, v, rows in runs if rr == r and v == "b" and shape in rows]
                a += va
                b += vb
                if va and vb and va[0] > 0:
                    ratios.append(vb[0] / va[0])
            out[shape][region] = {"a": a, "b": b, "ratios": ratios, "wins": sum(x < 1 for x in ratios),
                                  "mean_ratio": statistics.fmean(ratios) if ratios else None}
    return out


def print_summary(summary):
    print("# B/A per round (< 1: B faster); wins = rounds B won")
    print(f"# {'shape':<22} {'region':<5} | {'A ms per round':<30} | {'B ms per round':<30} | B/A per round")
    for shape, regions in summary.items():
        for region, s in regions.items():
            if not s["ratios"]:
                continue
            a = " ".join(f"{v:.4f}" for v in s["a"])
            b = " ".join(f"{v:.4f}" for v in s["b"])
            r = " ".join(f"{v:.4f}" for v in s["ratios"])
            print(f"  {','.join(map(str, shape)):<22} {region:<5} | {a:<30} | {b:<30} | {r} "
                  f"({s['wins']}/{len(s['ratios'])}, mean {s['mean_ratio']:.4f})")


def run(cmd, log, timeout=None, env=None):
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[killed at the {timeout} s limit]\n")
            return 124


def build(variant, flags, out):
    bdir = f"build-ab-{variant}"
    args = ["cmake", "-S", ".", "-B", bdir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DCMAKE_CUDA_ARCHITECTURES=90a", f"-DCMAKE_CUDA_FLAGS={flags}"]
    if os.path.isdir(NCCL_DIR):
        args.append(f"-DNCCL_ROOT={NCCL_DIR}")
    log = os.path.join(out, f"build_{variant}.log")
    cmd = " ".join(f"'{a}'" for a in args) + f" && cmake --build {bdir} -j 8 --target epmoe_bench_experts"
    with open(log, "w") as f:
        return subprocess.Popen(["bash", "-c", cmd], stdout=f, stderr=subprocess.STDOUT)


def self_test():
    line_a = ("    32  4   2048  1024   16384 |    1.4000    589.8 |    1.3600    606.5 |    1.4796    557.3 |"
              "    0.1281    0.9000    0.9038    0.5000 |   0.0186    1.4065 | -1.000e+00 -1.000e+00")
    line_b = line_a.replace("1.3600", "1.3464").replace("0.5000", "0.4900")
    header = "#    E  k hidden   ffn       T |   seed ms  TFLOP/s |   full ms  TFLOP/s |"
    ra, rb = parse_rows(header + "\n" + line_a), parse_rows(line_b)
    shape = (32, 4, 2048, 1024, 16384)
    assert list(ra) == [shape] and ra[shape]["full"] == 1.36 and ra[shape]["down"] == 0.5, ra
    assert parse_rows("  garbage | x\n") == {}
    runs = [(0, "a", ra), (0, "b", rb), (1, "b", rb), (1, "a", ra), (2, "a", ra), (2, "b", {})]
    s = summarize(runs)[shape]
    assert len(s["full"]["ratios"]) == 2 and abs(s["full"]["ratios"][0] - 0.99) < 1e-9, s["full"]
    assert s["full"]["wins"] == 2 and s["seed"]["wins"] == 0 and s["down"]["wins"] == 2, s
    assert s["full"]["a"] == [1.36, 1.36, 1.36] and s["full"]["b"] == [1.3464, 1.3464], s["full"]
    assert join_flag_values(["--b-flags", "-DX=1 -DY", "--rounds", "2", "--a-flags", ""]) == \
        ["--b-flags=-DX=1 -DY", "--rounds", "2", "--a-flags="]
    assert join_flag_values(["--b-flags=-DX"]) == ["--b-flags=-DX"]
    print("ab_builds self-test: OK")


def join_flag_values(argv):
    """--a-flags/--b-flags take compiler flags, which start with '-' and so would be read by argparse
    as options (S38-0: `--b-flags -DX=1` stopped with "expected one argument"): join them as --x=VALUE."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--a-flags", "--b-flags") and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main():
    if "--self-test" in sys.argv[1:]:
        self_test()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-flags", default="")
    ap.add_argument("--b-flags", required=True)
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=int, default=1500)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--timeout", type=int, default=170)
    ap.add_argument("--out", default=os.environ.get("OUT", "ab_builds_out"))
    ap.add_argument("--no-check", action="store_true")
    o = ap.parse_args(join_flag_values(sys.argv[1:]))
    shapes = o.shape or ["32,4,2048,1024,16384", "32,8,7168,2048,2048"]
    os.makedirs(o.out, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    t0 = time.time()
    procs = {v: build(v, f, o.out) for v, f in (("a", o.a_flags), ("b", o.b_flags))}
    if any(p.wait() != 0 for p in procs.values()):
        print(f"build failed: see {o.out}/build_a.log, build_b.log")
        return 1
    print(f"[ab_builds {time.time() - t0:.0f}s] built both variants", flush=True)
    shape_args = [a for s in shapes for a in ("--shape", s)]
    if not o.no_check:
        log = os.path.join(o.out, "check_b.log")
        rc = run([f"build-ab-b/{BENCH}", *shape_args, "--iters", "10", "--warmup-ms", "200"], log, o.timeout, env)
        text = open(log).read()
        if rc != 0 or "CHECK FAILED" in text:
            print(f"B's reference check failed (rc {rc}): see {log}")
            return 1
        print(f"[ab_builds {time.time() - t0:.0f}s] B's reference check passed", flush=True)
    runs = []
    for r in range(o.rounds):
        for v in ("ab" if r % 2 == 0 else "ba"):
            log = os.path.join(o.out, f"bench_{r}_{v}.log")
            rc = run([f"build-ab-{v}/{BENCH}", *shape_args, "--no-check", "--warmup-ms", str(o.warmup_ms),
                      "--iters", str(o.iters)], log, o.timeout, env)
            rows = parse_rows(open(log).read())
            runs.append((r, v, rows))
            print(f"[ab_builds {time.time() - t0:.0f}s] round {r} {v.upper()}: rc {rc}, {len(rows)} shape(s)",
                  flush=True)
    summary = summarize(runs)
    print_summary(summary)
    with open(os.path.join(o.out, "ab_builds.json"), "w") as f:
        json.dump({"a_flags": o.a_flags, "b_flags": o.b_flags, "rounds": o.rounds,
                   "shapes": {",".join(map(str, k)): v for k, v in summary.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
