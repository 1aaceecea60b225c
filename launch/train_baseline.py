# Training baseline on the device: torch autograd through the seed's grouped_mm layer (fwd+bwd),
# plus an HBM read-bandwidth probe for decode floors. FLOPs: fwd 6*P*h*f, bwd 12*P*h*f (P = T*k pairs).
#
# Our copy of ../shared/baselines/train_baseline.py (that folder does not travel to the device
# machine), run by launch/gpu_check.sh's bench_train stage and read by launch/compare_train.py. The
# method, shapes and draws are the original's; the differences: the JSON goes to --json (the original
# writes $OUT/train_baseline.json), it also records the device and torch version, and the peak-memory
# counter is reset after the HBM probe, so the first row's peak_mem_GB is that shape's and not the
# probe's 4.3 GB tensor.
#
#   python3 launch/train_baseline.py [--json train_baseline.json]
import argparse
import torch, statistics, json, os
import torch.nn.functional as F
gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
ap = argparse.ArgumentParser(description="torch fwd+bwd baseline of the MoE layer")
ap.add_argument("--json", default="train_baseline.json", help="where the rows go")
args = ap.parse_args()
dev = "cuda"; torch.manual_seed(0)
def timeit(fn, iters=20, warm=5):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
res = {}
# read bandwidth: sum over a 4 GB bf16 tensor
X = torch.randn(2 * 1024**3, device=dev, dtype=torch.bfloat16)
t = timeit(lambda: X.sum(), iters=10)
res["hbm_read_TBps"] = X.numel() * 2 / t / 1e9; del X
torch.cuda.reset_peak_memory_stats()  # (not in the original) the rows' peaks are their own
res["device"] = torch.cuda.get_device_name(); res["torch"] = torch.__version__
rows = []
for (E, k, D, H, T) in [(32,4,2048,1024,16384), (32,4,2048,1024,4096), (128,8,2048,768,16384), (32,8,7168,2048,8192), (8,2,4096,14336,4096)]:
    w1 = (torch.randn(E, 2*H, D, device=dev) * D**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, D, H, device=dev) * H**-0.5).bfloat16().requires_grad_()
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(T, E, device=dev)
    wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    wts = (wts / wts.sum(-1, keepdim=True)).bfloat16().requires_grad_()
    flat = ids.flatten(); order = torch.argsort(flat, stable=True); tok = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    def fwd():
        xg = x.index_select(0, tok)
        gu = gmm(xg, w1.transpose(1, 2), offs=offs); g, u = gu.chunk(2, dim=-1)
        eo = gmm(F.silu(g) * u, w2.transpose(1, 2), offs=offs) * wts.flatten()[order].unsqueeze(1)
        return torch.zeros(T, D, device=dev, dtype=torch.bfloat16).index_add(0, tok, eo)
    def fwd_only():
        with torch.no_grad(): fwd()
    def fwd_bwd():
        y = fwd(); torch.autograd.grad(y, (x, w1, w2, wts), dy)
    tf = timeit(fwd_only); tfb = timeit(fwd_bwd)
    P = T * k; fl = 6 * P * D * H
    r = dict(E=E, k=k, hidden=D, ffn=H, T=T, fwd_ms=tf, fwd_bwd_ms=tfb, bwd_ms=tfb - tf,
             fwd_TF=fl / tf / 1e9, fwd_bwd_TF=3 * fl / tfb / 1e9, bwd_TF=2 * fl / (tfb - tf) / 1e9,
             peak_mem_GB=torch.cuda.max_memory_allocated() / 1e9)
    rows.append(r); print(json.dumps(r)); torch.cuda.reset_peak_memory_stats()
    del w1, w2, x
res["rows"] = rows
print(json.dumps({"hbm_read_TBps": res["hbm_read_TBps"]}))
json.dump(res, open(args.json, "w"), indent=1)
