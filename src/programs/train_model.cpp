// epmoe_train's model and task (train_model.h).
#include "train_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <mutex>

#include "epmoe/error.h"
#if EPMOE_TRAIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace epmoe::train {

void validate_options(const TrainOptions& o, int world) {
  auto need = [](bool ok, auto&&... what) {
    if (!ok) EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: ", what...);
  };
  need(world >= 1, "world size ", world);
  need(o.tokens >= 1, "--tokens must be >= 1 (got ", o.tokens, ")");
  need(o.input_dim >= 1 && o.input_dim <= o.hidden, "--input-dim must be in [1, hidden=", o.hidden, "] (got ",
       o.input_dim, ")");
  need(o.steps >= 1, "--steps must be >= 1 (got ", o.steps, ")");
  need(o.log_every >= 1, "--log-every must be >= 1 (got ", o.log_every, ")");
  need(o.lr > 0 && std::isfinite(o.lr), "--lr must be > 0 (got ", o.lr, ")");
  need(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "--weight-decay must be >= 0 (got ", o.weight_decay, ")");
  need(o.beta1 >= 0 && o.beta1 < 1, "--beta1 must be in [0, 1) (got ", o.beta1, ")");
  need(o.beta2 >= 0 && o.beta2 < 1, "--beta2 must be in [0, 1) (got ", o.beta2, ")");
  need(o.eps > 0, "--eps must be > 0 (got ", o.eps, ")");
  need(o.cpu_threads >= 1, "--cpu-threads must be >= 1 (got ", o.cpu_threads, ")");
  // The layer's own rules (experts % world, top_k <= experts, hidden and ffn multiples of 16, ...),
  // checked here so that they fail before any collective, with the layer's message.
  const MoeConfig cfg{.num_experts = o.experts, .top_k = o.top_k, .hidden = o.hidden, .ffn = o.ffn,
                      .world_size = world, .rank = 0};
  cfg.validate();
}

// ---- deterministic random tensors -----------------------------------------------------------

namespace {
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

uint64_t stream_seed(uint64_t seed, RandomTag tag, uint64_t a, uint64_t b) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  return mix64(mix64(mix64(seed * kGolden + uint64_t(tag)) + a) ^ (b * 0xD1B54A32D192ED03ull));
}

at::Tensor normal_f32(at::IntArrayRef shape, uint64_t key, const at::Device& device) {
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  if (device.is_cpu()) return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(key), options);
  at::Generator gen = at::globalContext().defaultGenerator(device);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());  // randn takes it again: released before the draw
    gen.set_current_seed(key);                       // (also resets the Philox offset)
  }
  return at::randn(shape, gen, options);
}

// ---- the model ------------------------------------------------------------------------------

Routing route_top_k(const at::Tensor& x_f32, const at::Tensor& router_w, const at::Tensor& router_b, int top_k) {
  const at::Tensor probs = at::softmax(at::addmm(router_b, x_f32, router_w.t()), -1);
  auto [top, ids] = at::topk(probs, top_k, -1);
  return {ids, top / top.sum(-1, /*keepdim=*/true)};
}

at::Tensor make_batch(const TrainOptions& opt, const at::Tensor& input_basis, int rank, int64_t step,
                      const at::Device& device) {
  const at::Tensor z = normal_f32({opt.tokens, opt.input_dim},
                                  stream_seed(opt.seed, RandomTag::data, uint64_t(rank), uint64_t(step)), device);
  return (z.matmul(input_basis) * (1.0 / std::sqrt(double(opt.input_dim)))).to(at::kBFloat16);
}

namespace {
// Global experts [first, first + E_local) of the stream pair (tag1, tag2), each N(0, 1/fan_in): the
// teacher's distribution, and the student's initialisation (an independent draw of the same one).
ExpertShard expert_shard(const TrainOptions& opt, const MoeConfig& cfg, RandomTag tag1, RandomTag tag2,
                         const at::Device& device) {
  std::vector<at::Tensor> w1, w2;
  const int64_t H = cfg.hidden, F = cfg.ffn;
  for (int i = 0; i < cfg.experts_per_rank(); ++i) {
    const uint64_t e = uint64_t(cfg.first_expert() + i);
    w1.push_back(normal_f32({2 * F, H}, stream_seed(opt.seed, tag1, e), device) * (1.0 / std::sqrt(double(H))));
    w2.push_back(normal_f32({H, F}, stream_seed(opt.seed, tag2, e), device) * (1.0 / std::sqrt(double(F))));
  }
  return {at::stack(w1).contiguous(), at::stack(w2).contiguous()};
}

// Router weights N(0, 1/hidden) (logits of unit variance), bias 0; the same on every rank.
at::Tensor router_weight(const TrainOptions& opt, RandomTag tag, const at::Device& device) {
  return normal_f32({opt.experts, opt.hidden}, stream_seed(opt.seed, tag), device) *
         (1.0 / std::sqrt(double(opt.hidden)));
}

void load_bf16(at::Tensor& param, const at::Tensor& f32) {
  torch::NoGradGuard no_grad;
  param.copy_(f32);  // round to nearest even, once
}
}  // namespace

ExpertShard teacher_experts(const TrainOptions& opt, const MoeConfig& cfg, const at::Device& device) {
  return expert_shard(opt, cfg, RandomTag::teacher_w1, RandomTag::teacher_w2, device);
}
ExpertShard student_experts(const TrainOptions& opt, const MoeConfig& cfg, const at::Device& device) {
  return expert_shard(opt, cfg, RandomTag::student_w1, RandomTag::student_w2, device);
}

Teacher::Teacher(const TrainOptions& opt, const MoeConfig& cfg, std::shared_ptr<Communicator> comm,
                 const LayerOptions& layer_options, const at::Device& device)
    : top_k_(cfg.top_k),
      router_w_(router_weight(opt, RandomTag::teacher_router, device)),
      router_b_(at::zeros({opt.experts}, at::TensorOptions().dtype(at::kFloat).device(device))),
      moe_(cfg, std::move(comm), layer_options) {
  moe_->to(device);
  for (auto& p : moe_->parameters()) p.requires_grad_(false);
  const ExpertShard w = teacher_experts(opt, cfg, device);
  load_bf16(moe_->w1, w.w1);
  load_bf16(moe_->w2, w.w2);
}

at::Tensor Teacher::target(const at::Tensor& x) {
  at::Tensor y;
  {
    // No autograd: the ops go straight to their CPU / CUDA kernels (no saved context).
    c10::InferenceMode no_autograd;
    const Routing r = route_top_k(x.to(at::kFloat), router_w_, router_b_, top_k_);
    y = moe_->forward(x, r.ids, r.weights);
  }
  at::Tensor t = y.to(at::kFloat);  // outside inference mode: a normal tensor, usable in the loss
  EPMOE_CHECK(!t.is_inference(), ErrorCode::internal, "epmoe_train: the teacher's target is an inference tensor");
  return t;
}

// ---- AdamW on fp32 masters ------------------------------------------------------------------

void adamw_step(TrainedTensor& p, const at::Tensor& grad, const AdamWConfig& c, int64_t step) {
  torch::NoGradGuard no_grad;
  EPMOE_CHECK(grad.scalar_type() == at::kFloat && grad.sizes() == p.master.sizes(), ErrorCode::internal,
              "adamw_step(", p.name, "): gradient ", grad.sizes(), " ", grad.scalar_type(), " for a master of ",
              p.master.sizes());
  const double bias1 = 1.0 - std::pow(c.beta1, double(step)), bias2 = 1.0 - std::pow(c.beta2, double(step));
  p.m.mul_(c.beta1).add_(grad, 1.0 - c.beta1);                  // m = b1 m + (1 - b1) g
  p.v.mul_(c.beta2).addcmul_(grad, grad, 1.0 - c.beta2);        // v = b2 v + (1 - b2) g^2
  if (p.decay && c.weight_decay != 0) p.master.mul_(1.0 - c.lr * c.weight_decay);  // decoupled decay
  const at::Tensor denom = (p.v.sqrt() / std::sqrt(bias2)).add_(c.eps);            // sqrt(v_hat) + eps
  p.master.addcdiv_(p.m, denom, -c.lr / bias1);                 // master -= lr m_hat / (sqrt(v_hat) + eps)
  if (!p.working.is_same(p.master)) p.working.copy_(p.master);  // bf16 working weights: rounded once
}

// ---- the router's gradient all-reduce -------------------------------------------------------

void allreduce_mean(Communicator& comm, at::Tensor& flat) {
  const int W = comm.world_size();
  if (W == 1) return;
  EPMOE_CHECK(flat.scalar_type() == at::kFloat && flat.is_contiguous() && flat.dim() == 1, ErrorCode::internal,
              "allreduce_mean: a contiguous 1-d f32 tensor");
  const bool on_device = comm.memory_space() == MemorySpace::device;
  EPMOE_CHECK(flat.is_cuda() == on_device, ErrorCode::invalid_argument, "allreduce_mean: a ", flat.device(),
              " tensor, but the '", comm.name(), "' communicator needs ", on_device ? "device" : "host", " buffers");
#if EPMOE_TRAIN_TORCH_CUDA
  // Ordered on torch's current stream: the gradients were computed there, the sum reads it after.
  if (flat.is_cuda()) comm.set_stream(c10::cuda::getCurrentCUDAStream(flat.device().index()).stream());
#endif
  const size_t bytes = size_t(flat.numel()) * sizeof(float);
  at::Tensor recv = at::empty({W, flat.numel()}, flat.options());
  AlltoallvPlane plane;
  plane.send = flat.data_ptr();
  plane.recv = recv.data_ptr();
  plane.send_bytes.assign(size_t(W), bytes);
  plane.send_offsets.assign(size_t(W), 0);  // the same block to every peer
  plane.recv_bytes.assign(size_t(W), bytes);
  for (int p = 0; p < W; ++p) plane.recv_offsets.push_back(size_t(p) * bytes);
  comm.alltoallv(std::span<const AlltoallvPlane>(&plane, 1));
  at::Tensor sum = recv[0].clone();
  for (int p = 1; p < W; ++p) sum.add_(recv[p]);  // rank order, the same on every rank
  flat.copy_(sum.div_(double(W)));
}

// ---- the student ----------------------------------------------------------------------------

Student::Student(const TrainOptions& opt, const MoeConfig& cfg, std::shared_ptr<Communicator> comm_in,
                 const LayerOptions& layer_options, const at::Device& device)
    : moe(cfg, comm_in, layer_options), top_k(cfg.top_k), comm(std::move(comm_in)) {
  moe->to(device);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto trained = [&](std::string name, at::Tensor master, at::Tensor working, bool decay) {
    TrainedTensor t{std::move(name), master, at::zeros_like(master), at::zeros_like(master), working, decay};
    return t;
  };
  at::Tensor rw = router_weight(opt, RandomTag::student_router, device).requires_grad_();
  at::Tensor rb = at::zeros({opt.experts}, f32).requires_grad_();
  const ExpertShard w = student_experts(opt, cfg, device);
  load_bf16(moe->w1, w.w1);
  load_bf16(moe->w2, w.w2);
  tensors.push_back(trained("router_w", rw, rw, true));   // the fp32 router is its own master
  tensors.push_back(trained("router_b", rb, rb, false));
  tensors.push_back(trained("w1", w.w1, moe->w1, true));
  tensors.push_back(trained("w2", w.w2, moe->w2, true));
}

at::Tensor Student::forward(const at::Tensor& x) {
  const Routing r = route_top_k(x.to(at::kFloat), tensors[0].master, tensors[1].master, top_k);
  return moe->forward(x, r.ids, r.weights).to(at::kFloat);
}

at::Tensor Student::step(const at::Tensor& local_loss, const AdamWConfig& cfg, int64_t step) {
  TrainedTensor &rw = tensors[0], &rb = tensors[1];
  const int64_t nw = rw.master.numel(), nb = rb.master.numel();
  // One collective per step: the router's gradients and the loss, averaged.
  at::Tensor flat = at::cat({rw.master.grad().reshape({-1}), rb.master.grad().reshape({-1}),
                             local_loss.detach().to(at::kFloat).reshape({1})});
  allreduce_mean(*comm, flat);
  adamw_step(rw, flat.narrow(0, 0, nw).view(rw.master.sizes()), cfg, step);
  adamw_step(rb, flat.narrow(0, nw, nb), cfg, step);
  // Experts: local. Each rank's loss is the mean over its own tokens and the logged loss the mean
  // over ranks, while the EP backward delivers sum over ranks of d(rank loss)/dW to the expert's
  // owner: 1/W makes it the gradient of the logged loss (as the router's mean is).
  const double scale = 1.0 / double(comm->world_size());
  for (size_t i = 2; i < tensors.size(); ++i) {
    TrainedTensor& p = tensors[i];
    EPMOE_CHECK(p.working.grad().defined(), ErrorCode::internal, "epmoe_train: no gradient reached ", p.name);
    adamw_step(p, p.working.grad().to(at::kFloat).mul_(scale), cfg, step);
  }
  for (TrainedTensor& p : tensors) p.working.mutable_grad().reset();
  return flat[nw + nb];
}

}  // namespace epmoe::train
