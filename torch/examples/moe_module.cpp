// README "From PyTorch" (C++): two mock ranks on threads, one training step of the layer.
#include <epmoe/torch.h>
#include <iostream>
#include <thread>

int main() {
  auto comms = epmoe::make_mock_world(2);  // or epmoe::make_mpi_communicator() under mpirun
  auto rank = [&](int r) {
    torch::manual_seed(r);
    epmoe::MoeConfig cfg{.num_experts = 8, .top_k = 2, .hidden = 256, .ffn = 256, .world_size = 2, .rank = r};
    epmoe::torch_ext::Moe moe(cfg, comms[r]);
    torch::nn::Linear router(256, 8);
    torch::optim::SGD opt({moe->w1, moe->w2, router->weight, router->bias}, 1e-2);
    auto x = torch::randn({64, 256}).to(torch::kBFloat16);
    auto [weights, ids] = torch::topk(torch::softmax(router(x.to(torch::kFloat)), -1), 2);
    auto loss = moe(x, ids, weights).to(torch::kFloat).pow(2).mean();
    loss.backward();  // grads reach w1, w2 and, through topk_weights, the router
    opt.step();
    std::cout << "rank " << r << ": loss " << loss.item<float>() << "\n";
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join(), t1.join();
}
