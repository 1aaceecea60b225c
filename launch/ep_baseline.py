# Expert-parallel MoE forward the way a PyTorch user builds it today (Megatron-style
# all-to-all dispatcher: tokens x top-k rows, host-synced splits, grouped_mm experts).
#
# Our copy of ../shared/baselines/ep_baseline.py with the shapes, the world size and a JSON file
# taken from the command line. The method is the original's except the warm-up: ep_forward below is the
# same code; per shape, weights and inputs drawn the same way (seed 1 + rank), 3 warm-up forwards
# (and, unlike the original, enough more to last --warmup-ms, 500 by default: the board is power-capped),
# then 10 timed forwards between CUDA events, median; the phases are the original's three
# (dispatch = routing sort + count exchange + both all_to_alls; experts = receive-side sort,
# gather and grouped_mm; combine = all_to_all back + weighted index_add). Rank 0 prints one JSON
# line per shape and writes them all to --json.
#
#   python3 launch/ep_baseline.py --world 2 --shapes default|decode|all|original [--shape E,k,D,H,T]...
#                                 [--json out.json] [--iters 10] [--warmup 3] [--warmup-ms 500] [--backward]
#
# --backward adds the training step of the same layer (fwdbwd_ms): autograd through the all_to_alls
# (torch.distributed.nn's all_to_all_single) and grouped_mm, into x, the routing weights and w1 / w2.
import argparse, math, os, sys, json, socket, statistics, time, torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.nn.functional as F
import torch.distributed.nn.functional as dnn
gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off in every process (the children inherit it)

# (E, k, hidden D, ffn H, tokens per rank T); the same sets as epmoe_bench_ep --shapes.
SHAPES = {
    "default": [(32, 4, 2048, 1024, 4096), (32, 4, 2048, 1024, 16384)],
    "decode": [(256, 8, 7168, 2048, 128), (32, 4, 2048, 1024, 128)],
    "all": [(32, 4, 2048, 1024, 4096), (32, 4, 2048, 1024, 16384), (32, 4, 2048, 1024, 128),
            (128, 8, 2048, 768, 8192), (256, 8, 7168, 2048, 128), (256, 8, 7168, 2048, 4096)],
    # the original script's default list (REFERENCE.md's table)
    "original": [(32, 4, 2048, 1024, 4096), (32, 4, 2048, 1024, 16384), (128, 8, 2048, 768, 8192),
                 (256, 8, 7168, 2048, 4096)],
}


def a2a(out, inp, out_splits, in_splits, grad):
    """all_to_all_single; with grad, torch.distributed.nn's autograd version (its backward is the
    reverse all_to_all), which returns the output instead of filling it."""
    if grad:
        return dnn.all_to_all_single(out, inp, out_splits, in_splits)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    return out


def ep_forward(x, ids, wts, w1t, w2t, E, R, rank, tm=None, grad=False):
    T, D = x.shape; k = ids.shape[1]; El = E // R
    flat = ids.flatten(); order = torch.argsort(flat, stable=True)
    send_x = x.index_select(0, order // k)
    dest_counts = torch.bincount(flat // El, minlength=R)
    recv_counts = torch.empty_like(dest_counts); dist.all_to_all_single(recv_counts, dest_counts)
    sc, rc = dest_counts.tolist(), recv_counts.tolist()            # host sync
    recv_x = a2a(x.new_empty(sum(rc), D), send_x, rc, sc, grad)
    send_e = (flat[order] % El).to(torch.int32); recv_e = send_e.new_empty(sum(rc)); dist.all_to_all_single(recv_e, send_e, rc, sc)
    if tm is not None: tm.append(torch.cuda.Event(enable_timing=True)); tm[-1].record()
    o2 = torch.argsort(recv_e, stable=True)
    offs = torch.cumsum(torch.bincount(recv_e, minlength=El), 0).to(torch.int32)
    xs = recv_x.index_select(0, o2)
    gu = gmm(xs, w1t, offs=offs); g, u = gu.chunk(2, -1)
    eo = gmm(F.silu(g) * u, w2t, offs=offs)
    back = torch.empty_like(eo); back[o2] = eo
    if tm is not None: tm.append(torch.cuda.Event(enable_timing=True)); tm[-1].record()
    ret = a2a(x.new_empty(len(order), D), back, sc, rc, grad)
    y = torch.zeros_like(x); y.index_add_(0, order // k, ret * wts.flatten()[order].unsqueeze(1))
    return y


def run(rank, R, cfgs, port, json_path, iters, warmup, warmup_ms, backward=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=R, device_id=torch.device("cuda", rank))
    torch.manual_seed(1 + rank)
    results = []
    for (E, k, D, H, T) in cfgs:
        El = E // R
        w1t = (torch.randn(El, 2 * H, D, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)
        w2t = (torch.randn(El, D, H, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(1, 2)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        wts, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda"), -1), k, -1)
        wts = (wts / wts.sum(-1, keepdim=True)).to(torch.bfloat16)
        for _ in range(warmup): ep_forward(x, ids, wts, w1t, w2t, E, R, rank)
        # then enough forwards to last warmup_ms (power cap, as epmoe_bench_ep): the count from one
        # timed forward, the largest over the ranks (the forwards are collective)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        ep_forward(x, ids, wts, w1t, w2t, E, R, rank); torch.cuda.synchronize()
        n = torch.tensor([math.ceil(warmup_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))], device="cuda")
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        for _ in range(int(n.item())): ep_forward(x, ids, wts, w1t, w2t, E, R, rank)
        torch.cuda.synchronize(); dist.barrier()
        ts, ph = [], []
        for _ in range(iters):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True); tm = []
            a.record(); ep_forward(x, ids, wts, w1t, w2t, E, R, rank, tm); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b)); ph.append((a.elapsed_time(tm[0]), tm[0].elapsed_time(tm[1]), tm[1].elapsed_time(b)))
        t = statistics.median(ts)
        med = [statistics.median(p[i] for p in ph) for i in range(3)]
        fb = fwdbwd_ms(x, ids, wts, w1t, w2t, E, R, rank, iters, warmup, warmup_ms) if backward else None
        if rank == 0:
            rec = dict(world=R, E=E, k=k, D=D, H=H, T_per_rank=T, ms=t, dispatch_ms=med[0], experts_ms=med[1], combine_ms=med[2],
                       tflops_per_gpu=6 * T * k * D * H / t / 1e9)
            if fb is not None:
                rec.update(fwdbwd_ms=fb, fwdbwd_tflops_per_gpu=18 * T * k * D * H / fb / 1e9)
            print(json.dumps(rec), flush=True)
            results.append(dict(rec, hidden=D, ffn=H, tokens_per_rank=T))
            if json_path:  # rewritten after each shape, so a timeout keeps what finished
                write_json(json_path, R, iters, warmup, results)
    dist.destroy_process_group()


def fwdbwd_ms(x, ids, wts, w1t, w2t, E, R, rank, iters, warmup, warmup_ms):
    """--backward: the same layer as a training step, autograd through the all_to_alls (forward, then
    backward of a fixed random dy into x, the routing weights and both weight tensors; grads set to
    None before each step, as an optimizer's zero_grad does). Warm-up and timing as the forward's;
    the slowest rank's median is returned by rank 0 (max all-reduce), the others get theirs."""
    w1 = w1t.detach().clone().requires_grad_(); w2 = w2t.detach().clone().requires_grad_()
    xg = x.detach().clone().requires_grad_(); wg = wts.detach().clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():
        for p in (w1, w2, xg, wg): p.grad = None
        ep_forward(xg, ids, wg, w1, w2, E, R, rank, grad=True).backward(dy)

    for _ in range(warmup): step()
    torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
    n = torch.tensor([math.ceil(warmup_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))], device="cuda")
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    for _ in range(int(n.item())): step()
    torch.cuda.synchronize(); dist.barrier()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    m = torch.tensor([statistics.median(ts)], device="cuda", dtype=torch.float64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return float(m.item())


def write_json(path, R, iters, warmup, results):
    doc = dict(program="ep_baseline", world=R, torch=torch.__version__, device=torch.cuda.get_device_name(0),
               iters=iters, warmup=warmup, results=results)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_shape(text):
    v = tuple(int(p) for p in text.split(","))
    if len(v) != 5: raise argparse.ArgumentTypeError("--shape wants E,k,hidden,ffn,T")
    return v


def main():
    ap = argparse.ArgumentParser(description="Megatron-style EP MoE forward baseline (torch all_to_all_single + grouped_mm)")
    ap.add_argument("--world", type=int, default=0, help="GPUs (processes); default: all GPUs of this host")
    ap.add_argument("--shapes", default="default", choices=sorted(SHAPES))
    ap.add_argument("--shape", type=parse_shape, action="append", default=[], help="E,k,hidden,ffn,T (repeatable)")
    ap.add_argument("--json", default="", help="write the results here (rank 0)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warmup-ms", type=float, default=500.0, help="and warm up at least this long (ms)")
    ap.add_argument("--backward", action="store_true",
                    help="also time fwd+bwd (autograd through the all_to_alls): fwdbwd_ms in each record")
    a = ap.parse_args()
    ngpu = torch.cuda.device_count()
    R = a.world or ngpu
    if R < 1 or R > ngpu:
        sys.exit(f"ep_baseline: --world {R} but this host has {ngpu} GPU(s)")
    cfgs = a.shape or SHAPES[a.shapes]
    bad = [c for c in cfgs if c[0] % R]
    if bad:
        sys.exit(f"ep_baseline: E not divisible by world {R}: {bad}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        if os.path.exists(a.json): os.remove(a.json)
    mp.spawn(run, args=(R, cfgs, free_port(), a.json, a.iters, a.warmup, a.warmup_ms, a.backward), nprocs=R)


if __name__ == "__main__":
    main()
