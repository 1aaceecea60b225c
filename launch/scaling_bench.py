#!/usr/bin/env python3
"""The single-node scaling benchmark: the layer's forward and fwd+bwd over world sizes 1..N, weak and
strong scaling, ours (epmoe_bench_scaling) beside the torch EP baseline (launch/ep_baseline.py
--backward) in the same run. Writes an nccl-tests-style table, a JSON file and a PNG plot.

    python3 launch/scaling_bench.py [--build build] [--worlds auto|1,2,4] [--shape E,k,hidden,ffn,T]
                                    [--modes weak,strong] [--torch auto|on|off] [--cpu] [--iters 10]
                                    [--out-dir build/scaling]

  weak:   T tokens per rank at every world size;
  strong: the largest world's global batch (T x max world) split over w ranks (T x max / w per rank).
  GPUs (nvidia-smi, unless --cpu): one rank per GPU under mpirun, worlds 1, 2, 4, ... up to the GPUs
  present; the torch baseline too (auto: when torch with CUDA imports). --cpu: CPU mock ranks (threads
  of one process; worlds 1, 2, 4 by default) and no torch baseline: the smoke test CI runs.
  TFLOP/s per GPU: 6 hidden ffn per routed pair for the forward, 18 for fwd+bwd, over the world size
  (ours counts the pairs it computed; torch's T k, as no slot is dropped).
  Every row's run of ours checks y against the CPU reference and the gradients for NaN; the exit
  status is non-zero when any check or run fails (the other rows still run).
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(msg):
    print(f"[scaling {datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def gpu_count():
    if not shutil.which("nvidia-smi"):
        return 0
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU ")) if r.returncode == 0 else 0


def parse_shape(text):
    v = tuple(int(p) for p in text.split(","))
    if len(v) != 5 or min(v) <= 0:
        raise argparse.ArgumentTypeError("--shape wants E,k,hidden,ffn,T (positive)")
    return v


def default_worlds(n, E):
    w, out = 1, []
    while w <= n:
        out.append(w)
        w *= 2
    if n not in out:
        out.append(n)
    return [x for x in out if E % x == 0]


def run(cmd, env, timeout):
    """Runs one point; returns (rc, output). The output is kept for the log."""
    t0 = time.time()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    return rc, out, time.time() - t0


def ours_point(a, mode, world, tokens, on_gpu, env, logf):
    E, k, H, F, _ = a.shape
    tmp = os.path.join(a.out_dir, f".ours_{mode}_{world}.json")
    if os.path.exists(tmp):
        os.remove(tmp)
    prog = [a.program, "--shape", f"{E},{k},{H},{F},{tokens}", "--iters", str(a.iters), "--label", mode,
            "--json", tmp, "--warmup-ms", str(a.warmup_ms), "--check-tokens", str(a.check_tokens)]
    if on_gpu:
        cmd = ["mpirun", "-np", str(world), "--bind-to", "none"] + prog
    else:
        cmd = prog + ["--mock-ranks", str(world), "--device", "cpu"]
    rc, out, secs = run(cmd, env, a.timeout)
    logf.write(f"$ {' '.join(cmd)}\n{out}\n[rc {rc}, {secs:.1f} s]\n\n")
    rec = None
    if os.path.exists(tmp):
        rec = json.load(open(tmp))
        os.remove(tmp)
    return rc, rec, secs


def torch_point(a, world, tokens, env, logf):
    E, k, H, F, _ = a.shape
    tmp = os.path.join(a.out_dir, f".torch_{world}_{tokens}.json")
    if os.path.exists(tmp):
        os.remove(tmp)
    cmd = [a.python, os.path.join(HERE, "ep_baseline.py"), "--world", str(world), "--shape",
           f"{E},{k},{H},{F},{tokens}", "--backward", "--iters", str(a.iters), "--warmup-ms", str(a.warmup_ms),
           "--json", tmp]
    rc, out, secs = run(cmd, env, a.timeout)
    logf.write(f"$ {' '.join(cmd)}\n{out}\n[rc {rc}, {secs:.1f} s]\n\n")
    rec = None
    if os.path.exists(tmp):
        res = json.load(open(tmp)).get("results", [])
        rec = res[0] if res else None
        os.remove(tmp)
    return rc, rec, secs


def fmt(v, spec):
    """v in format `spec` (such as '7.3f'), or '-' as wide where there is no value."""
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0]))


def table(rows, meta):
    where = f"{meta['device']} x{meta['gpus']}" if meta["gpus"] else "CPU"
    lines = [f"# epmoe scaling: {where} ({meta['backend']}), E={meta['E']} k={meta['k']} "
             f"hidden={meta['hidden']} ffn={meta['ffn']}, T={meta['T']}, {meta['date']}, commit {meta['commit']}",
             "#   weak: T tokens per rank; strong: T x max world tokens in all; ms = slowest rank's median; "
             "TF = TFLOP/s per GPU",
             "#                                |            ours (epmoe)             |            torch EP baseline        |   speedup",
             "#   mode  world   tokens/rank    |  fwd_ms     TF  fwdbwd_ms     TF    |  fwd_ms     TF  fwdbwd_ms     TF    |  fwd  f+b  check"]
    for r in rows:
        sp_f = r["ours_fwd_ms"] and r["torch_fwd_ms"] and r["torch_fwd_ms"] / r["ours_fwd_ms"]
        sp_b = r["ours_fwdbwd_ms"] and r["torch_fwdbwd_ms"] and r["torch_fwdbwd_ms"] / r["ours_fwdbwd_ms"]
        lines.append(
            f"  {r['mode']:>6} {r['world']:>6} {r['tokens_per_rank']:>13}    | {fmt(r['ours_fwd_ms'], '7.3f')} "
            f"{fmt(r['ours_fwd_tflops_per_gpu'], '6.1f')} {fmt(r['ours_fwdbwd_ms'], '10.3f')} "
            f"{fmt(r['ours_fwdbwd_tflops_per_gpu'], '6.1f')}    | {fmt(r['torch_fwd_ms'], '7.3f')} "
            f"{fmt(r['torch_fwd_tflops_per_gpu'], '6.1f')} {fmt(r['torch_fwdbwd_ms'], '10.3f')} "
            f"{fmt(r['torch_fwdbwd_tflops_per_gpu'], '6.1f')}    | {fmt(sp_f or None, '4.2f')} "
            f"{fmt(sp_b or None, '4.2f')}  {'OK' if r['check_ok'] else 'FAIL'}")
    return "\n".join(lines) + "\n"


def plot(rows, meta, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib does not import: no plot")
        return False
    modes = sorted({r["mode"] for r in rows}, key=lambda m: (m != "weak", m))
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes), 7.5), squeeze=False)
    series = [("ours_fwd", "ours fwd", "C0", "-"), ("ours_fwdbwd", "ours fwd+bwd", "C0", "--"),
              ("torch_fwd", "torch fwd", "C3", "-"), ("torch_fwdbwd", "torch fwd+bwd", "C3", "--")]
    for c, mode in enumerate(modes):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["world"])
        ws = [r["world"] for r in rs]
        for key, label, color, style in series:
            for row, (suffix, ylabel) in enumerate((("_ms", "ms per call (slowest rank)"),
                                                    ("_tflops_per_gpu", "TFLOP/s per GPU"))):
                pts = [(w, r[key + suffix]) for w, r in zip(ws, rs) if r.get(key + suffix)]
                if pts:
                    axes[row][c].plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                                      label=label)
                axes[row][c].set_ylabel(ylabel)
        for row in range(2):
            ax = axes[row][c]
            ax.set_xscale("log", base=2)
            ax.set_xticks(ws, [str(w) for w in ws])
            ax.set_xlabel("world size (ranks)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][c].set_title(f"{mode} scaling")
    fig.suptitle(f"epmoe scaling, {meta['device']} ({meta['backend']}): E={meta['E']} k={meta['k']} "
                 f"{meta['hidden']}/{meta['ffn']}, T={meta['T']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build folder (epmoe_bench_scaling)")
    ap.add_argument("--worlds", default="auto", help="auto, or a list such as 1,2,4")
    ap.add_argument("--shape", type=parse_shape, default=None,
                    help="E,k,hidden,ffn,T (default 32,4,2048,1024,16384 on GPUs, 8,2,256,128,64 on CPU)")
    ap.add_argument("--modes", default="weak,strong")
    ap.add_argument("--torch", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--cpu", action="store_true", help="CPU mock ranks even where GPUs are present")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup-ms", type=float, default=300.0)
    ap.add_argument("--check-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per point")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the torch baseline")
    ap.add_argument("--commit", default="", help="a revision label (default: git describe of the repo)")
    ap.add_argument("--out-dir", default=None, help="where scaling.{txt,json,png} and the log go (default build/scaling)")
    a = ap.parse_args()

    ngpu = 0 if a.cpu else gpu_count()
    on_gpu = ngpu > 0
    if a.shape is None:
        a.shape = (32, 4, 2048, 1024, 16384) if on_gpu else (8, 2, 256, 128, 64)
    E, k, H, F, T = a.shape
    a.out_dir = a.out_dir or os.path.join(a.build, "scaling")
    os.makedirs(a.out_dir, exist_ok=True)
    a.program = os.path.join(a.build, "src", "programs", "epmoe_bench_scaling")
    if not os.path.exists(a.program):
        sys.exit(f"scaling_bench: {a.program} not found (build first: cmake --build {a.build})")
    worlds = default_worlds(ngpu if on_gpu else 4, E) if a.worlds == "auto" else [int(w) for w in a.worlds.split(",")]
    bad = [w for w in worlds if w < 1 or E % w or (on_gpu and w > ngpu)]
    if bad or not worlds:
        sys.exit(f"scaling_bench: world sizes {bad or worlds} do not fit (E={E} must divide by each; "
                 f"{ngpu} GPU(s))")
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in ("weak", "strong") for m in modes):
        sys.exit("scaling_bench: --modes takes weak and/or strong")
    wmax = max(worlds)
    with_torch = on_gpu and a.torch != "off"
    if with_torch and a.torch == "auto":
        probe = subprocess.run([a.python, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
        with_torch = probe.returncode == 0
        if not with_torch:
            log(f"no torch with CUDA in {a.python}: the torch baseline is left out")
    elif a.torch == "on" and not on_gpu:
        sys.exit("scaling_bench: --torch on needs GPUs (the baseline is NCCL + grouped_mm)")

    env = dict(os.environ, **NO_MULTICAST)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    commit = a.commit or subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                                        text=True).stdout.strip() or "unknown"
    meta = dict(date=datetime.date.today().isoformat(), commit=commit, backend="cuda" if on_gpu else "cpu mock ranks",
                gpus=ngpu, device="cpu", E=E, k=k, hidden=H, ffn=F, T=T, worlds=worlds, modes=modes, iters=a.iters,
                torch_baseline=with_torch)
    points = [(m, w) for m in modes for w in worlds]
    rows, failures = [], 0
    t_start = time.time()
    with open(os.path.join(a.out_dir, "scaling.log"), "w") as logf:
        for i, (mode, w) in enumerate(points):
            tokens = T if mode == "weak" else (T * wmax) // w
            rc, ours, secs = ours_point(a, mode, w, tokens, on_gpu, env, logf)
            row = dict(mode=mode, world=w, tokens_per_rank=tokens, ours_fwd_ms=None, ours_fwdbwd_ms=None,
                       ours_fwd_tflops_per_gpu=None, ours_fwdbwd_tflops_per_gpu=None, torch_fwd_ms=None,
                       torch_fwdbwd_ms=None, torch_fwd_tflops_per_gpu=None, torch_fwdbwd_tflops_per_gpu=None,
                       check_ok=False, ours_rc=rc, torch_rc=None)
            if ours:
                meta["device"] = ours.get("device", meta["device"])
                row.update(ours_fwd_ms=ours["fwd_ms"], ours_fwdbwd_ms=ours["fwdbwd_ms"],
                           ours_fwd_tflops_per_gpu=ours["fwd_tflops_per_gpu"],
                           ours_fwdbwd_tflops_per_gpu=ours["fwdbwd_tflops_per_gpu"], check_ok=bool(ours["check_ok"]),
                           pairs=ours["pairs"], check_rel_err=ours["check_rel_err"])
            ok = rc == 0 and row["check_ok"]
            failures += not ok
            msg = f"{i + 1}/{len(points)} {mode} world {w}: ours {'ok' if ok else f'FAILED (rc {rc})'} in {secs:.0f} s"
            if with_torch:
                trc, tr, tsecs = torch_point(a, w, tokens, env, logf)
                row["torch_rc"] = trc
                if tr:
                    row.update(torch_fwd_ms=tr["ms"], torch_fwd_tflops_per_gpu=tr["tflops_per_gpu"],
                               torch_fwdbwd_ms=tr.get("fwdbwd_ms"),
                               torch_fwdbwd_tflops_per_gpu=tr.get("fwdbwd_tflops_per_gpu"))
                if trc != 0 or not tr:
                    failures += 1
                msg += f", torch {'ok' if trc == 0 and tr else f'FAILED (rc {trc})'} in {tsecs:.0f} s"
            done = time.time() - t_start
            eta = done / (i + 1) * (len(points) - i - 1)
            log(f"{msg}; elapsed {done:.0f} s, ETA {eta:.0f} s")
            rows.append(row)
            logf.flush()
    text = table(rows, meta)
    print(text, end="")
    paths = {x: os.path.join(a.out_dir, f"scaling.{x}") for x in ("txt", "json", "png")}
    open(paths["txt"], "w").write(text)
    json.dump(dict(meta, rows=rows), open(paths["json"], "w"), indent=1)
    plotted = plot(rows, meta, paths["png"])
    log(f"wrote {paths['txt']}, {paths['json']}" + (f", {paths['png']}" if plotted else " (no plot)") +
        f"; log {os.path.join(a.out_dir, 'scaling.log')}")
    if failures:
        log(f"{failures} point(s) failed (see the log)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
