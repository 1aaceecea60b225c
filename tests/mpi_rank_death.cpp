// A rank that dies in the middle of a training step under mpirun (issue 49 item 4, MPI part): the
// last rank's communicator calls _exit(3) at its PHASE-th collective after the layer's construction
// (0 count exchange, 1 mid-dispatch, 2 mid-combine, 3 backward status, 4 backward dy dispatch, 5
// backward combine). mpirun then ends the job: ctest (tests/CMakeLists.txt) passes when the output
// shows the death and mpirun's non-zero exit, within the test's timeout - no process hangs - and
// fails if any survivor prints that its step returned (a silent answer after a peer's death).
//   mpirun -np W mpi_rank_death PHASE
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/moe_layer.h"
#include "epmoe/mpi_communicator.h"
#include "hooked_communicator.h"
#include "test_support.h"

namespace {

using namespace epmoe;
using namespace epmoe::test;

// Forwards to `inner`, but exits the process at its `die_at`-th collective.
class DyingCommunicator final : public HookedCommunicator {
 public:
  DyingCommunicator(std::shared_ptr<Communicator> inner, int die_at)
      : HookedCommunicator(std::move(inner)), die_at_(die_at) {}

 private:
  void before(const char* what) override {
    if (calls_++ != die_at_) return;
    std::printf("rank %d: dying in %s\n", rank(), what);
    std::fflush(stdout);
    _exit(3);
  }
  int calls_ = 0;
  const int die_at_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int phase = argc > 1 ? std::atoi(argv[1]) : 1;
  int me = 0, W = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  constexpr int k = 2, H = 128, F = 128;
  const int E = 2 * W, El = 2;
  constexpr int64_t T = 16;
  std::shared_ptr<Communicator> comm = make_mpi_communicator(MPI_COMM_WORLD, 120.0);
  // +1: the construction's configuration agreement is the first collective.
  if (me == W - 1) comm = std::make_shared<DyingCommunicator>(comm, 1 + phase);
  const ModelWeights M = make_weights(E, H, F, 671);
  const size_t n1 = size_t(2) * F * H, n2 = size_t(H) * F;
  std::vector<bf16> w1(M.w1.begin() + me * El * n1, M.w1.begin() + (me + 1) * El * n1);
  std::vector<bf16> w2(M.w2.begin() + me * El * n2, M.w2.begin() + (me + 1) * El * n2);
  const MoeConfig cfg{.num_experts = E, .top_k = k, .hidden = H, .ffn = F, .world_size = W, .rank = me};
  MoeLayer layer(cfg,
                 {TensorView::contiguous(w1.data(), DType::bf16, {El, 2 * F, H}),
                  TensorView::contiguous(w2.data(), DType::bf16, {El, H, F})},
                 comm);
  std::vector<bf16> x = make_x(672, me, T, H), y(size_t(T) * H), dy(size_t(T) * H, bf16(0.5f)), dx(size_t(T) * H);
  const Routing R = make_routing(T, E, k, RoutingKind::uniform, mix(673, me), 0, W);
  std::vector<float> dw(size_t(T) * k), dw1(w1.size()), dw2(w2.size());
  auto tv = [](void* p, DType t, std::initializer_list<int64_t> s) { return TensorView::contiguous(p, t, s); };
  try {
    MoeForwardContext ctx;
    layer.forward(tv(x.data(), DType::bf16, {T, H}), tv(const_cast<int32_t*>(R.ids.data()), DType::i32, {T, k}),
                  tv(const_cast<float*>(R.weights.data()), DType::f32, {T, k}), tv(y.data(), DType::bf16, {T, H}),
                  nullptr, &ctx);
    layer.backward(ctx, tv(dy.data(), DType::bf16, {T, H}), tv(dx.data(), DType::bf16, {T, H}),
                   tv(dw.data(), DType::f32, {T, k}),
                   {tv(dw1.data(), DType::f32, {El, 2 * F, H}), tv(dw2.data(), DType::f32, {El, H, F}), false});
    std::printf("rank %d: the step returned after a peer's death\n", me);
  } catch (const Error& e) {
    std::printf("rank %d: raised %s\n", me, e.what());  // (also acceptable: the deadline passed first)
  }
  std::fflush(stdout);
  MPI_Finalize();
  return 0;
}
