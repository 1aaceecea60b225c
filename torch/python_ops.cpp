// The ops a Python (or any dispatcher) caller needs to make what the C++ API takes as objects:
// communicators and layers, both as integer handles (include/epmoe/torch.h).
//   mock_world(int world, float deadline_seconds) -> int[]   one communicator per mock rank (threads)
//   mpi_world() -> int                                       MPI_COMM_WORLD (initialises MPI if needed)
//   nccl_unique_id() -> Tensor                               uint8 [128], made on rank 0
//   nccl_world(Tensor unique_id, int rank, int world, int device, float deadline_seconds) -> int
//   comm_info(int comm) -> int[]                             [rank, world size]
//   release_comm(int comm) -> ()
//   create_layer(int comm, int num_experts, int top_k, int hidden, int ffn, Tensor w1, Tensor w2,
//                str save_policy, bool torch_allocator=True, bool deterministic=False,
//                int max_tokens_per_rank=0) -> int
//                                                            collective, like MoeLayer's constructor;
//                                                            CUDA weights: the layer's memory comes from
//                                                            torch's caching allocator unless
//                                                            torch_allocator is False; deterministic:
//                                                            LayerOptions::deterministic;
//                                                            max_tokens_per_rank > 0: moe_capturable
//                                                            (capturable_ops.cpp) up to that many rows
//   create_layer_fp8(..., Tensor w1, Tensor w1_scale, Tensor w2, Tensor w2_scale, bool torch_allocator=True,
//                int max_tokens_per_rank=0) -> int         an FP8 layer (MXFP8 or block-128 by the scales)
//   release_layer(int layer) -> ()
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "epmoe/build_config.h"
#include "epmoe/error.h"
#include "epmoe/torch.h"
#include "registry.h"
#if EPMOE_WITH_MPI
#include "epmoe/mpi_communicator.h"
#endif
#if EPMOE_WITH_NCCL
#include "epmoe/nccl_communicator.h"
#endif

namespace epmoe::torch_ext {
namespace {

Registry<Communicator>& comms() {
  static Registry<Communicator> r;
  return r;
}
int64_t add_comm(std::shared_ptr<Communicator> c) { return comms().add(std::move(c)); }
std::shared_ptr<Communicator> comm_of(int64_t h) { return comms().get(h, "communicator"); }

std::vector<int64_t> mock_world_op(int64_t world, double deadline) {
  EPMOE_CHECK(world > 0 && world <= 1024, ErrorCode::invalid_argument, "mock_world: world ", world);
  std::vector<int64_t> h;
  for (auto& c : make_mock_world(int(world), deadline)) h.push_back(add_comm(std::move(c)));
  return h;
}

int64_t mpi_world_op() {
#if EPMOE_WITH_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    });
  }
  return add_comm(make_mpi_communicator(MPI_COMM_WORLD));
#else
  EPMOE_FAIL(ErrorCode::unsupported, "mpi_world: this build of epmoe has no MPI");
#endif
}

std::vector<int64_t> comm_info_op(int64_t h) {
  const std::shared_ptr<Communicator> c = comm_of(h);
  return {c->rank(), c->world_size()};
}

// NCCL bootstrapped through the caller's channel (python/epmoe: a torch.distributed broadcast).
at::Tensor nccl_unique_id_op() {
#if EPMOE_WITH_NCCL
  const std::vector<uint8_t> id = make_nccl_unique_id();
  at::Tensor t = at::empty({int64_t(id.size())}, at::kByte);
  std::memcpy(t.data_ptr(), id.data(), id.size());
  return t;
#else
  EPMOE_FAIL(ErrorCode::unsupported, "nccl_unique_id: this build of epmoe has no NCCL");
#endif
}

int64_t nccl_world_op(const at::Tensor& unique_id, int64_t rank, int64_t world, int64_t device, double deadline) {
#if EPMOE_WITH_NCCL
  const at::Tensor u = unique_id.to(at::kCPU).to(at::kByte).contiguous();
  const std::vector<uint8_t> id(u.data_ptr<uint8_t>(), u.data_ptr<uint8_t>() + u.numel());
  NcclCommOptions opt;
  opt.device = int(device);
  opt.deadline_seconds = deadline;
  return add_comm(make_nccl_communicator_from_unique_id(id, int(rank), int(world), opt));
#else
  EPMOE_FAIL(ErrorCode::unsupported, "nccl_world: this build of epmoe has no NCCL");
#endif
}

void release_comm_op(int64_t h) { comms().remove(h); }

// The layer's config on communicator c (its rank and world size).
MoeConfig config_of(const Communicator& c, int64_t num_experts, int64_t top_k, int64_t hidden, int64_t ffn) {
  MoeConfig cfg;
  cfg.num_experts = int(num_experts), cfg.top_k = int(top_k), cfg.hidden = int(hidden), cfg.ffn = int(ffn);
  cfg.world_size = c.world_size(), cfg.rank = c.rank();
  return cfg;
}

int64_t create_layer_op(int64_t comm, int64_t num_experts, int64_t top_k, int64_t hidden, int64_t ffn,
                        const at::Tensor& w1, const at::Tensor& w2, c10::string_view save_policy,
                        bool torch_allocator, bool deterministic, int64_t max_tokens_per_rank) {
  const std::shared_ptr<Communicator> c = comm_of(comm);
  const MoeConfig cfg = config_of(*c, num_experts, top_k, hidden, ffn);
  LayerOptions opt;
  const std::string p(save_policy);
  EPMOE_CHECK(p == "preact" || p == "recompute", ErrorCode::invalid_argument,
              "create_layer: save_policy must be 'preact' or 'recompute', got '", p, "'");
  opt.save_policy = p == "preact" ? SavePolicy::rows_and_preactivation : SavePolicy::rows_recompute;
  if (w1.is_cuda() && torch_allocator) opt.device_allocator = torch_device_allocator();
  opt.deterministic = deterministic;
  opt.max_tokens_per_rank = max_tokens_per_rank;
  EPMOE_CHECK(w1.is_contiguous() && w2.is_contiguous(), ErrorCode::invalid_argument,
              "create_layer: w1 and w2 must be contiguous");
  return register_layer(std::make_shared<MoeLayer>(cfg, ExpertWeights{view_of(w1), view_of(w2)}, c, opt));
}

// An FP8 layer (inference) on fp8_weights_of's tensors: MXFP8 or block-128 by the scales' dtype.
int64_t create_layer_fp8_op(int64_t comm, int64_t num_experts, int64_t top_k, int64_t hidden, int64_t ffn,
                            const at::Tensor& w1, const at::Tensor& w1_scale, const at::Tensor& w2,
                            const at::Tensor& w2_scale, bool torch_allocator, int64_t max_tokens_per_rank) {
  const std::shared_ptr<Communicator> c = comm_of(comm);
  const MoeConfig cfg = config_of(*c, num_experts, top_k, hidden, ffn);
  LayerOptions opt;
  if (w1.is_cuda() && torch_allocator) opt.device_allocator = torch_device_allocator();
  opt.max_tokens_per_rank = max_tokens_per_rank;
  return register_layer(std::make_shared<MoeLayer>(cfg, fp8_weights_of(w1, w1_scale, w2, w2_scale), c, opt));
}

void release_layer_op(int64_t h) { release_layer(h); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(epmoe, m) {
  m.def("mock_world(int world, float deadline_seconds) -> int[]", mock_world_op);
  m.def("mpi_world() -> int", mpi_world_op);
  m.def("nccl_unique_id() -> Tensor", nccl_unique_id_op);
  m.def("nccl_world(Tensor unique_id, int rank, int world, int device, float deadline_seconds) -> int", nccl_world_op);
  m.def("comm_info(int comm) -> int[]", comm_info_op);
  m.def("release_comm(int comm) -> ()", release_comm_op);
  m.def("create_layer(int comm, int num_experts, int top_k, int hidden, int ffn, Tensor w1, Tensor w2, "
        "str save_policy, bool torch_allocator=True, bool deterministic=False, int max_tokens_per_rank=0) -> int",
        create_layer_op);
  m.def("create_layer_fp8(int comm, int num_experts, int top_k, int hidden, int ffn, Tensor w1, Tensor w1_scale, "
        "Tensor w2, Tensor w2_scale, bool torch_allocator=True, int max_tokens_per_rank=0) -> int",
        create_layer_fp8_op);
  m.def("release_layer(int layer) -> ()", release_layer_op);
}

}  // namespace epmoe::torch_ext
