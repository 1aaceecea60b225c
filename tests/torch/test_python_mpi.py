"""The Python package over MPI: `mpirun -np N python3 tests/torch/test_python_mpi.py`, one rank per
process, CPU tensors; each rank checks its gradients against the fp64 reference of
test_python_mock.py (same case generator, same tolerance). The communicator comes from
epmoe.mpi_world(), and from a torch.distributed gloo group (epmoe.from_process_group)."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epmoe  # noqa: E402
from test_python_mock import close, make_case, reference  # noqa: E402


_comm = None


def comm_from_gloo():
    """A gloo process group over the mpirun ranks, then epmoe's communicator from it (once)."""
    global _comm
    if _comm is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29400 + int(os.environ["OMPI_COMM_WORLD_SIZE"])))
            dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                    world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
        _comm = epmoe.from_process_group()
    return _comm


class OverMpi(unittest.TestCase):
    def test_gradients_match_reference(self):
        self.check(epmoe.mpi_world())

    def test_communicator_from_a_gloo_group(self):
        comm = comm_from_gloo()
        self.assertEqual(comm.world_size, int(os.environ["OMPI_COMM_WORLD_SIZE"]))
        self.check(comm)

    def check(self, comm):
        world, r = comm.world_size, comm.rank
        E, k, H, Fd, T = 4 * world, 2, 128, 128, 24 + 8 * r  # uneven tokens per rank
        w1, w2, ranks = make_case(world, E, k, H, Fd, 24 + 8 * (world - 1), 77)
        ranks = [(x[:24 + 8 * p], ids[:24 + 8 * p], w[:24 + 8 * p], dy[:24 + 8 * p])
                 for p, (x, ids, w, dy) in enumerate(ranks)]
        el = E // world
        moe = epmoe.MoE(E, k, H, Fd, comm)
        with torch.no_grad():
            moe.w1.copy_(w1[r * el:(r + 1) * el])
            moe.w2.copy_(w2[r * el:(r + 1) * el])
        x, ids, wts, dy = ranks[r]
        self.assertEqual(x.shape[0], T)
        x = x.clone().requires_grad_()
        wts = wts.clone().requires_grad_()
        moe(x, ids, wts).backward(dy)
        ref_ranks, dw1, dw2 = reference(w1, w2, ranks)
        tag = f"rank {r} of {world}"
        close(self, f"{tag} x.grad", x.grad, ref_ranks[r][0])
        close(self, f"{tag} topk_weights.grad", wts.grad, ref_ranks[r][1])
        close(self, f"{tag} w1.grad", moe.w1.grad, dw1[r * el:(r + 1) * el])
        close(self, f"{tag} w2.grad", moe.w2.grad, dw2[r * el:(r + 1) * el])


if __name__ == "__main__":
    unittest.main()
