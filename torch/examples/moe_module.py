# README "From PyTorch" (Python): two mock ranks on threads, one training step of the layer.
import threading
import torch
import epmoe

epmoe.load_library()          # EPMOE_TORCH_LIB, or libepmoe_torch.so next to the package
comms = epmoe.mock_world(2)   # under mpirun: comm = epmoe.mpi_world()

def rank(comm):
    torch.manual_seed(comm.rank)
    moe = epmoe.MoE(num_experts=8, top_k=2, hidden=256, ffn=256, comm=comm)
    router = torch.nn.Linear(256, 8)
    opt = torch.optim.SGD(list(moe.parameters()) + list(router.parameters()), lr=1e-2)
    x = torch.randn(64, 256).bfloat16()
    weights, ids = torch.topk(torch.softmax(router(x.float()), -1), k=2)
    loss = moe(x, ids, weights).float().pow(2).mean()
    loss.backward()           # grads reach w1, w2 and, through topk_weights, the router
    opt.step()
    print(f"rank {comm.rank}: loss {loss.item():.4f}, router grad {router.weight.grad.norm():.3g}")

threads = [threading.Thread(target=rank, args=(c,)) for c in comms]
for t in threads: t.start()
for t in threads: t.join()
