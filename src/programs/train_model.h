// epmoe_train's model and task: the data stream, the teacher MoE, the student (router + the
// expert-parallel Moe module), the router's gradient all-reduce and a hand-written AdamW with fp32
// masters. The loop that drives them is train_loop.h; the checkpoint format train_checkpoint.h.
//
// The task: regression (MSE) of the student onto a fixed random teacher MoE of the same shape.
//   x[T, hidden]   = z A / sqrt(input_dim), z ~ N(0, 1) [T, input_dim], A ~ N(0, 1) [input_dim, hidden]
//   target[T, hidden] = teacher(x)   (teacher router: softmax top-k renormalised, teacher experts)
//   loss           = mean((student(x) - target)^2) on this rank's tokens; the logged loss is the
//                    mean over ranks
// Why x lies in an input_dim-dimensional subspace: a random SwiGLU teacher over all of `hidden`
// directions is a random quadratic-like function that a student of the same size barely learns
// (measured, x ~ N(0, I): after 50 AdamW steps at lr 1e-3 .. 1e-2 the loss was within 5% of its start).
// In a low-dimensional subspace the student's random features already span much of the teacher's
// function space, so the loss falls steadily (defaults, 4 ranks: to 1/5 of its start by step 50,
// 1/12 by step 150) while every part of the step - routing, EP dispatch, both expert GEMMs, their
// backward, the router's gradient through topk_weights - runs at the full shape.
//
// Every random tensor is a pure function of (seed, tag, index...): the teacher and the student's
// initial weights of global expert e are the same on every rank and for every world size, the
// replicated router starts identical everywhere, and the data of (rank, step) can be regenerated
// after a restart, so a resumed run continues bit for bit (CPU).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/communicator.h"
#include "epmoe/error.h"
#include "epmoe/torch.h"

namespace epmoe::train {

// An error raised on every rank alike (bad options, a checkpoint that any rank cannot use): the
// program may leave cleanly, no peer is left waiting in a collective.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// The shape and hyper-parameters of a run (epmoe_train's flags). Defaults: 47 s on 4 CPU mock
// ranks of an idle 2-core machine (~16k tokens/s), the loss below half its start by step 20.
struct TrainOptions {
  int64_t tokens = 1024;  // per rank per step
  int hidden = 256, ffn = 128, experts = 16, top_k = 2;
  int input_dim = 8;     // the data subspace's dimension (see above)
  int64_t steps = 150;   // the last step's number (a resumed run continues up to it)
  uint64_t seed = 2026;
  double lr = 3e-3, weight_decay = 0.01, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int64_t log_every = 10;
  std::string json_path;  // rank 0 writes the JSON log here ("" : none)
  std::string save_dir;   // checkpoint at the end of the run ("" : none)
  std::string load_dir;   // resume from this checkpoint ("" : start at step 0)
  int cpu_threads = 1;    // the CPU engine's expert threads per rank
};

// Throws Error(invalid_argument / invalid_config) naming the first bad value. Depends only on the
// options and the world size, so every rank that calls it fails alike before any collective.
void validate_options(const TrainOptions& opt, int world_size);

// ---- deterministic random tensors -----------------------------------------------------------

enum class RandomTag : uint64_t {
  input_basis = 1, data = 2, teacher_router = 3, teacher_w1 = 4, teacher_w2 = 5,
  student_router = 6, student_w1 = 7, student_w2 = 8,
};
// The generator seed of stream (seed, tag, a, b) (splitmix64 mixing).
uint64_t stream_seed(uint64_t seed, RandomTag tag, uint64_t a = 0, uint64_t b = 0);
// N(0, 1) f32 of `shape` on `device` from stream `key`: a fresh CPU generator on the CPU; on a GPU
// the device's default generator, reseeded (one process per GPU, so nobody else draws from it).
at::Tensor normal_f32(at::IntArrayRef shape, uint64_t key, const at::Device& device);

// ---- the model ------------------------------------------------------------------------------

// softmax(x W^T + b) -> top-k -> renormalised to sum 1, in fp32. x f32 [T, hidden].
struct Routing {
  at::Tensor ids;      // i64 [T, k]
  at::Tensor weights;  // f32 [T, k] (differentiable in W, b)
};
Routing route_top_k(const at::Tensor& x_f32, const at::Tensor& router_w, const at::Tensor& router_b, int top_k);

// The data of (rank, step): x bf16 [tokens, hidden].
at::Tensor make_batch(const TrainOptions& opt, const at::Tensor& input_basis, int rank, int64_t step,
                      const at::Device& device);

// This rank's experts of a random MoE, [E_local, 2 ffn, hidden] and [E_local, hidden, ffn] f32,
// global expert e from its own stream (so independent of the world size).
struct ExpertShard {
  at::Tensor w1, w2;
};
ExpertShard teacher_experts(const TrainOptions& opt, const MoeConfig& cfg, const at::Device& device);
ExpertShard student_experts(const TrainOptions& opt, const MoeConfig& cfg, const at::Device& device);

// The fixed teacher: its router and its experts (bf16, in an EP Moe module of its own).
class Teacher {
 public:
  Teacher(const TrainOptions& opt, const MoeConfig& cfg, std::shared_ptr<Communicator> comm,
          const LayerOptions& layer_options, const at::Device& device);
  // target f32 [T, hidden] (no autograd). Collective.
  at::Tensor target(const at::Tensor& x);

 private:
  int top_k_;
  at::Tensor router_w_, router_b_;
  torch_ext::Moe moe_;
};

// ---- AdamW on fp32 masters ------------------------------------------------------------------

// One trained tensor: its fp32 master and AdamW moments, and the working copy the model computes
// with (the bf16 expert Parameters; for the fp32 router the master itself).
struct TrainedTensor {
  std::string name;
  at::Tensor master, m, v;  // f32
  at::Tensor working;       // bf16 expert Parameter, or == master (router)
  bool decay = true;        // weight decay (not on biases)
};

struct AdamWConfig {
  double lr, weight_decay, beta1, beta2, eps;
};

// One AdamW step (step >= 1, for the bias corrections) of `p` with gradient `grad` (f32, the
// master's shape), then the working copy refreshed from the master (rounded to bf16 once).
void adamw_step(TrainedTensor& p, const at::Tensor& grad, const AdamWConfig& cfg, int64_t step);

// ---- the router's gradient all-reduce -------------------------------------------------------

// In place: flat (contiguous f32, the communicator's memory space) becomes the mean over ranks.
// The communicator has no all-reduce of floats, so this is an alltoallv in which every rank sends
// its whole buffer to every peer, then sums the world_size copies in rank order: every rank adds
// the same numbers in the same order, so the replicated router stays bit-identical on all ranks.
// (W x the bytes of a ring all-reduce: fine for a router's E x (hidden + 1) floats.)
void allreduce_mean(Communicator& comm, at::Tensor& flat);

// ---- the student ----------------------------------------------------------------------------

struct Student {
  Student(const TrainOptions& opt, const MoeConfig& cfg, std::shared_ptr<Communicator> comm,
          const LayerOptions& layer_options, const at::Device& device);
  // y f32 [T, hidden] of x bf16 [T, hidden] with autograd into the router and the experts.
  at::Tensor forward(const at::Tensor& x);
  // After loss.backward(): averages the router's gradient (and, in the same collective, the
  // loss: its returned mean over ranks) across ranks, one AdamW step on every tensor, clears the
  // gradients. Collective.
  at::Tensor step(const at::Tensor& local_loss, const AdamWConfig& cfg, int64_t step);

  // The trained tensors, in checkpoint order: router_w, router_b, w1, w2.
  std::vector<TrainedTensor> tensors;
  torch_ext::Moe moe;
  int top_k;
  std::shared_ptr<Communicator> comm;
};

}  // namespace epmoe::train
