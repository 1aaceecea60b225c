"""The Python package's FP8 inference layer (epmoe.MoEFp8, epmoe.quantize_*) on mock ranks (threads), CPU
tensors, against formats written here from their specs in pure torch (fp64), not through epmoe:

- quantize_mxfp8: every value and scale byte is what OCP MX v1.0 gives (scale 2^(floor(log2 amax) - 8),
  E4M3 round-to-nearest-even saturating at 448): exact.
- quantize_fp8_block128: scale = amax / 448 in fp32 per 128 x 128 block (exact), each element within
  half an E4M3 step of w / scale (2^-4 relative, 2^-10 of the scale below E4M3's normal range).
- MoEFp8 (both formats, world 1 / 2 / 4, drops, T = 0 on a rank): y against an fp64 per-expert loop on
  the dequantized weights, x taken through the format per row and the activation per row before DOWN.
  Tolerance: y is rounded to bf16 (2^-9) after fp32 sums, and an activation element whose fp32 and
  fp64 values straddle an E4M3 rounding boundary moves by one step (1/16 of itself) in one of ffn
  terms: |got - ref| <= max|ref| / 64 per element and relative L2 <= 5e-3 (kCpuTolerance's 1/64 and
  4e-3 of the C++ suites, measured 1.7e-3 here); a wrong row, expert, scale or block is O(1). Against
  the bf16 layer the format's own error (x, W1, act, W2 each at 3 mantissa bits: ~7% measured in
  tests/test_mxfp8.cpp) stays under 12%.
- x given in MXFP8 gives the bf16 x's y bit for bit; a call autograd would record raises.

    EPMOE_TORCH_LIB=build/torch/libepmoe_torch.so PYTHONPATH=python python3 tests/torch/test_python_fp8_mock.py
"""
import os
import sys
import unittest

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epmoe  # noqa: E402
from test_python_mock import on_ranks  # noqa: E402


def decode_e4m3(q):
    """uint8 E4M3FN bytes -> fp64 (0x7F / 0xFF: NaN)."""
    b = q.to(torch.int64)
    sign = 1.0 - 2.0 * (b >> 7).double()
    e, m = (b >> 3) & 0xF, (b & 7).double()
    mag = torch.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    return torch.where((e == 15) & (b & 7 == 7), torch.full_like(mag, float("nan")), sign * mag)


def round_e4m3(p):
    """fp64 values -> the nearest E4M3FN values (ties to even), saturating at +-448."""
    a = p.abs()
    _, ex = torch.frexp(a.clamp_min(2.0 ** -6))
    step = torch.pow(2.0, (ex - 1 - 3).double())  # 3 mantissa bits; subnormals share 2^-6's step
    return (torch.round(p / step) * step).clamp(-448.0, 448.0)


def mx_reference(v):
    """OCP MX along the last dimension: (dequantized values, E8M0 bytes), fp64."""
    blocks = v.double().reshape(*v.shape[:-1], v.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1)
    _, ex = torch.frexp(amax)
    e = torch.where(amax > 0, ex - 1 - 8, torch.full_like(ex, -127)).clamp(-127, 127)
    scale = torch.pow(2.0, e.double()).unsqueeze(-1)
    return (round_e4m3(blocks / scale) * scale).reshape(v.shape), (e + 127).to(torch.uint8)


def b128_rows(v):
    """1 x 128 blocks along the last dimension (scale amax / 448 in fp32): dequantized, fp64."""
    blocks = v.float().reshape(*v.shape[:-1], v.shape[-1] // 128, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (round_e4m3((blocks / scale).double()) * scale.double()).reshape(v.shape)


def dequant_weights(q, s):
    """An MoEFp8's buffers -> fp64 weights (MXFP8 per 32 along K, or block-128 per 128 x 128)."""
    v = decode_e4m3(q)
    if s.dtype == torch.float32:
        return v * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)
    return v * torch.pow(2.0, s.double() - 127).repeat_interleave(32, -1)


def make_case(world, E, k, H, Fd, T, seed, drop=False):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * Fd, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, Fd, generator=g) * Fd ** -0.5).bfloat16()
    ranks = []
    for r in range(world):
        t = 0 if (world > 1 and r == world - 1 and drop) else T  # the last rank of a drop case has no tokens
        x = torch.randn(t, H, generator=g).bfloat16()
        wts, ids = torch.topk(torch.softmax(torch.randn(t, E, generator=g), -1), k, dim=-1)
        wts = wts / wts.sum(-1, keepdim=True)
        if drop:
            ids = ids.clone()
            ids.view(-1)[::5] = -1
            wts = wts.masked_fill(ids < 0, 0.0)
        ranks.append((x, ids, wts.float()))
    return w1, w2, ranks


def reference(fmt, w1, w2, x, ids, wts):
    """fp64 per-expert loop: x and act through the format per row, weights already dequantized."""
    through = (lambda v: mx_reference(v)[0]) if fmt == "mxfp8" else b128_rows
    xq = through(x.double())
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in range(w1.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        gate, up = (xq[t] @ w1[e].t()).chunk(2, dim=-1)
        o = through(F.silu(gate) * up) @ w2[e].t()
        y.index_add_(0, t, o * wts[t, j].double().unsqueeze(1))
    return y


def bf16_reference(w1, w2, x, ids, wts):
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in range(w1.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            gate, up = (x[t].double() @ w1[e].double().t()).chunk(2, dim=-1)
            y.index_add_(0, t, ((F.silu(gate) * up) @ w2[e].double().t()) * wts[t, j].double().unsqueeze(1))
    return y


def rel_l2(got, ref):
    n = ref.norm().item()
    return (got.double() - ref).norm().item() / n if n > 0 else (got.double() - ref).norm().item()


class Quantizers(unittest.TestCase):
    def test_mxfp8_follows_the_spec(self):
        g = torch.Generator().manual_seed(7)
        # magnitudes over 2^-30 .. 2^30 per block, a zero block, a block of subnormal-range values
        w = torch.randn(3, 16, 256, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (3, 16, 8, 1), generator=g)
                                                             .float()).repeat_interleave(32, -1).reshape(3, 16, 256)
        w[0, 0, :32] = 0
        w[0, 1, 32:64] = torch.randn(32, generator=g) * 1e-3
        w = w.bfloat16()
        q, s = epmoe.quantize_mxfp8(w)
        self.assertEqual((q.dtype, s.dtype, tuple(q.shape), tuple(s.shape)),
                         (torch.uint8, torch.uint8, (3, 16, 256), (3, 16, 8)))
        want, want_s = mx_reference(w)
        self.assertTrue(torch.equal(s, want_s), "E8M0 scale bytes")
        got = decode_e4m3(q) * torch.pow(2.0, s.double() - 127).repeat_interleave(32, -1)
        self.assertTrue(torch.equal(got, want), f"{int((got != want).sum())} values differ from the spec's")

    def test_block128_within_half_a_step(self):
        g = torch.Generator().manual_seed(8)
        w = (torch.randn(2, 256, 384, generator=g) * 3).bfloat16()
        w[1, :128, :128] = 0
        q, s = epmoe.quantize_fp8_block128(w)
        self.assertEqual((q.dtype, s.dtype, tuple(s.shape)), (torch.uint8, torch.float32, (2, 2, 3)))
        blocks = w.float().reshape(2, 2, 128, 3, 128).transpose(2, 3)
        amax = blocks.abs().amax((-1, -2))
        self.assertTrue(torch.equal(s, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))), "block scales")
        p = (w.double() / s.double().repeat_interleave(128, -2).repeat_interleave(128, -1))
        err = (decode_e4m3(q) - p).abs()
        self.assertTrue((err <= p.abs() * 2.0 ** -4 + 2.0 ** -10).all(), f"worst {err.max().item():.3g}")

    def test_bad_dims_raise(self):
        with self.assertRaisesRegex(RuntimeError, "multiple of 32"):
            epmoe.quantize_mxfp8(torch.zeros(4, 48))
        with self.assertRaisesRegex(RuntimeError, "multiples of 128"):
            epmoe.quantize_fp8_block128(torch.zeros(2, 64, 128))


class Fp8MockRanks(unittest.TestCase):
    def run_world(self, fmt, world, E, k, H, Fd, T, seed, drop=False):
        w1, w2, ranks = make_case(world, E, k, H, Fd, T, seed, drop)
        comms = epmoe.mock_world(world, 30.0)
        el = E // world

        def rank_main(r):
            moe = epmoe.MoE(E, k, H, Fd, comms[r])
            with torch.no_grad():
                moe.w1.copy_(w1[r * el:(r + 1) * el])
                moe.w2.copy_(w2[r * el:(r + 1) * el])
            fp8 = epmoe.MoEFp8.from_module(moe, fmt)
            x, ids, wts = ranks[r]
            with torch.no_grad():
                y = fp8(x, ids, wts)
                y_given = None
                if fmt == "mxfp8":
                    xq, xs = epmoe.quantize_mxfp8(x)
                    y_given = fp8(xq, ids, wts, x_scale=xs)
            return y, y_given, fp8

        results = on_ranks(world, rank_main)
        d1 = torch.cat([dequant_weights(f.w1, f.w1_scale) for _, _, f in results])
        d2 = torch.cat([dequant_weights(f.w2, f.w2_scale) for _, _, f in results])
        self.assertEqual(results[0][2].format, fmt)
        for r, (y, y_given, _) in enumerate(results):
            tag = f"{fmt} world {world} rank {r}"
            x, ids, wts = ranks[r]
            self.assertEqual((y.dtype, tuple(y.shape)), (torch.bfloat16, tuple(x.shape)), tag)
            ref = reference(fmt, d1, d2, x, ids, wts)
            self.assertTrue(torch.isfinite(y).all(), tag)
            if ref.numel():
                err = (y.double() - ref).abs()
                self.assertLessEqual(err.max().item(), ref.abs().max().item() / 64, f"{tag}: worst element")
                self.assertLessEqual(rel_l2(y, ref), 5e-3, tag)
                self.assertLess(rel_l2(y, bf16_reference(w1, w2, x, ids, wts)), 0.12, f"{tag}: against bf16")
            if y_given is not None:
                self.assertTrue(torch.equal(y_given.view(torch.int16), y.view(torch.int16)), f"{tag}: x given in MXFP8")

    def test_mxfp8_world1(self):
        self.run_world("mxfp8", 1, 8, 2, 128, 128, 40, 21)

    def test_mxfp8_world2(self):
        self.run_world("mxfp8", 2, 8, 2, 256, 96, 33, 22)

    def test_mxfp8_world4_drops(self):
        self.run_world("mxfp8", 4, 16, 4, 128, 64, 24, 23, drop=True)

    def test_block128_world1(self):
        self.run_world("block128", 1, 8, 2, 128, 128, 40, 24)

    def test_block128_world2_drops(self):
        self.run_world("block128", 2, 8, 2, 256, 128, 30, 25, drop=True)

    def test_float8_dtypes(self):
        """torch's float8 dtypes pass as themselves where this torch has them (E4M3: 2.1, E8M0: 2.7)."""
        if not hasattr(torch, "float8_e4m3fn"):
            self.skipTest(f"torch {torch.__version__} has no float8 dtypes (uint8 bytes are the only form)")
        moe = epmoe.MoE(8, 2, 128, 128, epmoe.mock_world(1)[0])
        plain = epmoe.MoEFp8.from_module(moe, "mxfp8")
        e8m0 = getattr(torch, "float8_e8m0fnu", None)
        scale = (lambda s: s.view(e8m0)) if e8m0 is not None else (lambda s: s)
        typed = epmoe.MoEFp8(8, 2, 128, 128, moe.comm, plain.w1.view(torch.float8_e4m3fn), scale(plain.w1_scale),
                             plain.w2.view(torch.float8_e4m3fn), scale(plain.w2_scale))
        x, ids = torch.randn(12, 128).bfloat16(), torch.randint(0, 8, (12, 1))
        ids = torch.cat([ids, (ids + 3) % 8], 1)
        wts = torch.rand(12, 2)
        xq, xs = epmoe.quantize_mxfp8(x)
        with torch.no_grad():
            want = plain(x, ids, wts)
            self.assertTrue(torch.equal(typed(x, ids, wts).view(torch.int16), want.view(torch.int16)))
            got = typed(xq.view(torch.float8_e4m3fn), ids, wts, x_scale=scale(xs))
            self.assertTrue(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            with self.assertRaisesRegex(RuntimeError, "float8_e4m3fn"):  # a bf16 tensor where E4M3 belongs
                torch.ops.epmoe.moe_fp8(typed._layer, x, ids, wts, moe.w1.detach(), typed.w1_scale, typed.w2,
                                        typed.w2_scale)

    def test_refusals(self):
        moe = epmoe.MoE(4, 2, 128, 128, epmoe.mock_world(1)[0])
        fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")
        x, ids, wts = torch.randn(6, 128).bfloat16(), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]), \
            torch.full((6, 2), 0.5)
        with self.assertRaisesRegex(RuntimeError, "forward-only"):
            fp8(x.clone().requires_grad_(), ids, wts)
        with torch.no_grad():
            self.assertTrue(torch.isfinite(fp8(x.clone().requires_grad_(), ids, wts)).all())
        with self.assertRaises(ValueError):
            epmoe.MoEFp8.from_module(moe, "nvfp4")
        b128 = epmoe.MoEFp8.from_module(moe, "block128")
        xq, xs = epmoe.quantize_mxfp8(x)
        with torch.no_grad(), self.assertRaisesRegex(RuntimeError, "needs an MXFP8 layer"):
            b128(xq, ids, wts, x_scale=xs)

    def test_capturable_given_x_refusals(self):
        """moe_capturable_mxfp8_x (x given in MXFP8, decode under a CUDA graph) with a clear error on what
        it cannot run: casts it will not make, a CPU layer, a call autograd would record; and its Meta
        kernel's shape (bf16 y from E4M3 x). (The graph replays themselves: test_python_cuda.)"""
        moe = epmoe.MoE(4, 2, 128, 128, epmoe.mock_world(1)[0])
        fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")
        xq, xs = epmoe.quantize_mxfp8(torch.randn(4, 128).bfloat16())
        ids, wts, T = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2), torch.tensor([4])
        with torch.no_grad():
            with self.assertRaisesRegex(RuntimeError, "int32"):
                fp8.forward_capturable(xq, ids.long(), wts, T, x_scale=xs)
            with self.assertRaisesRegex(RuntimeError, "needs the GPU engine"):
                fp8.forward_capturable(xq, ids, wts, T, x_scale=xs)
        with self.assertRaisesRegex(RuntimeError, "forward-only"):
            fp8.forward_capturable(xq, ids, wts.clone().requires_grad_(), T, x_scale=xs)
        meta = [t.to("meta") for t in (xq, xs, ids, wts, T)]
        y = torch.ops.epmoe.moe_capturable_mxfp8_x(fp8._layer, *meta, [t.to("meta") for t in fp8._weights()])
        self.assertEqual((y.device.type, y.dtype, tuple(y.shape)), ("meta", torch.bfloat16, (4, 128)))


if __name__ == "__main__":
    unittest.main()
