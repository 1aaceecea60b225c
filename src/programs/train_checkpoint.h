// epmoe_train's checkpoints: one file per rank, DIR/rank<r>-of-<W>.pt, a torch::serialize archive
// (the format of torch::save: a zip of named tensors, readable by torch.jit.load in Python) of
//   "meta"            i64 [kMetaWords]: format version, steps done, world, rank, experts, top_k,
//                     hidden, ffn, input_dim, tokens, seed (bits)
//   "<name>.master", "<name>.m", "<name>.v"   f32 on the CPU, for router_w, router_b, w1, w2
// (w1 / w2: this rank's expert shard; the router, replicated, is in every rank's file so each rank
// resumes from its own file alone). "steps done" is also the data stream's position: the batch of
// step s is regenerated from (seed, rank, s), so nothing else of the RNG needs saving.
// The bf16 working weights are not saved: they are bf16(master), exactly what the uninterrupted run
// holds after the same step.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/communicator.h"
#include "train_model.h"

namespace epmoe::train {

inline constexpr int64_t kCheckpointFormat = 1;
inline constexpr int kMetaWords = 11;

std::string checkpoint_path(const std::string& dir, int rank, int world);

// Collective: every rank writes its file (to a temporary name, then renamed), then all ranks agree:
// a failure on any rank raises Error on every rank.
void save_checkpoint(const std::string& dir, const TrainOptions& opt, Communicator& comm, int64_t steps_done,
                     const std::vector<TrainedTensor>& tensors);

// Collective: reads this rank's file into the masters and moments (and the working copies), checks
// that it was written by a run of the same shape, world, rank, data and seed, and that every rank
// resumes at the same step; any failure raises Error on every rank. Returns the steps done.
int64_t load_checkpoint(const std::string& dir, const TrainOptions& opt, Communicator& comm,
                        std::vector<TrainedTensor>& tensors);

// Raises on every rank when `local_error` is non-empty on any: that rank its own message, the others
// "rank R failed to <what>" (R the lowest failing rank). Collective (one allreduce_max_i64).
void agree_or_throw(Communicator& comm, const std::string& local_error, const std::string& what);

}  // namespace epmoe::train
