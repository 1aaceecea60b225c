// epmoe_train's training loop, progress lines and JSON log (train_loop.h).
#include "train_loop.h"

#include <sys/resource.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <fstream>
#include <sstream>

#include "epmoe/error.h"
#include "train_checkpoint.h"
#if EPMOE_TRAIN_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace epmoe::train {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Host clocks measure GPU work only after it finished.
void sync_device(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// This rank's peak memory: CUDA, torch's max allocated (the layer's own stream-ordered buffers are
// outside torch's allocator and not counted); CPU, the process's max RSS (all mock ranks together).
int64_t local_peak_bytes(const at::Device& device) {
  if (device.is_cuda()) {
#if EPMOE_TRAIN_TORCH_CUDA
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak;  // 0: all pools
#else
    return 0;
#endif
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;  // kilobytes on Linux
}

// Expert FLOPs of one step on one rank. Per routed (token, expert) pair, forward: the W1 GEMM
// (2 ffn x hidden MACs) and the W2 GEMM (hidden x ffn MACs) = 3 hidden ffn MACs = 6 hidden ffn
// FLOPs; backward twice that (the input and the weight gradient of each GEMM) = 12 hidden ffn.
// Pairs per rank = tokens x top_k (no slot is dropped; on average each rank computes its share).
// Not counted: the router, SwiGLU, the teacher's forward (data), the optimizer.
double expert_flops_per_rank(const TrainOptions& o) {
  return 18.0 * double(o.tokens) * o.top_k * double(o.hidden) * double(o.ffn);
}

std::string format_eta(double s) {
  char buf[32];
  if (s < 90) std::snprintf(buf, sizeof buf, "%.0f s", s);
  else if (s < 5400) std::snprintf(buf, sizeof buf, "%.1f min", s / 60);
  else std::snprintf(buf, sizeof buf, "%.1f h", s / 3600);
  return buf;
}

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (c == '\n') o += "\\n";
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else o += c;
  }
  return o + "\"";
}
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

}  // namespace

void write_json_log(const std::string& path, const TrainOptions& o, const RunInfo& info, int world,
                    const at::Device& device, const TrainResult& r) {
  std::ostringstream j;
  j << "{\n  \"program\": \"epmoe_train\",\n  \"config\": {"
    << "\"backend\": " << json_string(info.backend) << ", \"device\": " << json_string(device.str())
    << ", \"world\": " << world << ", \"tokens_per_rank\": " << o.tokens << ", \"hidden\": " << o.hidden
    << ", \"ffn\": " << o.ffn << ", \"experts\": " << o.experts << ", \"topk\": " << o.top_k
    << ", \"input_dim\": " << o.input_dim << ", \"steps\": " << o.steps << ", \"seed\": " << o.seed
    << ", \"lr\": " << json_number(o.lr) << ", \"weight_decay\": " << json_number(o.weight_decay)
    << ", \"beta1\": " << json_number(o.beta1) << ", \"beta2\": " << json_number(o.beta2)
    << ", \"eps\": " << json_number(o.eps) << ", \"log_every\": " << o.log_every
    << ", \"cpu_threads\": " << o.cpu_threads << ", \"load\": " << json_string(o.load_dir)
    << ", \"save\": " << json_string(o.save_dir) << ", \"first_step\": " << r.first_step << "},\n"
    << "  \"units\": {\"loss\": \"MSE to the teacher, mean over ranks\", \"ms\": \"training step (fwd, bwd, "
       "router all-reduce, AdamW), mean per step since the previous entry\", \"data_ms\": \"data + teacher "
       "target per step\", \"tokens_per_s\": \"global, over ms\", \"tflops\": \"per rank: expert fwd 6 + bwd 12 "
       "x pairs x hidden x ffn, over ms\", \"peak_bytes\": \"max over ranks: CPU max RSS, CUDA torch max "
       "allocated\"},\n  \"log\": [";
  for (size_t i = 0; i < r.log.size(); ++i) {
    const StepLog& s = r.log[i];
    j << (i ? ",\n    " : "\n    ") << "{\"step\": " << s.step << ", \"loss\": " << json_number(s.loss)
      << ", \"ms\": " << json_number(s.ms) << ", \"data_ms\": " << json_number(s.data_ms)
      << ", \"tokens_per_s\": " << json_number(s.tokens_per_s) << ", \"tflops\": " << json_number(s.tflops)
      << ", \"peak_bytes\": " << s.peak_bytes << "}";
  }
  j << "\n  ],\n  \"summary\": {\"first_step\": " << r.first_step << ", \"last_step\": " << r.last_step
    << ", \"first_loss\": " << json_number(r.log.empty() ? NAN : r.log.front().loss)
    << ", \"final_loss\": " << json_number(r.log.empty() ? NAN : r.log.back().loss)
    << ", \"mean_ms\": " << json_number(r.mean_ms) << ", \"mean_data_ms\": " << json_number(r.mean_data_ms)
    << ", \"tokens_per_s\": " << json_number(r.tokens_per_s) << ", \"tflops\": " << json_number(r.tflops)
    << ", \"peak_bytes\": " << r.peak_bytes << ", \"wall_s\": " << json_number(r.wall_s) << "}\n}\n";
  std::ofstream f(path);
  f << j.str();
  f.close();
  EPMOE_CHECK(f.good(), ErrorCode::invalid_argument, "epmoe_train: cannot write the JSON log ", path);
}

TrainResult run_training(const TrainOptions& opt, std::shared_ptr<Communicator> comm, const at::Device& device,
                         const RunInfo& info) {
  EPMOE_CHECK(comm != nullptr, ErrorCode::invalid_argument, "run_training: no communicator");
  const int me = comm->rank(), W = comm->world_size();
  try {
    validate_options(opt, W);  // the same verdict on every rank, before any collective
  } catch (const Error& e) {
    throw AgreedError(e.code(), e.what());
  }
  const Clock::time_point start = Clock::now();
  std::FILE* out = me == 0 ? info.out : nullptr;

  const MoeConfig cfg{.num_experts = opt.experts, .top_k = opt.top_k, .hidden = opt.hidden, .ffn = opt.ffn,
                      .world_size = W, .rank = me};
  LayerOptions layer_options;
  layer_options.cpu_threads = opt.cpu_threads;
  const at::Tensor basis = normal_f32({opt.input_dim, opt.hidden}, stream_seed(opt.seed, RandomTag::input_basis),
                                      device);
  Teacher teacher(opt, cfg, comm, layer_options, device);
  Student student(opt, cfg, comm, layer_options, device);
  const AdamWConfig adamw{opt.lr, opt.weight_decay, opt.beta1, opt.beta2, opt.eps};

  int64_t done = 0;
  if (!opt.load_dir.empty()) done = load_checkpoint(opt.load_dir, opt, *comm, student.tensors);
  if (done >= opt.steps)  // every rank loaded the same step
    throw AgreedError(ErrorCode::invalid_argument,
                      detail::concat("the checkpoint in ", opt.load_dir, " is at step ", done,
                                     ": nothing left to run with --steps ", opt.steps));

  TrainResult r;
  r.first_step = done + 1;
  r.last_step = opt.steps;
  if (out) {
    const std::string resumed = opt.load_dir.empty() ? "" : " (resumed from " + opt.load_dir + ")";
    std::fprintf(out,
                 "# epmoe_train: %s, world %d, E=%d k=%d hidden=%d ffn=%d tokens/rank=%" PRId64
                 " input_dim=%d, steps %" PRId64 "..%" PRId64 "%s\n"
                 "# AdamW lr %g wd %g betas %g/%g eps %g; fp32 masters and moments, bf16 expert weights, fp32 "
                 "router (gradients averaged over ranks)\n"
                 "# ms/step: forward, backward, router all-reduce, AdamW (data: the batch and the teacher's "
                 "target, apart); tokens/s: global; TFLOP/s/rank: the experts' fwd+bwd, 18 x pairs x hidden x ffn\n",
                 info.backend.c_str(), W, opt.experts, opt.top_k, opt.hidden, opt.ffn, opt.tokens, opt.input_dim,
                 r.first_step, r.last_step, resumed.c_str(),
                 opt.lr, opt.weight_decay, opt.beta1, opt.beta2, opt.eps);
    std::fflush(out);
  }

  const double flops = expert_flops_per_rank(opt);
  double interval_ms = 0, interval_data_ms = 0, steady_ms = 0, steady_data_ms = 0, run_ms = 0;
  int64_t interval_steps = 0, steady_steps = 0;
  for (int64_t step = r.first_step; step <= r.last_step; ++step) {
    const Clock::time_point t0 = Clock::now();
    const at::Tensor x = make_batch(opt, basis, me, step, device);
    const at::Tensor target = teacher.target(x);
    sync_device(device);
    const double data_ms = ms_since(t0);

    const Clock::time_point t1 = Clock::now();
    const at::Tensor y = student.forward(x);
    const at::Tensor loss = (y - target).pow(2).mean();
    loss.backward();
    const at::Tensor mean_loss = student.step(loss, adamw, step);
    sync_device(device);
    const double step_ms = ms_since(t1);

    interval_ms += step_ms, interval_data_ms += data_ms, ++interval_steps, run_ms += step_ms + data_ms;
    if (step > r.first_step || r.first_step == r.last_step) {
      steady_ms += step_ms, steady_data_ms += data_ms, ++steady_steps;
    }
    const bool logged = step == r.first_step || step % opt.log_every == 0 || step == r.last_step;
    if (!logged) continue;
    int64_t peak = local_peak_bytes(device);
    comm->allreduce_max_i64(&peak, 1);  // every rank logs the same steps: collective on all
    StepLog s;
    s.step = step;
    s.loss = mean_loss.item<double>();
    s.ms = interval_ms / double(interval_steps);
    s.data_ms = interval_data_ms / double(interval_steps);
    s.tokens_per_s = double(opt.tokens) * W / (s.ms * 1e-3);
    s.tflops = flops / (s.ms * 1e-3) / 1e12;
    s.peak_bytes = peak;
    r.log.push_back(s);
    interval_ms = interval_data_ms = 0, interval_steps = 0;
    if (out) {
      const int64_t left = r.last_step - step;
      const double eta_s = double(left) * run_ms / double(step - r.first_step + 1) / 1e3;
      std::fprintf(out,
                   "step %6" PRId64 "/%" PRId64 "  loss %.6e  %9.2f ms/step (data %.2f ms)  %10.4g tokens/s  "
                   "%8.4f TFLOP/s/rank  peak %.3f GB  ETA %s\n",
                   step, r.last_step, s.loss, s.ms, s.data_ms, s.tokens_per_s, s.tflops, double(peak) / 1e9,
                   format_eta(eta_s).c_str());
      std::fflush(out);
    }
  }

  r.mean_ms = steady_ms / double(std::max<int64_t>(1, steady_steps));
  r.mean_data_ms = steady_data_ms / double(std::max<int64_t>(1, steady_steps));
  r.tokens_per_s = double(opt.tokens) * W / (r.mean_ms * 1e-3);
  r.tflops = flops / (r.mean_ms * 1e-3) / 1e12;
  r.peak_bytes = r.log.back().peak_bytes;

  if (!opt.save_dir.empty()) save_checkpoint(opt.save_dir, opt, *comm, r.last_step, student.tensors);
  r.wall_s = ms_since(start) / 1e3;
  if (me == 0 && !opt.json_path.empty()) write_json_log(opt.json_path, opt, info, W, device, r);
  if (out) {
    std::fprintf(out,
                 "# final step=%" PRId64 " loss=%.6e first_step=%" PRId64 " first_loss=%.6e mean_ms=%.3f "
                 "mean_data_ms=%.3f tokens_per_s=%.6g tflops_per_rank=%.5f peak_GB=%.3f wall_s=%.2f%s%s\n",
                 r.last_step, r.log.back().loss, r.first_step, r.log.front().loss, r.mean_ms, r.mean_data_ms,
                 r.tokens_per_s, r.tflops, double(r.peak_bytes) / 1e9, r.wall_s,
                 opt.save_dir.empty() ? "" : (" saved=" + opt.save_dir).c_str(),
                 opt.json_path.empty() ? "" : (" json=" + opt.json_path).c_str());
    std::fflush(out);
  }
  return r;
}

}  // namespace epmoe::train
