// epmoe_train: the training-step program. A router (fp32) and the expert-parallel MoE module
// (bf16 experts, sharded across ranks) trained by AdamW with fp32 masters onto a fixed random
// teacher MoE (train_model.h has the task, train_loop.h the step, train_checkpoint.h the files).
//   mpirun -np N epmoe_train [...]    one rank per process: NCCL and CUDA tensors when the process
//                                     has a GPU (device from LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_RANK),
//                                     else MPI on CPU
//   epmoe_train --mock-ranks N [...]  N ranks as threads of this process, CPU
// Rank 0 prints a progress line every --log-every steps and a final "# final step=..." line.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/mock_comm.h"
#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "train_loop.h"
#if EPMOE_WITH_MPI
#include <mpi.h>

#include "epmoe/mpi_communicator.h"
#endif
#if EPMOE_WITH_NCCL
#include "epmoe/nccl_communicator.h"
#endif

namespace {

using namespace epmoe;
using epmoe::train::TrainOptions;

struct Args {
  TrainOptions train;
  int mock_ranks = 0;           // 0: MPI ranks when launched by mpirun, else one rank
  std::string device = "auto";  // auto | cpu | cuda
  int cpu_threads = 0;          // 0: the cores / ranks on this host
};

void usage() {
  std::puts(
      "usage: epmoe_train [--mock-ranks N] [--device auto|cpu|cuda]\n"
      "                   [--tokens T] [--hidden H] [--ffn F] [--experts E] [--topk K] [--input-dim D]\n"
      "                   [--steps N] [--seed S] [--lr LR] [--weight-decay WD] [--beta1 B1] [--beta2 B2] [--eps EPS]\n"
      "                   [--log-every N] [--json PATH] [--save DIR] [--load DIR] [--cpu-threads N]\n"
      "  --tokens: per rank per step (default 1024); defaults hidden 256, ffn 128, experts 16, topk 2,\n"
      "  input-dim 8 (the data's subspace), steps 150, seed 2026, lr 3e-3, weight-decay 0.01, betas 0.9/0.95,\n"
      "  eps 1e-8, log-every 10. --steps is the last step's number: a run resumed with --load DIR continues\n"
      "  up to it. --save DIR writes each rank's checkpoint at the end. --cpu-threads: torch and CPU-engine\n"
      "  threads per rank (default: cores / ranks on the host).\n"
      "Under mpirun: one rank per process (NCCL on GPUs when present, else MPI on CPU).");
}

// A flag's value, parsed whole ("12x" is an error, not 12).
template <class T>
T parse_value(const std::string& flag, const std::string& text) {
  size_t used = 0;
  T v{};
  try {
    if constexpr (std::is_same_v<T, double>) v = std::stod(text, &used);
    else if constexpr (std::is_same_v<T, uint64_t>) {
      if (!text.empty() && text[0] == '-') throw std::invalid_argument("negative");
      v = std::stoull(text, &used);
    } else {
      const long long x = std::stoll(text, &used);
      if (x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max()) throw std::out_of_range("range");
      v = T(x);
    }
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: ", flag, " '", text, "' is not a valid ",
               std::is_same_v<T, double> ? "number" : std::is_same_v<T, uint64_t> ? "unsigned integer" : "integer");
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  TrainOptions& t = a.train;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: ", k, " needs a value");
      return argv[++i];
    };
    if (k == "-h" || k == "--help") usage(), std::exit(0);
    else if (k == "--mock-ranks") a.mock_ranks = parse_value<int>(k, next());
    else if (k == "--device") a.device = next();
    else if (k == "--tokens") t.tokens = parse_value<int64_t>(k, next());
    else if (k == "--hidden") t.hidden = parse_value<int>(k, next());
    else if (k == "--ffn") t.ffn = parse_value<int>(k, next());
    else if (k == "--experts") t.experts = parse_value<int>(k, next());
    else if (k == "--topk") t.top_k = parse_value<int>(k, next());
    else if (k == "--input-dim") t.input_dim = parse_value<int>(k, next());
    else if (k == "--steps") t.steps = parse_value<int64_t>(k, next());
    else if (k == "--seed") t.seed = parse_value<uint64_t>(k, next());
    else if (k == "--lr") t.lr = parse_value<double>(k, next());
    else if (k == "--weight-decay") t.weight_decay = parse_value<double>(k, next());
    else if (k == "--beta1") t.beta1 = parse_value<double>(k, next());
    else if (k == "--beta2") t.beta2 = parse_value<double>(k, next());
    else if (k == "--eps") t.eps = parse_value<double>(k, next());
    else if (k == "--log-every") t.log_every = parse_value<int64_t>(k, next());
    else if (k == "--json") t.json_path = next();
    else if (k == "--save") t.save_dir = next();
    else if (k == "--load") t.load_dir = next();
    else if (k == "--cpu-threads") a.cpu_threads = parse_value<int>(k, next());
    else EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: unknown argument '", k, "' (see --help)");
  }
  if (a.device != "auto" && a.device != "cpu" && a.device != "cuda")
    EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: --device must be auto, cpu or cuda (got '", a.device, "')");
  if (a.mock_ranks < 0) EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: --mock-ranks must be >= 1");
  if (a.cpu_threads < 0) EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: --cpu-threads must be >= 1");
  return a;
}

// Whether this process should compute on a GPU: torch has CUDA and sees one, and the build has
// NCCL (the GPU engine's transport). --device cuda without them is an error; auto falls back to CPU.
bool want_gpu(const std::string& device) {
  bool possible = EPMOE_WITH_NCCL && torch::cuda::is_available();
  if (device == "cuda" && !possible)
    EPMOE_FAIL(ErrorCode::unsupported, "epmoe_train: --device cuda, but ",
               EPMOE_WITH_NCCL ? "torch sees no CUDA device (or was built without CUDA)" : "this build has no NCCL");
  return device != "cpu" && possible;
}

// torch's intra-op threads and the CPU engine's threads per rank: the host's cores shared by the
// ranks on it (the ranks themselves are the parallelism). Fixed for a run: CPU results, and so
// bit-exact resumption, depend on it.
int threads_per_rank(int requested, int ranks_on_host) {
  if (requested > 0) return requested;
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_on_host));
}

int run_mock(Args& a) {
  const int n = std::max(1, a.mock_ranks);
  const bool gpu = a.device != "cpu" && n == 1 && want_gpu(a.device);
  if (a.device == "cuda" && n > 1)
    EPMOE_FAIL(ErrorCode::invalid_argument, "epmoe_train: mock ranks run on the CPU; for GPUs use mpirun -np N");
  train::validate_options(a.train, n);  // before any rank starts: one clear message
  a.train.cpu_threads = threads_per_rank(a.cpu_threads, n);
  torch::set_num_threads(a.train.cpu_threads);
  if (gpu) {
#if EPMOE_WITH_NCCL
    const int dev = select_local_device();
    NcclCommOptions nopt;
    nopt.device = dev;
    train::run_training(a.train, make_nccl_communicator_single(nopt), at::Device(at::kCUDA, dev),
                        {"1 GPU (NCCL, world 1)", stdout});
#endif
    return 0;
  }
  const std::string backend = n == 1 ? "1 rank on CPU" : "mock ranks on CPU";
  const auto errors = run_mock_ranks(n, [&](int, std::shared_ptr<Communicator> comm) {
    train::run_training(a.train, comm, at::Device(at::kCPU), {backend, stdout});
  });
  // One line per rank that failed; one line when they all failed alike (an agreed error).
  std::vector<std::string> what;
  for (int r = 0; r < n; ++r)
    if (errors[r]) what.push_back(describe_exception(errors[r]));
  if (what.empty()) return 0;
  const bool alike = std::all_of(what.begin(), what.end(), [&](const std::string& w) { return w == what[0]; });
  if (int(what.size()) == n && alike)
    std::fprintf(stderr, "epmoe_train: every rank: %s\n", what[0].c_str());
  else
    for (int r = 0; r < n; ++r)
      if (errors[r]) std::fprintf(stderr, "epmoe_train: rank %d: %s\n", r, describe_exception(errors[r]).c_str());
  return 2;
}

#if EPMOE_WITH_MPI
int run_mpi(int& argc, char**& argv, Args& a) {
  MPI_Init(&argc, &argv);
  int me = 0, W = 1, on_host = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  MPI_Comm host;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &host);
  MPI_Comm_size(host, &on_host);
  MPI_Comm_free(&host);
  // Bad options: every rank finds the same error before any collective, prints it and leaves cleanly.
  bool gpu = false;
  try {
    gpu = want_gpu(a.device);
    train::validate_options(a.train, W);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_train: rank %d: %s\n", me, e.what());
    MPI_Finalize();
    return 2;
  }
  a.train.cpu_threads = threads_per_rank(a.cpu_threads, on_host);
  if (!gpu) torch::set_num_threads(a.train.cpu_threads);
  try {
    std::shared_ptr<Communicator> comm;
    at::Device device(at::kCPU);
#if EPMOE_WITH_NCCL
    if (gpu) {
      NcclCommOptions nopt;
      nopt.device = select_local_device();
      comm = make_nccl_communicator_from_mpi(MPI_COMM_WORLD, nopt);
      device = at::Device(at::kCUDA, nopt.device);
    }
#endif
    if (!comm) comm = make_mpi_communicator(MPI_COMM_WORLD);
    train::run_training(a.train, comm, device, {gpu ? "NCCL on GPUs" : "MPI on CPU", stdout});
  } catch (const train::AgreedError& e) {
    // Raised on every rank alike: nobody waits in a collective, leave cleanly.
    std::fprintf(stderr, "epmoe_train: rank %d: %s\n", me, e.what());
    MPI_Finalize();
    return 2;
  } catch (const std::exception& e) {
    // Past this point a failure may be this rank's alone, with peers inside a collective: abort
    // the job rather than leave them waiting.
    std::fprintf(stderr, "epmoe_train: rank %d: %s\n", me, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  }
  MPI_Finalize();
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    // Every process parses the same argv, so under mpirun every rank says this and exits.
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  // Launched by mpirun (its environment, not a knob): one rank per process.
  const bool under_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE");
  try {
    if (under_mpi && a.mock_ranks == 0) {
#if EPMOE_WITH_MPI
      return run_mpi(argc, argv, a);
#else
      EPMOE_FAIL(ErrorCode::unsupported, "epmoe_train: launched by mpirun but this build has no MPI");
#endif
    }
    return run_mock(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
