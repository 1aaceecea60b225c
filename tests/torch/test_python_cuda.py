"""The Python package on one GPU (a torch with CUDA: the H200 machine's 2.11): epmoe.MoE on CUDA bf16
tensors, world 1, against test_python_mock.py's pure-torch fp64 reference (autograd through a
per-expert loop): y and the gradients of x, topk_weights, w1 and w2.

Communicators: NCCL bootstrapped directly (nccl_unique_id + nccl_world(uid, rank 0, world 1)) and from
a torch.distributed NCCL group of one rank (epmoe.from_process_group, TCP store on 127.0.0.1).
Routing: random (softmax top-k), all to one expert (the others idle: their dW exactly 0), -1 slots,
T = 1, a wider shape; both save policies. Also: dW accumulated into fp32 and bf16 main grads by
moe_backward_accumulate; the current stream honoured (the layer on a side torch.cuda.Stream whose
input is written there late); the layer's memory comes from torch's caching allocator (counted by
torch.cuda.memory_allocated, all of it back when the layer and its contexts are gone) unless
torch_allocator=False; torch.library.opcheck on the ops (torch >= 2.4); torch.compile of a function
calling the module's forward. The FP8 inference module (epmoe.MoEFp8, MXFP8 and block-128, at a
decode T and a batch; x given in MXFP8) against test_python_fp8_mock.py's exact-format fp64 reference
within tests/gpu/test_mxfp8_gpu.cpp's tolerance: 1e-2 relative L2 (the issue's accuracy bound; the
kernels measured 1.6e-3 - 4.3e-3) and 2^-5 max|ref| per element. The capturable forward (bf16 and
MXFP8 modules with max_tokens) captured by torch.cuda.graph and replayed at several token counts.

Tolerance (test_python_mock.py's, tests/backward_case.h's kGradElem / kGradL2): |got - ref| <= 2^-5
max|ref| per element and relative L2 <= 1.5e-2. The inputs are bf16 and the layer accumulates in fp32;
it rounds [g, u], the activation, each expert's weighted output, y, dx rows and dW to bf16 (2^-9
relative each), and on the GPU also da = dy.W2, dx per pair and dh (bf16 GEMM operands; see
tests/gpu/test_backward_gpu.cpp): each element carries a few 2^-9 relative errors of its terms'
magnitudes, which can cancel, hence judged against the tensor's largest reference value. A wrong row,
slot, expert, weight or stream is an O(1) error in both measures.

    EPMOE_TORCH_LIB=build/torch/libepmoe_torch.so PYTHONPATH=python python3 tests/torch/test_python_cuda.py

Exit status: 0 when every check passed (a check skipped for the torch-version guard prints SKIPPED
and does not fail the run; no other skip is accepted), 1 on any failure, 77 without a CUDA device.
"""
import os
import socket
import sys
import unittest

# Machine safety on the H200 hosts (REFERENCE.md): no NVLink multicast, before torch / NCCL start.
for _k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_k, "0" if _k == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epmoe  # noqa: E402
from test_python_mock import close, make_case, reference  # noqa: E402
import test_python_fp8_mock as fp8ref  # noqa: E402

VERSION_GUARD = "torch version guard: "


def cuda(t):
    return t.cuda() if t is not None else None


def make_module(comm, w1, w2, k, policy="preact", torch_allocator=True, deterministic=False):
    E, two_f, H = w1.shape
    moe = epmoe.MoE(E, k, H, two_f // 2, comm, save_policy=policy, torch_allocator=torch_allocator,
                    deterministic=deterministic).cuda()
    with torch.no_grad():
        moe.w1.copy_(w1)
        moe.w2.copy_(w2)
    return moe


def one_expert_case(E, k, H, Fd, T, seed, hot=3):
    """Every token's first slot is expert `hot`, the other slots -1: one expert works, the rest idle."""
    w1, w2, ranks = make_case(1, E, k, H, Fd, T, seed)
    x, _, _, dy = ranks[0]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.full((T, k), -1, dtype=torch.long)
    ids[:, 0] = hot
    wts = torch.zeros(T, k)
    wts[:, 0] = 0.25 + 0.75 * torch.rand(T, generator=g)
    return w1, w2, [(x, ids, wts, dy)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CudaWorld1(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.device = torch.cuda.current_device()
        uid = torch.ops.epmoe.nccl_unique_id()
        cls.comm = epmoe.Communicator(torch.ops.epmoe.nccl_world(uid, 0, 1, cls.device, 120.0))

    def check_against_reference(self, tag, w1, w2, ranks, got, drop_ids=None):
        """got = (y, x.grad, topk_weights.grad, w1.grad, w2.grad) on any device."""
        ref, dw1, dw2 = reference(w1, w2, ranks)
        y, dx, dwts, g1, g2 = (t.detach().cpu() for t in got)
        close(self, f"{tag} y", y, ref[0][2])
        close(self, f"{tag} x.grad", dx, ref[0][0])
        close(self, f"{tag} topk_weights.grad", dwts, ref[0][1])
        close(self, f"{tag} w1.grad", g1, dw1)
        close(self, f"{tag} w2.grad", g2, dw2)
        if drop_ids is not None:
            self.assertTrue((dwts[drop_ids < 0] == 0).all(), f"{tag}: dropped slots need d = 0")
        return ref, dw1, dw2

    def run_module(self, comm, w1, w2, ranks, k, policy="preact"):
        moe = make_module(comm, w1, w2, k, policy)
        x, ids, wts, dy = (cuda(t) for t in ranks[0])
        x = x.clone().requires_grad_()
        wts = wts.clone().requires_grad_()
        y = moe(x, ids, wts)
        self.assertEqual((y.device, y.dtype, tuple(y.shape)), (x.device, torch.bfloat16, tuple(x.shape)))
        y.backward(dy)
        torch.cuda.synchronize()
        self.assertEqual(moe.w1.grad.dtype, torch.bfloat16)
        return moe, (y, x.grad, wts.grad, moe.w1.grad, moe.w2.grad)

    def check_case(self, tag, w1, w2, ranks, k, policy="preact", comm=None):
        _, got = self.run_module(comm or self.comm, w1, w2, ranks, k, policy)
        return self.check_against_reference(tag, w1, w2, ranks, got, drop_ids=ranks[0][1])

    # ---- routing cases ----------------------------------------------------------------------
    def test_random_routing(self):
        self.check_case("random", *make_case(1, 8, 2, 256, 256, 200, 4601), k=2)

    def test_random_routing_recompute_wider(self):
        self.check_case("random 1024/512 recompute", *make_case(1, 8, 4, 1024, 512, 256, 4602), k=4,
                        policy="recompute")

    def test_all_to_one_expert(self):
        w1, w2, ranks = one_expert_case(8, 2, 256, 256, 160, 4603, hot=3)
        _, got = self.run_module(self.comm, w1, w2, ranks, 2, "recompute")
        self.check_against_reference("one expert", w1, w2, ranks, got, drop_ids=ranks[0][1])
        idle = [e for e in range(8) if e != 3]
        self.assertTrue((got[3][idle] == 0).all() and (got[4][idle] == 0).all(), "idle experts need dW = 0")

    def test_dropped_slots(self):
        self.check_case("-1 slots", *make_case(1, 8, 2, 256, 256, 150, 4604, drop=True), k=2)

    def test_one_token(self):
        self.check_case("T=1", *make_case(1, 8, 2, 128, 128, 1, 4605), k=2)

    def test_deterministic_forward_is_bitwise_reproducible(self):
        w1, w2, ranks = make_case(1, 8, 4, 256, 256, 200, 4606)
        moe = make_module(self.comm, w1, w2, 4, deterministic=True)
        x, ids, wts, _ = (cuda(t) for t in ranks[0])
        with torch.no_grad():
            ys = [moe(x, ids, wts) for _ in range(10)]
        for i, y in enumerate(ys[1:], 1):
            self.assertTrue(torch.equal(y.view(torch.int16), ys[0].view(torch.int16)), f"forward {i} differs")
        ref, _, _ = reference(w1, w2, ranks)
        close(self, "deterministic y", ys[0].cpu(), ref[0][2])

    # ---- communicators ------------------------------------------------------------------------
    def test_communicator_from_a_process_group(self):
        import torch.distributed as dist
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            comm = epmoe.from_process_group()
            self.assertEqual((comm.rank, comm.world_size), (0, 1))
            self.check_case("process group", *make_case(1, 8, 2, 256, 256, 96, 4606), k=2, comm=comm)
        finally:
            dist.destroy_process_group()

    # ---- ops ----------------------------------------------------------------------------------
    def test_backward_accumulate_into_main_grads(self):
        w1, w2, ranks = make_case(1, 8, 2, 256, 256, 96, 4607)
        moe = make_module(self.comm, w1, w2, 2)
        moe._ensure_layer()
        L, W1, W2 = moe._layer, moe.w1.detach(), moe.w2.detach()
        x, ids, wts, dy = (cuda(t) for t in ranks[0])
        ops = torch.ops.epmoe
        y, ctx = ops.moe_forward(L, x, ids, wts, W1, W2, True)
        try:
            g1, g2 = torch.zeros_like(W1, dtype=torch.float32), torch.zeros_like(W2, dtype=torch.float32)
            dx, dtw = ops.moe_backward_accumulate(L, ctx, dy, W1, W2, g1, g2)
            ops.moe_backward_accumulate(L, ctx, dy, W1, W2, g1, g2)  # the saved forward serves again
            b1, b2 = torch.zeros_like(W1), torch.zeros_like(W2)  # bf16 main grads
            ops.moe_backward_accumulate(L, ctx, dy, W1, W2, b1, b2)
            torch.cuda.synchronize()
        finally:
            ops.release_context(ctx)
        ref, dw1, dw2 = reference(w1, w2, ranks)
        close(self, "accumulate y", y.cpu(), ref[0][2])
        close(self, "accumulate dx", dx.cpu(), ref[0][0])
        close(self, "accumulate d_topk_weights", dtw.cpu(), ref[0][1])
        close(self, "fp32 dw1 accumulated twice", g1.cpu(), 2 * dw1)
        close(self, "fp32 dw2 accumulated twice", g2.cpu(), 2 * dw2)
        close(self, "bf16 dw1 accumulated once", b1.cpu(), dw1)
        close(self, "bf16 dw2 accumulated once", b2.cpu(), dw2)

    def test_current_stream_is_honoured(self):
        """The layer's forward and backward on a side stream whose input is written there after a long
        sleep: a layer ordered on any other stream would read x before it is written."""
        w1, w2, ranks = make_case(1, 8, 2, 256, 256, 128, 4608)
        moe = make_module(self.comm, w1, w2, 2)
        x, ids, wts, dy = (cuda(t) for t in ranks[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # the uploads above
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # ~50 ms of this stream only
            xs = (x * 1).requires_grad_()   # written on `side`, after the sleep
            wg = wts.clone().requires_grad_()
            y = moe(xs, ids, wg)
            y.backward(dy)                  # autograd runs it on the forward's stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.check_against_reference("side stream", w1, w2, ranks, (y, xs.grad, wg.grad, moe.w1.grad, moe.w2.grad))

    def test_memory_comes_from_torchs_allocator(self):
        w1, w2, ranks = make_case(1, 8, 2, 256, 256, 200, 4609)
        x, ids, wts, _ = (cuda(t) for t in ranks[0])

        def block(t):  # what torch.cuda.memory_allocated counts for a small tensor: 512-byte blocks
            return (t.numel() * t.element_size() + 511) // 512 * 512

        held, outliving = {}, {}
        for flag in (True, False):
            moe = make_module(self.comm, w1, w2, 2, torch_allocator=flag)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            with torch.no_grad():
                y = moe(x, ids, wts)  # the layer is made here; its workspaces stay with it
            torch.cuda.synchronize()
            held[flag] = torch.cuda.memory_allocated() - base - block(y)
            y2, ctx = torch.ops.epmoe.moe_forward(moe._layer, x, ids, wts, moe.w1.detach(), moe.w2.detach(), True)
            torch.ops.epmoe.release_layer(moe._layer)  # the context outlives its layer...
            moe._layer = None
            torch.cuda.synchronize()
            outliving[flag] = torch.cuda.memory_allocated() - base - block(y) - block(y2)
            torch.ops.epmoe.release_context(ctx)  # ...and frees into a live allocator
            del y, y2
            torch.cuda.synchronize()
            self.assertEqual(torch.cuda.memory_allocated() - base, 0,
                             f"torch_allocator={flag}: memory the layer took was not all given back")
        self.assertGreater(held[True], 0, "the layer's workspaces should be torch blocks")
        self.assertGreater(outliving[True], 0, "a saved context's buffers should be torch blocks")
        self.assertEqual((held[False], outliving[False]), (0, 0),
                         "torch_allocator=False: the layer's memory is its own, not torch's")

    def test_opcheck(self):
        version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if version < (2, 4) or not hasattr(torch.library, "opcheck"):
            self.skipTest(f"{VERSION_GUARD}torch.library.opcheck needs torch >= 2.4, this is {torch.__version__}")
        from torch.library import opcheck
        w1, w2, ranks = make_case(1, 8, 2, 256, 256, 64, 4610)
        moe = make_module(self.comm, w1, w2, 2)
        moe._ensure_layer()
        L, W1, W2 = moe._layer, moe.w1.detach(), moe.w2.detach()
        x, ids, wts, dy = (cuda(t) for t in ranks[0])
        ops = torch.ops.epmoe
        infer = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
        grads = (L, x.clone().requires_grad_(), ids, wts.clone().requires_grad_(), W1.clone().requires_grad_(),
                 W2.clone().requires_grad_())
        # The differentiable op: schema, its C++ autograd registration, the Meta kernel as fake kernel;
        # and traced (AOT, dynamic shapes) as an inference forward.
        opcheck(ops.moe.default, grads, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        opcheck(ops.moe.default, (L, x, ids, wts, W1, W2), test_utils=infer)
        # The pieces it is made of: not differentiable by design (no autograd registration to test).
        opcheck(ops.moe_forward.default, (L, x, ids, wts, W1, W2, False), test_utils=infer)
        _, ctx = ops.moe_forward(L, x, ids, wts, W1, W2, True)
        try:
            opcheck(ops.moe_backward.default, (L, ctx, dy, W1, W2), test_utils=infer)
            g1, g2 = torch.zeros_like(W1, dtype=torch.float32), torch.zeros_like(W2, dtype=torch.float32)
            opcheck(ops.moe_backward_accumulate.default, (L, ctx, dy, W1, W2, g1, g2), test_utils=infer)
        finally:
            ops.release_context(ctx)
        # The FP8 inference op (bf16 x): schema, fake kernel, traced as an inference forward.
        fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")
        fp8._ensure_layer()
        opcheck(ops.moe_fp8.default, (fp8._layer, x, ids, wts, fp8.w1, fp8.w1_scale, fp8.w2, fp8.w2_scale),
                test_utils=infer)
        # The capturable forward, bf16 and MXFP8 layers (forward-only: schema, fake kernel, inference tracing;
        # num_tokens on the device, below the rows given).
        cap = epmoe.MoE(8, 2, 256, 256, self.comm, max_tokens=x.shape[0]).cuda()
        with torch.no_grad():
            cap.w1.copy_(W1)
            cap.w2.copy_(W2)
        num = torch.full((1,), x.shape[0] - 3, dtype=torch.long, device="cuda")
        ids32 = ids.int()  # (the capturable op casts nothing)
        for mod in (cap, epmoe.MoEFp8.from_module(cap, "mxfp8")):
            with torch.no_grad():
                mod.forward_capturable(x, ids32, wts, num)  # makes the layer
            opcheck(ops.moe_capturable.default, (mod._layer, x, ids32, wts, num, list(mod._weights())),
                    test_utils=infer)
        xq, xs = epmoe.quantize_mxfp8(x)  # (the MXFP8 module is the layer made last)
        opcheck(ops.moe_capturable_mxfp8_x.default, (mod._layer, xq, xs, ids32, wts, num, list(mod._weights())),
                test_utils=infer)
        # Reported, not counted: AOT tracing of moe *with* gradients. The saved forward travels to the
        # backward as a host integer handle (the Meta kernel's is 0), which tracing bakes into the
        # backward graph; the compiled backward then looks up a context that does not exist.
        try:
            opcheck(ops.moe.default, grads, test_utils=("test_aot_dispatch_dynamic",))
            print("NOTE: opcheck test_aot_dispatch_dynamic of epmoe::moe with gradients passes now: count it")
        except Exception as e:  # noqa: BLE001 (any failure of the probe is the known one, or news)
            print(f"KNOWN LIMITATION (not counted): opcheck test_aot_dispatch_dynamic of epmoe::moe with "
                  f"gradients: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")

    def test_torch_compile_forward(self):
        w1, w2, ranks = make_case(1, 8, 2, 256, 256, 64, 4611)
        moe = make_module(self.comm, w1, w2, 2)
        x, ids, wts, _ = (cuda(t) for t in ranks[0])

        def step(a, b, c):
            return moe(a, b, c) * 2 + 1

        with torch.no_grad():
            eager = step(x, ids, wts)  # (also makes the layer, outside the compiled region)
            compiled = torch.compile(step, fullgraph=False)
            got = [compiled(x, ids, wts) for _ in range(2)]  # the second call runs the cached code
        torch.cuda.synchronize()
        ref = reference(w1, w2, ranks)[0][0][2]
        close(self, "compiled y", ((got[0].float() - 1) / 2).cpu(), ref)
        # Bit for bit: the same kernels on the same inputs (top_k 2: at most two bf16 atomic adds onto
        # zero per row, so their order cannot change a bit), the same elementwise tail.
        for g in got:
            self.assertTrue(torch.equal(g, eager), "torch.compile's output differs from eager")

    def test_fp8_inference(self):
        for fmt in ("mxfp8", "block128"):
            for T in (1, 3, 200):
                w1, w2, ranks = fp8ref.make_case(1, 8, 2, 256, 256, T, 4700 + T)
                moe = make_module(self.comm, w1.cuda(), w2.cuda(), 2)
                fp8 = epmoe.MoEFp8.from_module(moe, fmt)
                self.assertTrue(fp8.w1.is_cuda and fp8.w1_scale.is_cuda, "buffers stay on the module's device")
                x, ids, wts = ranks[0]
                with torch.no_grad():
                    ys = [("bf16 x", fp8(x.cuda(), ids.cuda(), wts.cuda()))]
                    if fmt == "mxfp8":
                        xq, xs = epmoe.quantize_mxfp8(x.cuda())
                        ys.append(("x given in MXFP8", fp8(xq, ids.cuda(), wts.cuda(), x_scale=xs)))
                torch.cuda.synchronize()
                ref = fp8ref.reference(fmt, fp8ref.dequant_weights(fp8.w1.cpu(), fp8.w1_scale.cpu()),
                                       fp8ref.dequant_weights(fp8.w2.cpu(), fp8.w2_scale.cpu()), x, ids, wts)
                for what, y in ys:
                    tag = f"{fmt} T={T} {what}"
                    self.assertEqual((y.device.type, y.dtype, tuple(y.shape)), ("cuda", torch.bfloat16, tuple(x.shape)),
                                     tag)
                    y = y.cpu().double()
                    self.assertTrue(torch.isfinite(y).all(), tag)
                    self.assertLessEqual((y - ref).abs().max().item(), ref.abs().max().item() / 32, tag)
                    self.assertLessEqual(fp8ref.rel_l2(y, ref), 1e-2, tag)
                with self.assertRaisesRegex(RuntimeError, "forward-only"):
                    fp8(x.cuda().requires_grad_(), ids.cuda(), wts.cuda())

    def test_capturable_forward(self):
        """forward_capturable under torch.cuda.graph, bf16 and MXFP8 modules (max_tokens N): captured once,
        replayed at T = 0, 1, 5, N with fresh inputs copied into the static buffers (routing rows past T
        hold ids that would fail if read): y's first T rows against the fp64 references within the
        tolerances above (bf16: close(); MXFP8: test_fp8_inference's), the rows past T exactly 0; then a
        bad id: its row NaN and check_capturable raising."""
        N, E, k, H, Fd = 24, 8, 2, 256, 256
        w1, w2, _ = make_case(1, E, k, H, Fd, 1, 4800)
        moe = epmoe.MoE(E, k, H, Fd, self.comm, max_tokens=N).cuda()
        with torch.no_grad():
            moe.w1.copy_(w1)
            moe.w2.copy_(w2)
        fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")
        self.assertEqual(fp8.max_tokens, N)
        for name, mod in (("bf16", moe), ("mxfp8", fp8)):
            x = torch.zeros(N, H, dtype=torch.bfloat16, device="cuda")
            ids = torch.zeros(N, k, dtype=torch.int32, device="cuda")
            wts = torch.zeros(N, k, device="cuda")
            T = torch.zeros(1, dtype=torch.long, device="cuda")
            with torch.no_grad():
                mod.forward_capturable(x, ids, wts, T)  # warm-up: makes the layer (allocates)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = mod.forward_capturable(x, ids, wts, T)
            for t in (0, 1, 5, N):
                tag = f"{name} graph replay T={t}"
                _, _, ranks = make_case(1, E, k, H, Fd, max(t, 1), 4900 + t)
                xt, idt, wtt, dy = (r[:t] for r in ranks[0])
                x.zero_()
                ids.fill_(E + 100)
                wts.fill_(1.0)
                x[:t].copy_(xt)
                ids[:t].copy_(idt)
                wts[:t].copy_(wtt)
                T.fill_(t)
                g.replay()
                torch.cuda.synchronize()
                mod.check_capturable()
                got = y.detach().cpu()
                self.assertTrue((got[t:] == 0).all(), f"{tag}: rows past T must be 0")
                if t == 0:
                    continue
                if name == "bf16":
                    close(self, tag, got[:t], reference(w1, w2, [(xt, idt, wtt, dy)])[0][0][2])
                else:
                    ref = fp8ref.reference("mxfp8", fp8ref.dequant_weights(fp8.w1.cpu(), fp8.w1_scale.cpu()),
                                           fp8ref.dequant_weights(fp8.w2.cpu(), fp8.w2_scale.cpu()), xt, idt, wtt)
                    yt = got[:t].double()
                    self.assertLessEqual((yt - ref).abs().max().item(), ref.abs().max().item() / 32, tag)
                    self.assertLessEqual(fp8ref.rel_l2(yt, ref), 1e-2, tag)
            ids[1, 0] = E + 5  # (T = N from the last replay)
            g.replay()
            torch.cuda.synchronize()
            self.assertTrue(torch.isnan(y[1].float()).all().item(), f"{name}: a bad id's row must be NaN")
            with self.assertRaisesRegex(RuntimeError, "expert id"):
                mod.check_capturable()
            mod.check_capturable()  # (cleared once raised)

    def test_capturable_given_mxfp8_x(self):
        """An MXFP8 module's forward_capturable with x given in MXFP8 (x_scale=...) under torch.cuda.graph,
        beside its bf16-x graph: at T = 0, 1, 5, N the given graph's y equals the quantizing graph's bit for
        bit (epmoe.quantize_mxfp8 is the host quantizer the device one matches bit for bit, and at k = 2 a
        token's two bf16 atomic adds onto 0 commute, so their order cannot show); x rows past T hold 0xFF
        bytes (NaN in E4M3 and E8M0) that must not be read."""
        N, E, k, H, Fd = 24, 8, 2, 256, 256
        w1, w2, _ = make_case(1, E, k, H, Fd, 1, 4820)
        moe = epmoe.MoE(E, k, H, Fd, self.comm, max_tokens=N).cuda()
        with torch.no_grad():
            moe.w1.copy_(w1)
            moe.w2.copy_(w2)
        fp8 = epmoe.MoEFp8.from_module(moe, "mxfp8")
        x = torch.zeros(N, H, dtype=torch.bfloat16, device="cuda")
        xq = torch.zeros(N, H, dtype=torch.uint8, device="cuda")
        xs = torch.zeros(N, H // 32, dtype=torch.uint8, device="cuda")
        ids = torch.zeros(N, k, dtype=torch.int32, device="cuda")
        wts = torch.zeros(N, k, device="cuda")
        T = torch.zeros(1, dtype=torch.long, device="cuda")
        graphs = []
        with torch.no_grad():
            for given in (False, True):
                args = (xq, ids, wts, T) if given else (x, ids, wts, T)
                kw = {"x_scale": xs} if given else {}
                fp8.forward_capturable(*args, **kw)  # warm-up (the first makes the layer)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = fp8.forward_capturable(*args, **kw)
                graphs.append((g, y))
        for t in (0, 1, 5, N):
            _, _, ranks = make_case(1, E, k, H, Fd, max(t, 1), 4920 + t)
            xt, idt, wtt, _ = (r[:t] for r in ranks[0])
            x.zero_()
            xq.fill_(0xFF)
            xs.fill_(0xFF)
            ids.fill_(E + 100)
            wts.fill_(1.0)
            x[:t].copy_(xt)
            if t > 0:
                qt, st = epmoe.quantize_mxfp8(xt)
                xq[:t].copy_(qt.view(torch.uint8))
                xs[:t].copy_(st.view(torch.uint8))
            ids[:t].copy_(idt)
            wts[:t].copy_(wtt)
            T.fill_(t)
            got = []
            for g, y in graphs:
                g.replay()
                torch.cuda.synchronize()
                got.append(y.detach().cpu())
            fp8.check_capturable()
            self.assertTrue(torch.equal(got[0], got[1]), f"T={t}: the given-x graph's y differs from the bf16-x graph's")
            self.assertTrue((got[1][t:] == 0).all(), f"T={t}: rows past T must be 0")


def main():
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (torch.cuda.is_available() is False): the CUDA torch suite needs one GPU")
        return 77
    epmoe.load_library()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("epmoe::moe_forward", "CUDA"):
        print(f"FAILED: {epmoe._loaded} has no CUDA kernels (built against a torch without CUDA?) but this torch "
              f"{torch.__version__} has a GPU")
        return 1
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(CudaWorld1)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    guarded = [(t, why) for t, why in result.skipped if why.startswith(VERSION_GUARD)]
    other_skips = [(t, why) for t, why in result.skipped if not why.startswith(VERSION_GUARD)]
    for t, why in guarded:
        print(f"SKIPPED {t.id()}: {why}")
    for t, why in other_skips:
        print(f"FAILED (skipped without the version guard) {t.id()}: {why}")
    failed = len(result.failures) + len(result.errors) + len(other_skips)
    passed = result.testsRun - len(result.failures) - len(result.errors) - len(result.skipped)
    print(f"test_python_cuda: {passed} passed, {failed} failed, {len(guarded)} skipped (torch version guard); "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
