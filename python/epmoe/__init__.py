"""epmoe from PyTorch: the expert-parallel MoE layer as an nn.Module over the torch.ops.epmoe ops.

    import epmoe
    epmoe.load_library()                      # libepmoe_torch.so: the ops register on load
    comm = epmoe.mpi_world()                  # or epmoe.mock_world(n)[rank] (threads), see below
    moe = epmoe.MoE(num_experts=32, top_k=4, hidden=2048, ffn=1024, comm=comm)
    y = moe(x, topk_ids, topk_weights)        # x bf16 [T, hidden]; ids / weights from the router
    y.backward(dy)                            # -> x.grad, topk_weights.grad, moe.w1.grad, moe.w2.grad
    fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")   # inference copy: MXFP8 (or "block128") experts
    with torch.no_grad():
        y8 = fp8(x, topk_ids, topk_weights)

Every call is collective over the communicator's ranks (each rank calls it with its own tokens).
"""
import glob
import math
import os

import torch

__all__ = ["load_library", "Communicator", "mock_world", "mpi_world", "from_process_group", "MoE", "MoEFp8",
           "quantize_mxfp8", "quantize_fp8_block128"]

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


class _LayerModule(torch.nn.Module):
    """The layer handle behind a module: made by _make_layer() on the first forward, on w1's device, and
    again after the module moves; released with the module."""

    def __init__(self):
        super().__init__()
        self._layer = None
        self._layer_device = None

    def _ensure_layer(self):
        if self._layer is None or self.w1.device != self._layer_device:
            if self._layer is not None:
                torch.ops.epmoe.release_layer(self._layer)
                self._layer = None
            self._layer = self._make_layer()
            self._layer_device = self.w1.device

    def __del__(self):
        try:
            if self._layer is not None:
                torch.ops.epmoe.release_layer(self._layer)
        except Exception:  # interpreter shutdown
            pass

    def _weights(self):
        raise NotImplementedError

    def forward_capturable(self, x, topk_ids, topk_weights, num_tokens):
        """The forward for decode under a CUDA graph (a module made with max_tokens > 0; forward-only, run it
        under torch.no_grad()): x bf16 [N, hidden] with N <= max_tokens, topk_ids int32 [N, k], topk_weights
        float32 [N, k], num_tokens a one-element int64 tensor on the module's GPU, read when the work runs.
        Returns y [N, hidden]: the first num_tokens rows the layer's output, the rest 0. Nothing is read
        on the host, so torch.cuda.graph captures it once and replays it at any num_tokens. The layer is
        made on the first call (collective, allocating): call once before capturing; moving the module
        afterwards remakes the layer, so graphs captured before the move must not be replayed. A bad id makes its
        token's row NaN (the rank's rows between ranks), a num_tokens outside [0, N] every row; the
        first such failure raises from check_capturable()."""
        self._ensure_capturable_layer()
        return torch.ops.epmoe.moe_capturable(self._layer, x, topk_ids, topk_weights, num_tokens, self._weights())

    def _ensure_capturable_layer(self):
        if self._layer is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("epmoe: forward_capturable's first call makes the layer (allocates, collective): "
                               "call it once before capturing")
        self._ensure_layer()

    def check_capturable(self):
        """Waits for the current stream and raises the first bad id or count that the capturable forwards
        met since the last check (their rows came back NaN)."""
        if self._layer is not None:
            torch.ops.epmoe.check_capturable(self._layer, self.w1)


class MoE(_LayerModule):
    """This rank's experts: w1 [E_local, 2 ffn, hidden] and w2 [E_local, hidden, ffn], bf16 Parameters
    initialised U(-1/sqrt(fan_in), +1/sqrt(fan_in)) like nn.Linear (E_local = num_experts / world).
    The layer behind the ops is made on the first forward, on the Parameters' device (collective: every
    rank's first forward), and again after they move; replaced Parameters are bound at every call.
    On CUDA its workspaces and saved activations come from torch's caching allocator (so
    torch.cuda.memory_allocated counts them); torch_allocator=False gives the layer memory of its own
    (cudaMalloc and a private pool) instead. deterministic=True makes the forward bitwise reproducible
    on CUDA (LayerOptions::deterministic: each (row, expert) pair's output stored, a row's pairs summed
    in slot order); the backward, and the CPU engine, are reproducible either way. max_tokens > 0 (CUDA):
    forward_capturable up to that many rows per rank, for decode under a CUDA graph."""

    def __init__(self, num_experts, top_k, hidden, ffn, comm, save_policy="preact", torch_allocator=True,
                 deterministic=False, max_tokens=0):
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
        self.deterministic, self.max_tokens = bool(deterministic), int(max_tokens)
        e = num_experts // comm.world_size
        b1, b2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(ffn)
        self.w1 = torch.nn.Parameter(torch.empty(e, 2 * ffn, hidden).uniform_(-b1, b1).to(torch.bfloat16))
        self.w2 = torch.nn.Parameter(torch.empty(e, hidden, ffn).uniform_(-b2, b2).to(torch.bfloat16))

    def _make_layer(self):
        return torch.ops.epmoe.create_layer(self.comm.handle, self.num_experts, self.top_k, self.hidden, self.ffn,
                                            self.w1.detach(), self.w2.detach(), self.save_policy,
                                            self.torch_allocator, self.deterministic, self.max_tokens)

    def _weights(self):
        return [self.w1.detach(), self.w2.detach()]

    def forward(self, x, topk_ids, topk_weights):
        self._ensure_layer()
        return torch.ops.epmoe.moe(self._layer, x, topk_ids, topk_weights, self.w1, self.w2)


def quantize_mxfp8(x):
    """MXFP8 (OCP MX: E4M3 elements, one E8M0 scale per 32 along the last dimension) of a float tensor:
    (q uint8 [..., K], scale uint8 [..., K / 32]), on x's device (quantized on the host). The bytes are
    the format: q.view(torch.float8_e4m3fn) where torch has it."""
    load_library()
    return torch.ops.epmoe.quantize_mxfp8(x)


def quantize_fp8_block128(w):
    """FP8 block-128 (DeepSeek-V3: E4M3 with one fp32 scale per 128 x 128 block) of weights [..., N, K]:
    (q uint8, scale f32 [..., N / 128, K / 128]), on w's device (quantized on the host)."""
    load_library()
    return torch.ops.epmoe.quantize_fp8_block128(w)


class MoEFp8(_LayerModule):
    """This rank's experts in FP8, for inference: buffers w1, w2 (E4M3 bytes, uint8) and w1_scale,
    w2_scale (uint8 E8M0 per 32 along K for "mxfp8"; f32 per 128 x 128 block for "block128"), in MoE's
    shapes. The layer quantizes x on the fly and requantizes the activation before DOWN, in its format.
    Forward-only: a call that autograd would record (grad mode on, x or topk_weights requiring grad)
    raises; run it under torch.no_grad(). forward(x, ids, wts, x_scale=...) takes x already in MXFP8
    (uint8 E4M3 [T, hidden] with its E8M0 scales [T, hidden / 32]; an "mxfp8" module only). The layer
    is made on the first forward on the buffers' device, and again after they move. max_tokens > 0
    (CUDA): forward_capturable up to that many rows per rank (x quantized on the device, or given in
    MXFP8 with x_scale=..., as forward's)."""

    def __init__(self, num_experts, top_k, hidden, ffn, comm, w1, w1_scale, w2, w2_scale, torch_allocator=True,
                 max_tokens=0):
        super().__init__()
        load_library()
        if not isinstance(comm, Communicator):
            raise TypeError("comm: this rank's epmoe.Communicator")
        if num_experts % comm.world_size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the world size {comm.world_size}")
        self.num_experts, self.top_k, self.hidden, self.ffn = num_experts, top_k, hidden, ffn
        self.comm, self.torch_allocator, self.max_tokens = comm, bool(torch_allocator), int(max_tokens)
        for name, t in (("w1", w1), ("w1_scale", w1_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self.register_buffer(name, t.contiguous())

    @property
    def format(self):
        return "block128" if self.w1_scale.dtype == torch.float32 else "mxfp8"

    @classmethod
    def from_module(cls, moe, format="mxfp8"):
        """An FP8 copy of a bf16 epmoe.MoE's current experts (same communicator, shapes and max_tokens)."""
        quantize = {"mxfp8": quantize_mxfp8, "block128": quantize_fp8_block128}.get(format)
        if quantize is None:
            raise ValueError(f"format must be 'mxfp8' or 'block128', got {format!r}")
        with torch.no_grad():
            q1, s1 = quantize(moe.w1.detach())
            q2, s2 = quantize(moe.w2.detach())
        return cls(moe.num_experts, moe.top_k, moe.hidden, moe.ffn, moe.comm, q1, s1, q2, s2, moe.torch_allocator,
                   moe.max_tokens)

    def _make_layer(self):
        return torch.ops.epmoe.create_layer_fp8(self.comm.handle, self.num_experts, self.top_k, self.hidden, self.ffn,
                                                self.w1, self.w1_scale, self.w2, self.w2_scale, self.torch_allocator,
                                                self.max_tokens)

    def _weights(self):
        return [self.w1, self.w1_scale, self.w2, self.w2_scale]

    def forward(self, x, topk_ids, topk_weights, x_scale=None):
        self._ensure_layer()
        if x_scale is None:
            return torch.ops.epmoe.moe_fp8(self._layer, x, topk_ids, topk_weights, self.w1, self.w1_scale, self.w2,
                                           self.w2_scale)
        return torch.ops.epmoe.moe_mxfp8_x(self._layer, x, x_scale, topk_ids, topk_weights, self.w1, self.w1_scale,
                                           self.w2, self.w2_scale)

    def forward_capturable(self, x, topk_ids, topk_weights, num_tokens, x_scale=None):
        """_LayerModule.forward_capturable; with x_scale, x is given in MXFP8 (uint8 E4M3 [N, hidden], its
        E8M0 scales [N, hidden / 32]; an "mxfp8" module only) and its first num_tokens rows are
        dispatched as they are: the same y as for the bf16 x they stand for."""
        if x_scale is None:
            return super().forward_capturable(x, topk_ids, topk_weights, num_tokens)
        self._ensure_capturable_layer()
        return torch.ops.epmoe.moe_capturable_mxfp8_x(self._layer, x, x_scale, topk_ids, topk_weights, num_tokens,
                                                      self._weights())
