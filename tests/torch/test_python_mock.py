"""The Python package (python/epmoe) on mock ranks (threads), CPU tensors: epmoe.MoE's forward and
autograd gradients (x, topk_weights, w1, w2) against a pure-torch fp64 reference with autograd through a
per-expert loop over the whole layer (every rank's tokens and experts).

Tolerance (as tests/backward_case.h states for the C++ suites): the layer rounds [g, u] and the
activation to bf16, y / dx rows and dW to bf16 (2^-9 relative each) and sums in fp32; each gradient
element carries a few such errors of its terms' magnitudes, and terms can cancel, so elements are judged
against the tensor's largest reference value: |got - ref| <= 2^-5 max|ref|, and the relative L2 error
<= 1.5e-2. A wrong row, slot, expert or weight is an O(1) error in both. (No torch.autograd.gradcheck:
the layer has no fp64 path; the reference is fp64 and autograd-derived.)

    EPMOE_TORCH_LIB=build/torch/libepmoe_torch.so PYTHONPATH=python python3 tests/torch/test_python_mock.py
"""
import threading
import unittest

import torch
import torch.nn.functional as F

import epmoe


def make_case(world, E, k, H, Fd, T, seed, drop=False):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * Fd, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, Fd, generator=g) * Fd ** -0.5).bfloat16()
    ranks = []
    for _ in range(world):
        x = torch.randn(T, H, generator=g).bfloat16()
        logits = torch.randn(T, E, generator=g)
        wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        wts = wts / wts.sum(-1, keepdim=True)
        if drop:  # every 5th slot dropped
            ids = ids.clone()
            ids.view(-1)[::5] = -1
            wts = wts.masked_fill(ids < 0, 0.0)
        dy = torch.randn(T, H, generator=g).bfloat16()
        ranks.append((x, ids, wts.float(), dy))
    return w1, w2, ranks


def reference(w1, w2, ranks):
    """fp64 autograd through a per-expert loop: per rank (dx, dwts, y), and the global (dW1, dW2)."""
    W1 = w1.double().requires_grad_()
    W2 = w2.double().requires_grad_()
    out = []
    for x, ids, wts, dy in ranks:
        xd = x.double().requires_grad_()
        wd = wts.double().requires_grad_()
        y = torch.zeros_like(xd)
        for e in range(W1.shape[0]):
            t, j = (ids == e).nonzero(as_tuple=True)
            if t.numel() == 0:
                continue
            h = xd[t] @ W1[e].t()
            gate, up = h.chunk(2, dim=-1)
            o = (F.silu(gate) * up) @ W2[e].t()
            y = y.index_add(0, t, o * wd[t, j].unsqueeze(1))
        y.backward(dy.double())
        out.append((xd.grad, wd.grad, y.detach()))
    return out, W1.grad, W2.grad


def on_ranks(world, fn):
    """fn(rank) for every mock rank, each on its own thread: the results in rank order, or an
    AssertionError naming the first rank that raised."""
    results, errors = [None] * world, [None] * world

    def main(r):
        try:
            results[r] = fn(r)
        except Exception as e:  # reported below, per rank
            errors[r] = e

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r}: {e}")
    return results


def close(test, what, got, ref):
    got, ref = got.double(), ref.double()
    scale = ref.abs().max().item()
    err = (got - ref).abs()
    bad = int((err > scale / 32 + 1e-30).sum())
    l2 = (err.norm() / ref.norm()).item() if ref.norm() > 0 else err.norm().item()
    test.assertTrue(torch.isfinite(got).all(), f"{what}: non-finite values")
    test.assertEqual(bad, 0, f"{what}: {bad} elements off (max |ref| {scale:.4g}, worst {err.max().item():.4g})")
    test.assertLessEqual(l2, 1.5e-2, f"{what}: relative L2 {l2:.3g}")


class MockRanks(unittest.TestCase):
    def run_world(self, world, E, k, H, Fd, T, seed, drop=False, policy="preact"):
        w1, w2, ranks = make_case(world, E, k, H, Fd, T, seed, drop)
        comms = epmoe.mock_world(world, 30.0)
        el = E // world

        def rank_main(r):
            moe = epmoe.MoE(E, k, H, Fd, comms[r], save_policy=policy)
            with torch.no_grad():
                moe.w1.copy_(w1[r * el:(r + 1) * el])
                moe.w2.copy_(w2[r * el:(r + 1) * el])
            x, ids, wts, dy = ranks[r]
            x = x.clone().requires_grad_()
            wts = wts.clone().requires_grad_()
            y = moe(x, ids, wts)
            y.backward(dy)
            return y.detach(), x.grad, wts.grad, moe.w1.grad, moe.w2.grad

        results = on_ranks(world, rank_main)
        ref_ranks, dw1, dw2 = reference(w1, w2, ranks)
        for r in range(world):
            _, dx, dwts, g1, g2 = results[r]
            tag = f"world {world} rank {r}"
            close(self, f"{tag} x.grad", dx, ref_ranks[r][0])
            close(self, f"{tag} topk_weights.grad", dwts, ref_ranks[r][1])
            close(self, f"{tag} w1.grad", g1, dw1[r * el:(r + 1) * el])
            close(self, f"{tag} w2.grad", g2, dw2[r * el:(r + 1) * el])
            if drop:
                self.assertTrue((dwts[ranks[r][1] < 0] == 0).all(), f"{tag}: dropped slots need d = 0")

    def test_world1(self):
        self.run_world(1, 8, 2, 128, 128, 40, 11)

    def test_world2_recompute(self):
        self.run_world(2, 8, 2, 128, 256, 32, 12, policy="recompute")

    def test_world4_drops(self):
        self.run_world(4, 16, 4, 128, 128, 24, 13, drop=True)

    def test_deterministic_option(self):  # (the CPU engine is reproducible anyway: the option reaches it)
        moe = epmoe.MoE(8, 2, 128, 128, epmoe.mock_world(1)[0], deterministic=True)
        x, ids = torch.randn(16, 128).to(torch.bfloat16), torch.randint(0, 8, (16, 2))
        ids[:, 1] = (ids[:, 0] + 1) % 8
        wts = torch.rand(16, 2)
        with torch.no_grad():
            self.assertTrue(torch.equal(moe(x, ids, wts).view(torch.int16), moe(x, ids, wts).view(torch.int16)))

    def test_bad_policy(self):
        with self.assertRaises(ValueError):
            epmoe.MoE(8, 2, 128, 128, epmoe.mock_world(1)[0], save_policy="keep-everything")

    def test_capturable_forward_refusals(self):
        """moe_capturable (decode under a CUDA graph) on what it cannot run, each with a clear error: a
        CPU layer asked for a capacity, the op on a CPU layer, casts it will not make, a call autograd
        would record; and its Meta kernel's shape. (The graph replays themselves: test_python_cuda.)"""
        comm = epmoe.mock_world(1)[0]
        with self.assertRaisesRegex(RuntimeError, "needs cuda weights"):
            epmoe.MoE(8, 2, 128, 128, comm, max_tokens=16).forward_capturable(
                torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(16, 2, dtype=torch.int32), torch.zeros(16, 2),
                torch.zeros(1, dtype=torch.long))
        moe = epmoe.MoE(8, 2, 128, 128, comm)
        x, ids, wts = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)
        T = torch.tensor([4])
        with torch.no_grad():
            with self.assertRaisesRegex(RuntimeError, "needs the GPU engine"):
                moe.forward_capturable(x, ids, wts, T)
            with self.assertRaisesRegex(RuntimeError, "int32"):
                moe.forward_capturable(x, ids.long(), wts, T)
            with self.assertRaisesRegex(RuntimeError, "one-element int64"):
                moe.forward_capturable(x, ids, wts, T.int())
        with self.assertRaisesRegex(RuntimeError, "forward-only"):
            moe.forward_capturable(x.clone().requires_grad_(), ids, wts, T)
        y = torch.ops.epmoe.moe_capturable(moe._layer, x.to("meta"), ids.to("meta"), wts.to("meta"), T.to("meta"),
                                           [moe.w1.detach().to("meta"), moe.w2.detach().to("meta")])
        self.assertEqual((y.device.type, y.dtype, tuple(y.shape)), ("meta", torch.bfloat16, (4, 128)))
        moe.check_capturable()  # (nothing to report on a CPU layer)


if __name__ == "__main__":
    unittest.main()
