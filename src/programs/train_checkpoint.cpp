// epmoe_train's checkpoints (train_checkpoint.h).
#include "train_checkpoint.h"

#include <cstring>
#include <exception>
#include <stdexcept>

#include "epmoe/error.h"
#include "posix_files.h"

namespace epmoe::train {

namespace {

// The reason a file cannot be used, caught below and agreed on by all ranks.
template <class... A>
[[noreturn]] void fail(const A&... parts) {
  throw std::runtime_error(detail::concat(parts...));
}

std::vector<int64_t> meta_of(const TrainOptions& o, int rank, int world, int64_t steps_done) {
  int64_t seed_bits = 0;
  std::memcpy(&seed_bits, &o.seed, sizeof seed_bits);
  return {kCheckpointFormat, steps_done, world, rank, o.experts, o.top_k, o.hidden, o.ffn,
          o.input_dim, o.tokens, seed_bits};
}

const char* const kMetaNames[kMetaWords] = {"format", "steps done", "world size", "rank", "experts", "topk",
                                            "hidden", "ffn", "input-dim", "tokens", "seed"};

}  // namespace

std::string checkpoint_path(const std::string& dir, int rank, int world) {
  return files::join(dir, "rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt");
}

void agree_or_throw(Communicator& comm, const std::string& local_error, const std::string& what) {
  const int W = comm.world_size(), me = comm.rank();
  // max over ranks of (W - rank) where failed: the lowest failing rank.
  int64_t flag = local_error.empty() ? 0 : int64_t(W - me);
  comm.allreduce_max_i64(&flag, 1);
  if (flag == 0) return;
  if (!local_error.empty()) throw AgreedError(ErrorCode::invalid_argument, local_error);
  throw AgreedError(ErrorCode::remote_error, detail::concat("rank ", W - flag, " failed to ", what));
}

void save_checkpoint(const std::string& dir, const TrainOptions& opt, Communicator& comm, int64_t steps_done,
                     const std::vector<TrainedTensor>& tensors) {
  const int me = comm.rank(), W = comm.world_size();
  const std::string path = checkpoint_path(dir, me, W);
  std::string error;
  try {
    files::make_dirs(dir);
    torch::serialize::OutputArchive archive;
    archive.write("meta", torch::tensor(meta_of(opt, me, W, steps_done), torch::kLong));
    for (const TrainedTensor& t : tensors) {
      archive.write(t.name + ".master", t.master.detach().to(at::kCPU));
      archive.write(t.name + ".m", t.m.to(at::kCPU));
      archive.write(t.name + ".v", t.v.to(at::kCPU));
    }
    // A crash mid-write leaves the previous checkpoint intact.
    const std::string tmp = path + ".tmp";
    archive.save_to(tmp);
    files::rename(tmp, path);
  } catch (const std::exception& e) {
    error = "cannot save the checkpoint " + path + ": " + e.what();
  }
  agree_or_throw(comm, error, "save its checkpoint in " + dir);
}

int64_t load_checkpoint(const std::string& dir, const TrainOptions& opt, Communicator& comm,
                        std::vector<TrainedTensor>& tensors) {
  const int me = comm.rank(), W = comm.world_size();
  const std::string path = checkpoint_path(dir, me, W);
  std::string error;
  int64_t steps_done = -1;
  try {
    if (!files::exists(path)) fail("no such file (is ", dir, " a checkpoint of world size ", W, "?)");
    torch::serialize::InputArchive archive;
    archive.load_from(path, at::kCPU);
    at::Tensor meta;
    archive.read("meta", meta);
    if (meta.scalar_type() != at::kLong || meta.numel() != kMetaWords)
      fail("not an epmoe_train checkpoint (meta has ", meta.numel(), " words)");
    const std::vector<int64_t> want = meta_of(opt, me, W, 0);
    for (int i = 0; i < kMetaWords; ++i) {
      if (i == 1) continue;  // steps done
      const int64_t got = meta[i].item<int64_t>();
      if (got != want[size_t(i)])
        fail("written with ", kMetaNames[i], " ", got, ", this run has ", want[size_t(i)]);
    }
    steps_done = meta[1].item<int64_t>();
    torch::NoGradGuard no_grad;
    for (TrainedTensor& t : tensors) {
      const std::pair<const char*, at::Tensor*> parts[] = {{".master", &t.master}, {".m", &t.m}, {".v", &t.v}};
      for (auto [suffix, dst] : parts) {
        at::Tensor src;
        archive.read(t.name + suffix, src);
        if (src.sizes() != dst->sizes() || src.scalar_type() != dst->scalar_type())
          fail(t.name, suffix, " is ", src.sizes(), " ", src.scalar_type(), ", expected ", dst->sizes(), " ",
               dst->scalar_type());
        dst->copy_(src);
      }
      if (!t.working.is_same(t.master)) t.working.copy_(t.master);
    }
  } catch (const std::exception& e) {
    error = "cannot resume from " + path + ": " + e.what();
  }
  agree_or_throw(comm, error, "load its checkpoint from " + dir);
  // Every rank at the same step (files of one save): max(s) == -min(-s).
  int64_t range[2] = {steps_done, -steps_done};
  comm.allreduce_max_i64(range, 2);
  if (range[0] != -range[1])
    throw AgreedError(ErrorCode::invalid_argument, detail::concat("the checkpoint files in ", dir,
                                                                  " are of different steps (", -range[1], " .. ",
                                                                  range[0], "): not one save"));
  return steps_done;
}

}  // namespace epmoe::train
