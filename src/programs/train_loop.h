// epmoe_train's training loop as a library function, so that the program (epmoe_train.cpp) and
// the tests (tests/train/) run the same code.
//
// One step, on every rank (collective):
//   data      x = make_batch(seed, rank, step), target = teacher(x)      (timed apart: "data ms")
//   forward   router (fp32) -> top-k -> the EP Moe module (bf16 experts) -> y
//   loss      mean((y - target)^2) over this rank's tokens
//   backward  autograd: the layer's EP backward (expert grads, d topk_weights -> router grads)
//   update    router grads + loss averaged over ranks (one collective), AdamW on the fp32 masters,
//             bf16 working weights refreshed
// Rank 0 logs the first step, every log_every-th step and the last one.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/communicator.h"
#include "train_model.h"

namespace epmoe::train {

// One logged step. ms / data_ms: the mean per step since the previous logged step (the training
// step, and the data + teacher target apart). tokens_per_s: global (all ranks) over ms.
// tflops: per rank, the experts' fwd + bwd FLOPs (18 x pairs x hidden x ffn, see train_loop.cpp).
// peak_bytes: the largest over ranks (CPU: the process's max RSS; CUDA: torch's max allocated).
struct StepLog {
  int64_t step = 0;
  double loss = 0, ms = 0, data_ms = 0, tokens_per_s = 0, tflops = 0;
  int64_t peak_bytes = 0;
};

struct TrainResult {
  int64_t first_step = 0, last_step = 0;  // the steps this run executed (first_step - 1 were loaded)
  std::vector<StepLog> log;               // every rank has the same (the values are all-reduced)
  // Over the run's steps after its first (which builds the layers), or the first alone:
  double mean_ms = 0, mean_data_ms = 0, tokens_per_s = 0, tflops = 0;
  int64_t peak_bytes = 0;
  double wall_s = 0;
};

struct RunInfo {
  std::string backend;  // "mock ranks on CPU", "MPI on CPU", "NCCL on GPUs", ...
  std::FILE* out = nullptr;  // rank 0's progress lines (nullptr: quiet)
};

// Collective: every rank of `comm` calls it with the same options. Loads opt.load_dir first, saves
// opt.save_dir at the end, rank 0 writes opt.json_path. Throws Error, on every rank alike for bad
// options and checkpoints.
TrainResult run_training(const TrainOptions& opt, std::shared_ptr<Communicator> comm, const at::Device& device,
                         const RunInfo& info);

// The JSON log (written by rank 0 in run_training; exposed for the tests).
void write_json_log(const std::string& path, const TrainOptions& opt, const RunInfo& info, int world,
                    const at::Device& device, const TrainResult& r);

}  // namespace epmoe::train
