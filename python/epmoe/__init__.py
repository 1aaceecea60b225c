"""epmoe from PyTorch: the expert-parallel MoE layer as an nn.Module over the torch.ops.epmoe ops.

    import epmoe
    epmoe.load_library()                      # libepmoe_torch.so: the ops register on load
    comm = epmoe.mpi_world()                  # or epmoe.mock_world(n)[rank] (threads), see below
    moe = epmoe.MoE(num_experts=32, top_k=4, hidden=2048, ffn=1024, comm=comm)
    y = moe(x, topk_ids, topk_weights)        # x bf16 [T, hidden]; ids / weights from the router
    y.backward(dy)                            # -> x.grad, topk_weights.grad, moe.w1.grad, moe.w2.grad

Every call is collective over the communicator's ranks (each rank calls it with its own tokens).
"""
import glob
import math
import os

import torch

__all__ = ["load_library", "Communicator", "mock_world", "mpi_world", "from_process_group", "MoE"]

_loaded = None


def load_library(path=None):
    """Loads libepmoe_torch.so (once): `path`, else $EPMOE_TORCH_LIB, else next to this package."""
    global _loaded
    if _loaded is not None:
        return _loaded
    candidates = [path, os.environ.get("EPMOE_TORCH_LIB")]
    here = os.path.dirname(os.path.abspath(__file__))
    candidates += sorted(glob.glob(os.path.join(here, "libepmoe_torch*.so")))
    for p in candidates:
        if p and os.path.exists(p):
            torch.ops.load_library(p)
            _loaded = p
            return p
    raise FileNotFoundError("libepmoe_torch.so not found: pass its path to epmoe.load_library(), or set "
                            "EPMOE_TORCH_LIB (a build has it in build/torch/)")


class Communicator:
    """A communicator handle of the ops (released with the object)."""

    def __init__(self, handle):
        self.handle = int(handle)
        self.rank, self.world_size = (int(v) for v in torch.ops.epmoe.comm_info(self.handle))

    def __del__(self):
        try:
            torch.ops.epmoe.release_comm(self.handle)
        except Exception:  # interpreter shutdown
            pass


def mock_world(world, deadline_seconds=60.0):
    """`world` in-process ranks (run each on its own thread): a list of Communicators, rank order."""
    load_library()
    return [Communicator(h) for h in torch.ops.epmoe.mock_world(world, float(deadline_seconds))]


def mpi_world():
    """MPI_COMM_WORLD (under mpirun; MPI is initialised if it is not yet)."""
    load_library()
    return Communicator(torch.ops.epmoe.mpi_world())


def from_process_group(group=None, device=None, deadline_seconds=300.0):
    """A communicator over the ranks of a torch.distributed group (collective over it).

    NCCL groups: a new NCCL communicator of our own (our deadlines and abort), bootstrapped by
    broadcasting a unique id through the group; `device` defaults to torch.cuda.current_device().
    CPU groups (gloo, mpi): MPI_COMM_WORLD when the process runs under mpirun with the group spanning
    the whole world in rank order; otherwise use mock_world() (threads) or mpi_world() directly."""
    import torch.distributed as dist
    load_library()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        dev = torch.cuda.current_device() if device is None else int(device)
        uid = torch.ops.epmoe.nccl_unique_id() if rank == 0 else torch.zeros(128, dtype=torch.uint8)
        uid = uid.to(f"cuda:{dev}")
        src = dist.get_global_rank(group, 0) if group is not None and hasattr(dist, "get_global_rank") else 0
        dist.broadcast(uid, src=src, group=group)
        return Communicator(torch.ops.epmoe.nccl_world(uid.cpu(), rank, world, dev, float(deadline_seconds)))
    mpi_size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    mpi_rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
    if mpi_size is None or int(mpi_size) != world or int(mpi_rank) != rank:
        raise RuntimeError(f"from_process_group: a {backend} group of {world} ranks maps to MPI only under mpirun "
                           f"with the group spanning the world in rank order (MPI world {mpi_size}, rank {mpi_rank}, "
                           f"group rank {rank}); use epmoe.mpi_world() or epmoe.mock_world() instead")
    return mpi_world()


class MoE(torch.nn.Module):
    """This rank's experts: w1 [E_local, 2 ffn, hidden] and w2 [E_local, hidden, ffn], bf16 Parameters
    initialised U(-1/sqrt(fan_in), +1/sqrt(fan_in)) like nn.Linear (E_local = num_experts / world).
    The layer behind the ops is made on the first forward, on the Parameters' device (collective: every
    rank's first forward), and again after they move; replaced Parameters are bound at every call.
    On CUDA its workspaces and saved activations come from torch's caching allocator (so
    torch.cuda.memory_allocated counts them); torch_allocator=False gives the layer memory of its own
    (cudaMalloc and a private pool) instead. deterministic=True makes the forward bitwise reproducible
    on CUDA (LayerOptions::deterministic: each (row, expert) pair's output stored, a row's pairs summed
    in slot order); the backward, and the CPU engine, are reproducible either way."""

    def __init__(self, num_experts, top_k, hidden, ffn, comm, save_policy="preact", torch_allocator=True,
                 deterministic=False):
        super().__init__()
        load_library()
        if not isinstance(comm, Communicator):
            raise TypeError("comm: this rank's epmoe.Communicator")
        if save_policy not in ("preact", "recompute"):
            raise ValueError(f"save_policy must be 'preact' or 'recompute', got {save_policy!r}")
        if num_experts % comm.world_size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the world size {comm.world_size}")
        self.num_experts, self.top_k, self.hidden, self.ffn = num_experts, top_k, hidden, ffn
        self.comm, self.save_policy, self.torch_allocator = comm, save_policy, bool(torch_allocator)
        self.deterministic = bool(deterministic)
        e = num_experts // comm.world_size
        b1, b2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(ffn)
        self.w1 = torch.nn.Parameter(torch.empty(e, 2 * ffn, hidden).uniform_(-b1, b1).to(torch.bfloat16))
        self.w2 = torch.nn.Parameter(torch.empty(e, hidden, ffn).uniform_(-b2, b2).to(torch.bfloat16))
        self._layer = None
        self._layer_device = None

    def _ensure_layer(self):
        if self._layer is None or self.w1.device != self._layer_device:
            if self._layer is not None:
                torch.ops.epmoe.release_layer(self._layer)
                self._layer = None
            self._layer = torch.ops.epmoe.create_layer(self.comm.handle, self.num_experts, self.top_k, self.hidden,
                                                       self.ffn, self.w1.detach(), self.w2.detach(),
                                                       self.save_policy, self.torch_allocator, self.deterministic)
            self._layer_device = self.w1.device

    def forward(self, x, topk_ids, topk_weights):
        self._ensure_layer()
        return torch.ops.epmoe.moe(self._layer, x, topk_ids, topk_weights, self.w1, self.w2)

    def __del__(self):
        try:
            if self._layer is not None:
                torch.ops.epmoe.release_layer(self._layer)
        except Exception:
            pass
