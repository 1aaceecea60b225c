#!/usr/bin/env python3
"""ab_builds.py: A/B of two builds of the sm_90a kernels on one H200: two sets of compile flags, or
two source trees (e.g. an older commit against the working tree).

  python3 launch/ab_builds.py [--a-tree DIR] [--b-tree DIR] [--a-flags FLAGS] [--b-flags FLAGS]
          [--shapes quick|full | --shape E,k,hidden,ffn,T ...] [--rounds 3] [--warmup-ms 1500]
          [--iters 100] [--timeout S] [--out DIR] [--no-check]
  python3 launch/ab_builds.py --self-test

  compile-time variant:  python3 launch/ab_builds.py --b-flags "-DEPMOE_SM90_WAIT_HINT_NS=10000000"
  old tree against new:  git worktree add abref/old <commit>   (or any copy of an older tree), then
                         python3 launch/ab_builds.py --a-tree abref/old --shapes full --rounds 1 --no-check
                         (full = the nine shapes of the bench's --shapes full)

launch/ab_steady.sh A/Bs plans (--ab-plan) inside one process; a change that exists only at compile
time (-D flags while measured) or only in another tree needs two builds. This configures build-ab-a
and build-ab-b in the repository (Release, sm_90a, CMAKE_CUDA_FLAGS = the variant's flags; sources
= the variant's tree, default this repository for both; a build dir configured from another tree
is wiped first), builds epmoe_bench_experts in both at once, runs B's bench once with its reference
check (unless --no-check), then `rounds` rounds of one process per variant in the order AB, BA,
AB, ... (each process warms up before each region, so each variant is timed at its own steady
state), and prints per shape and region the ms of every round, B/A per round (the pair of one
round) and the rounds B won, then each variant's plan per shape where its bench prints one.

The bench tables are read by their header names, so an older bench compares with the current one:
the old table (seed ms | full ms | sep ms | gather ms up ms upG ms down ms | zero ms serial ms)
times the gathering UP as 'upG' and an UP from a pre-gathered xs as 'up'; the current one (full ms |
up ms down ms | zero ms serial ms) has only the gathering UP, as 'up'. Here the gathering UP is
region 'up' in both (the old UP from xs is 'up_xs'), and every region that both outputs have is
compared: full, up, down, zero, serial across the change; seed, sep, gather only between two old
builds. Default shapes: 16k and 7168/T=2k. A process that exceeds --timeout (default 25 s per
shape, at least 170 s) is killed and its finished rows still count. Logs and ab_builds.json go to
--out (default $OUT or ./ab_builds_out).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = "src/programs/epmoe_bench_experts"
NCCL_DIR = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl"
SHAPE_COLS = ["E", "k", "hidden", "ffn", "T"]
# Printing order; a region is compared where both variants' tables have it.
REGIONS = ("full", "up", "down", "serial", "zero", "seed", "sep", "gather", "up_xs")
QUICK_SHAPES = ["32,4,2048,1024,16384", "32,8,7168,2048,2048"]


def header_columns(line):
    """Column names per '|' segment of a bench table header ('#    E  k hidden ffn T | full ms TFLOP/s
    | ...'; 'NAME ms' is one name), or None when the line is no such header."""
    if not line.startswith("#") or "|" not in line:
        return None
    cols = []
    for seg in line[1:].split("|"):
        toks, names, i = seg.split(), [], 0
        while i < len(toks):
            if i + 1 < len(toks) and toks[i + 1] == "ms":
                names.append(toks[i] + " ms")
                i += 2
            else:
                names.append(toks[i])
                i += 1
        cols.append(names)
    return cols if cols[0] == SHAPE_COLS else None


def region_names(cols):
    """{column index in the flattened row: region} for a header's 'NAME ms' columns. The old bench's
    'up ms' is its UP from xs and 'upG ms' its gathering UP, the one the current bench calls 'up'."""
    flat = [n for seg in cols for n in seg]
    old = "upG ms" in flat
    out = {}
    for i, n in enumerate(flat):
        if not n.endswith(" ms"):
            continue
        name = n[:-3]
        if old and name == "up":
            name = "up_xs"
        elif old and name == "upG":
            name = "up"
        out[i] = name
    return out


def parse_rows(text):
    """{(E, k, hidden, ffn, T): {region: ms}} from epmoe_bench_experts' table rows, each read by the
    last header line above it (rows before any header are skipped)."""
    rows, cols, regions = {}, None, {}
    for line in text.splitlines():
        h = header_columns(line)
        if h is not None:
            cols, regions = h, region_names(h)
            continue
        if cols is None or not line.startswith("  ") or "|" not in line:
            continue
        segs = [p.split() for p in line.split("|")]
        if len(segs) != len(cols) or any(len(s) != len(c) for s, c in zip(segs, cols)):
            continue
        flat = [v for s in segs for v in s]
        try:
            shape = tuple(int(v) for v in flat[:5])
            rows[shape] = {name: float(flat[i]) for i, name in regions.items()}
        except ValueError:
            continue
    return rows


def parse_plans(text):
    """{shape: plan} from the '#   plan: ...' line that follows each row (current bench only)."""
    plans, shape = {}, None
    for line in text.splitlines():
        if line.startswith("  ") and "|" in line:
            try:
                shape = tuple(int(v) for v in line.split("|")[0].split())
            except ValueError:
                shape = None
        elif line.startswith("#   plan: ") and shape is not None and len(shape) == 5:
            plans[shape] = line[len("#   plan: "):].strip()
    return plans


def summarize(runs):
    """runs: [(round, variant, rows)] in run order -> {shape: {region: {a, b, ratios, wins}}} over the
    regions that both variants measured for the shape."""
    out = {}
    shapes = sorted({s for _, _, rows in runs for s in rows})
    nrounds = max((r for r, _, _ in runs), default=-1) + 1
    for shape in shapes:
        out[shape] = {}
        for region in REGIONS:
            a, b, ratios = [], [], []
            for r in range(nrounds):
                va = [rows[shape][region] for rr, v, rows in runs
                      if rr == r and v == "a" and region in rows.get(shape, {})]
                vb = [rows[shape][region] for rr, v, rows in runs
                      if rr == r and v == "b" and region in rows.get(shape, {})]
                a += va
                b += vb
                if va and vb and va[0] > 0:
                    ratios.append(vb[0] / va[0])
            if a and b:
                out[shape][region] = {"a": a, "b": b, "ratios": ratios, "wins": sum(x < 1 for x in ratios),
                                      "mean_ratio": statistics.fmean(ratios) if ratios else None}
    return out


def print_summary(summary, plans=None):
    print("# B/A per round (< 1: B faster); wins = rounds B won")
    print(f"# {'shape':<22} {'region':<6} | {'A ms per round':<30} | {'B ms per round':<30} | B/A per round")
    for shape, regions in summary.items():
        for region, s in regions.items():
            if not s["ratios"]:
                continue
            a = " ".join(f"{v:.4f}" for v in s["a"])
            b = " ".join(f"{v:.4f}" for v in s["b"])
            r = " ".join(f"{v:.4f}" for v in s["ratios"])
            print(f"  {','.join(map(str, shape)):<22} {region:<6} | {a:<30} | {b:<30} | {r} "
                  f"({s['wins']}/{len(s['ratios'])}, mean {s['mean_ratio']:.4f})")
    for v, p in sorted((plans or {}).items()):
        for shape, plan in sorted(p.items()):
            print(f"# plan {v.upper()} {','.join(map(str, shape)):<22} {plan}")


def run(cmd, log, timeout=None, env=None):
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[killed at the {timeout} s limit]\n")
            return 124


def cached_source(bdir):
    """The source dir an existing build dir was configured from, or None."""
    try:
        with open(os.path.join(bdir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    return os.path.realpath(line.split("=", 1)[1].strip())
    except OSError:
        pass
    return None


def build(variant, tree, flags, out):
    bdir = os.path.join(REPO, f"build-ab-{variant}")
    src = cached_source(bdir)
    if src is not None and src != os.path.realpath(tree):
        print(f"[ab_builds] {bdir} was configured from {src}: wiping it for {tree}", flush=True)
        shutil.rmtree(bdir)
    args = ["cmake", "-S", tree, "-B", bdir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DCMAKE_CUDA_ARCHITECTURES=90a", f"-DCMAKE_CUDA_FLAGS={flags}"]
    if os.path.isdir(NCCL_DIR):
        args.append(f"-DNCCL_ROOT={NCCL_DIR}")
    log = os.path.join(out, f"build_{variant}.log")
    cmd = " ".join(f"'{a}'" for a in args) + f" && cmake --build '{bdir}' -j 8 --target epmoe_bench_experts"
    with open(log, "w") as f:
        return subprocess.Popen(["bash", "-c", cmd], stdout=f, stderr=subprocess.STDOUT)


def tree_commit(tree):
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


OLD_TABLE = """\
# epmoe sm_90a split pipeline on NVIDIA H200 (132 SMs), 100 iters, median, after >= 1500 ms of warm-up replays; zeroing joined before UP
# full: as the engine runs it (UP gathers its rows unless EPMOE_SM90_GATHER=separate); sep: gather_rows kernel + UP from xs. up: from xs; upG: gathering
#    E  k hidden   ffn       T |   seed ms  TFLOP/s |   full ms  TFLOP/s |    sep ms  TFLOP/s | gather ms     up ms    upG ms   down ms |  zero ms serial ms |    max_rel    rel_l2
    32  4   2048  1024   16384 |    1.4000    589.8 |    1.3600    606.5 |    1.4796    557.3 |    0.1281    0.9000    0.9038    0.5000 |   0.0186    1.4065 | -1.000e+00 -1.000e+00
"""
NEW_TABLE = """\
# epmoe sm_90a split pipeline on NVIDIA H200 (132 SMs), 100 iters, median, after >= 1500 ms of warm-up replays
# no seed region: our UP always gathers from x (no UP from a pre-gathered xs); compare torch's seed region against our full layer, which does more work
#    E  k hidden   ffn       T |   full ms  TFLOP/s |     up ms   down ms |  zero ms serial ms |    max_rel    rel_l2
    32  4   2048  1024   16384 |    1.3464    612.6 |    0.8948    0.4900 |   0.0186    1.3900 | -1.000e+00 -1.000e+00
#   plan: up=pairs up_order=global down_order=global down=single split=none split_ctas=132 pad=none tail=on
    32  8   7168  2048    2048 |    2.0000    360.8 |    1.2000    0.8000 |   0.0100    2.0100 | -1.000e+00 -1.000e+00
#   plan: up=pairs up_order=expert down_order=expert down=cluster split=none split_ctas=132 pad=none tail=on
"""


def self_test():
    shape, shape2 = (32, 4, 2048, 1024, 16384), (32, 8, 7168, 2048, 2048)
    old, new = parse_rows(OLD_TABLE), parse_rows(NEW_TABLE)
    assert list(old) == [shape], old
    assert old[shape] == {"seed": 1.4, "full": 1.36, "sep": 1.4796, "gather": 0.1281, "up_xs": 0.9, "up": 0.9038,
                          "down": 0.5, "zero": 0.0186, "serial": 1.4065}, old
    assert list(new) == [shape, shape2], new
    assert new[shape] == {"full": 1.3464, "up": 0.8948, "down": 0.49, "zero": 0.0186, "serial": 1.39}, new
    row_only = OLD_TABLE.splitlines()[-1]
    assert parse_rows(row_only) == {}, "a row without a header above it is skipped"
    assert parse_rows("#    E  k hidden   ffn       T |   full ms  TFLOP/s\n  garbage | x\n") == {}
    assert parse_plans(NEW_TABLE)[shape2].startswith("up=pairs up_order=expert"), parse_plans(NEW_TABLE)
    assert parse_plans(OLD_TABLE) == {}
    # Old build as A, new as B: full, up (old upG vs new up), down, zero, serial compared; seed only in A.
    runs = [(0, "a", old), (0, "b", new), (1, "b", new), (1, "a", old), (2, "a", old), (2, "b", {})]
    s = summarize(runs)
    assert set(s[shape]) == {"full", "up", "down", "zero", "serial"}, s[shape]
    assert s[shape2] == {}, s[shape2]  # only B measured it
    f = s[shape]["full"]
    assert len(f["ratios"]) == 2 and abs(f["ratios"][0] - 0.99) < 1e-9 and f["wins"] == 2, f
    assert f["a"] == [1.36, 1.36, 1.36] and f["b"] == [1.3464, 1.3464], f
    assert abs(s[shape]["up"]["ratios"][0] - 0.8948 / 0.9038) < 1e-12 and s[shape]["down"]["wins"] == 2, s[shape]
    assert s[shape]["zero"]["wins"] == 0, s[shape]["zero"]
    # Two old builds: the old-only regions are compared too.
    s2 = summarize([(0, "a", old), (0, "b", old)])[shape]
    assert {"seed", "sep", "gather", "up_xs"} <= set(s2), s2
    assert join_flag_values(["--b-flags", "-DX=1 -DY", "--rounds", "2", "--a-flags", ""]) == \
        ["--b-flags=-DX=1 -DY", "--rounds", "2", "--a-flags="]
    assert join_flag_values(["--b-flags=-DX"]) == ["--b-flags=-DX"]
    assert join_flag_values(["--a-tree", "abref/old"]) == ["--a-tree", "abref/old"]
    print("ab_builds self-test: OK")


def join_flag_values(argv):
    """--a-flags/--b-flags take compiler flags, which start with '-' and so would be read by argparse
    as options (`--b-flags -DX=1` stopped with "expected one argument"): join them as --x=VALUE."""
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
    ap.add_argument("--a-tree", default=REPO, help="source tree of A (default: this repository)")
    ap.add_argument("--b-tree", default=REPO, help="source tree of B (default: this repository)")
    ap.add_argument("--a-flags", default="")
    ap.add_argument("--b-flags", default="")
    ap.add_argument("--shapes", choices=("quick", "full"), help="the bench's shape list (instead of --shape)")
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=int, default=1500)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--timeout", type=int, help="per bench process (default 25 s per shape, at least 170)")
    ap.add_argument("--out", default=os.environ.get("OUT", "ab_builds_out"))
    ap.add_argument("--no-check", action="store_true")
    o = ap.parse_args(join_flag_values(sys.argv[1:]))
    if o.shapes and o.shape:
        ap.error("--shapes and --shape exclude each other")
    trees = {"a": os.path.abspath(o.a_tree), "b": os.path.abspath(o.b_tree)}
    for v, t in trees.items():
        if not os.path.isfile(os.path.join(t, "CMakeLists.txt")):
            ap.error(f"--{v}-tree {t}: no CMakeLists.txt there")
    flags = {"a": o.a_flags, "b": o.b_flags}
    if os.path.realpath(trees["a"]) == os.path.realpath(trees["b"]) and flags["a"] == flags["b"]:
        print("[ab_builds] A and B are the same tree and flags: an A/A control of two builds", flush=True)
    if o.shapes:
        shape_args, nshapes = ["--shapes", o.shapes], 9 if o.shapes == "full" else 3
    else:
        shapes = o.shape or QUICK_SHAPES
        shape_args, nshapes = [a for s in shapes for a in ("--shape", s)], len(shapes)
    timeout = o.timeout or max(170, 25 * nshapes)
    os.makedirs(o.out, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    bench = {v: os.path.join(REPO, f"build-ab-{v}", BENCH) for v in "ab"}
    t0 = time.time()
    procs = {v: build(v, trees[v], flags[v], o.out) for v in "ab"}
    if any(p.wait() != 0 for p in procs.values()):
        print(f"build failed: see {o.out}/build_a.log, build_b.log")
        return 1
    print(f"[ab_builds {time.time() - t0:.0f}s] built both variants", flush=True)
    if not o.no_check:
        log = os.path.join(o.out, "check_b.log")
        rc = run([bench["b"], *shape_args, "--iters", "10", "--warmup-ms", "200"], log, timeout, env)
        text = open(log).read()
        if rc != 0 or "CHECK FAILED" in text:
            print(f"B's reference check failed (rc {rc}): see {log}")
            return 1
        print(f"[ab_builds {time.time() - t0:.0f}s] B's reference check passed", flush=True)
    runs, plans = [], {"a": {}, "b": {}}
    for r in range(o.rounds):
        for v in ("ab" if r % 2 == 0 else "ba"):
            log = os.path.join(o.out, f"bench_{r}_{v}.log")
            rc = run([bench[v], *shape_args, "--no-check", "--warmup-ms", str(o.warmup_ms), "--iters", str(o.iters)],
                     log, timeout, env)
            text = open(log).read()
            rows = parse_rows(text)
            plans[v].update(parse_plans(text))
            runs.append((r, v, rows))
            print(f"[ab_builds {time.time() - t0:.0f}s] round {r} {v.upper()}: rc {rc}, {len(rows)} shape(s)",
                  flush=True)
    summary = summarize(runs)
    print_summary(summary, plans)
    with open(os.path.join(o.out, "ab_builds.json"), "w") as f:
        json.dump({"a_tree": trees["a"], "b_tree": trees["b"], "a_commit": tree_commit(trees["a"]),
                   "b_commit": tree_commit(trees["b"]), "a_flags": o.a_flags, "b_flags": o.b_flags,
                   "rounds": o.rounds, "shapes": {",".join(map(str, k)): v for k, v in summary.items()},
                   "plans": {v: {",".join(map(str, k)): p for k, p in ps.items()} for v, ps in plans.items()}},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
