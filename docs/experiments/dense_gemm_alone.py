# Session 34 probe (docs/PERF.md, S34-3/S34-4): one dense cuBLAS GEMM of a layer shape at the
# steady state, to run under launch/power_probe.sh beside epmoe_bench_experts --ab-region up|down|full.
#   python3 docs/experiments/dense_gemm_alone.py E,k,hidden,ffn,T up|down|full     (from the repo root)
# up: x[T k, hidden] @ w1[2 ffn, hidden]^T; down: act[T k, ffn] @ w2[hidden, ffn]^T; full: both
# (baseline_moe.dense_equiv_ms). 3 s of warm-up replays, median of 400.
import sys; sys.path.insert(0, "launch")
import torch, baseline_moe as b
E, k, D, H, T = (int(v) for v in sys.argv[1].split(","))
which = sys.argv[2]
b.WARMUP_MS = 3000.0
M = T * k
w1 = torch.randn(2 * H, D, device="cuda", dtype=torch.bfloat16) * 0.02
w2 = torch.randn(D, H, device="cuda", dtype=torch.bfloat16) * 0.02
if which == "up":
    xs = [torch.randn(M, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    t = b.bench_graph([lambda x=x: x @ w1.t() for x in xs], 400); fl = 4 * M * D * H
elif which == "down":
    acts = [torch.randn(M, H, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    t = b.bench_graph([lambda a=a: a @ w2.t() for a in acts], 400); fl = 2 * M * D * H
else:
    t = b.dense_equiv_ms(M, D, H, w1, w2, 400); fl = 6 * M * D * H
print(f"dense {which} {sys.argv[1]}: {t:.4f} ms {fl / t / 1e9:.1f} TF/s", flush=True)
