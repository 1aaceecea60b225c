// epmoe_train's loop (src/programs/train_loop.h) on CPU mock ranks:
//   - at the default shape, 4 ranks: the loss after 50 steps is below half the first step's, and
//     every rank logs the same (all-reduced) losses; the JSON log is written;
//   - 20 steps straight vs 10 + save + load + 10: the same loss at step 20, bit for bit, and the
//     same checkpoint (masters, moments) at step 20; the replicated router identical on all ranks;
//   - a checkpoint of another shape or world size fails every rank with the same kind of error (no
//     hang), and the router all-reduce is the mean in rank order.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "comm/mock_comm.h"
#include "posix_files.h"
#include "train_checkpoint.h"
#include "train_loop.h"

namespace epmoe::train {
namespace {

// A fresh path under the test's temporary directory, removed when the test ends.
std::vector<std::string>& temp_paths() {
  static std::vector<std::string> paths;
  return paths;
}
std::string temp_dir(const std::string& name) {
  const std::string p = files::join(::testing::TempDir(), "epmoe_train_" + std::to_string(getpid()) + "_" + name);
  files::remove_tree(p);
  temp_paths().push_back(p);
  return p;
}
class Train : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const std::string& p : temp_paths()) files::remove_tree(p);
    temp_paths().clear();
  }
};

// Runs the loop on `world` mock ranks; returns every rank's result (throws the first rank error).
std::vector<TrainResult> train_on_mock_ranks(const TrainOptions& opt, int world) {
  std::vector<TrainResult> results(static_cast<size_t>(world));
  const auto errors = run_mock_ranks(world, [&](int r, std::shared_ptr<Communicator> comm) {
    results[size_t(r)] = run_training(opt, comm, at::Device(at::kCPU), {"mock ranks on CPU (test)", nullptr});
  });
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

TrainOptions small_shape() {
  TrainOptions o;
  o.tokens = 128, o.hidden = 128, o.ffn = 128, o.experts = 8, o.top_k = 2;
  o.log_every = 5;
  return o;
}

TEST_F(Train, LossHalvesIn50StepsAtTheDefaultShape) {
  TrainOptions opt;  // the program's defaults
  opt.steps = 50;
  opt.log_every = 10;
  opt.json_path = temp_dir("learn.json");
  const std::vector<TrainResult> rs = train_on_mock_ranks(opt, 4);
  const TrainResult& r = rs[0];
  ASSERT_EQ(r.first_step, 1);
  ASSERT_GE(r.log.size(), 2u);
  ASSERT_EQ(r.log.front().step, 1);
  ASSERT_EQ(r.log.back().step, 50);
  const double first = r.log.front().loss, last = r.log.back().loss;
  std::printf("loss: step 1 %.6e, step 50 %.6e (ratio %.3f)\n", first, last, last / first);
  EXPECT_TRUE(std::isfinite(first) && first > 0);
  EXPECT_LT(last, 0.5 * first) << "the loss did not halve in 50 steps";
  for (size_t k = 1; k < rs.size(); ++k) {
    ASSERT_EQ(rs[k].log.size(), r.log.size());
    for (size_t i = 0; i < r.log.size(); ++i)
      EXPECT_EQ(rs[k].log[i].loss, r.log[i].loss) << "rank " << k << " logs another loss at step " << r.log[i].step;
  }
  std::ifstream f(opt.json_path);
  ASSERT_TRUE(f.good()) << opt.json_path;
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_NE(text.str().find("\"log\": ["), std::string::npos);
  EXPECT_NE(text.str().find("\"step\": 50,"), std::string::npos);
}

// All tensors of a checkpoint file, by name.
std::map<std::string, at::Tensor> read_checkpoint(const std::string& path) {
  torch::serialize::InputArchive a;
  a.load_from(path);
  std::map<std::string, at::Tensor> out;
  for (const std::string& k : a.keys()) {
    at::Tensor t;
    a.read(k, t);
    out[k] = t;
  }
  return out;
}

TEST_F(Train, SaveLoadResumesBitForBit) {
  const int W = 4;
  TrainOptions straight = small_shape();
  straight.steps = 20;
  straight.save_dir = temp_dir("straight");
  const TrainResult a = train_on_mock_ranks(straight, W)[0];

  TrainOptions first_half = small_shape();
  first_half.steps = 10;
  first_half.save_dir = temp_dir("half");
  (void)train_on_mock_ranks(first_half, W);
  TrainOptions second_half = small_shape();
  second_half.steps = 20;
  second_half.load_dir = first_half.save_dir;
  second_half.save_dir = temp_dir("resumed");
  const TrainResult b = train_on_mock_ranks(second_half, W)[0];

  ASSERT_EQ(b.first_step, 11);
  ASSERT_EQ(a.log.back().step, 20);
  ASSERT_EQ(b.log.back().step, 20);
  std::printf("loss at step 20: straight %.9e, resumed %.9e\n", a.log.back().loss, b.log.back().loss);
  EXPECT_EQ(a.log.back().loss, b.log.back().loss) << "the resumed run's loss differs at step 20";
  EXPECT_LT(a.log.back().loss, a.log.front().loss);

  at::Tensor router0;
  for (int r = 0; r < W; ++r) {
    const auto ta = read_checkpoint(checkpoint_path(straight.save_dir, r, W));
    const auto tb = read_checkpoint(checkpoint_path(second_half.save_dir, r, W));
    ASSERT_EQ(ta.size(), tb.size());
    ASSERT_EQ(ta.size(), 1u + 4 * 3);  // meta + (master, m, v) of router_w, router_b, w1, w2
    for (const auto& [name, t] : ta) {
      ASSERT_TRUE(tb.count(name)) << name;
      EXPECT_TRUE(torch::equal(t, tb.at(name))) << "rank " << r << ": " << name << " differs after resuming";
    }
    // The replicated router: the same bits on every rank.
    if (r == 0) router0 = ta.at("router_w.master");
    else EXPECT_TRUE(torch::equal(router0, ta.at("router_w.master"))) << "rank " << r << "'s router diverged";
  }
}

TEST_F(Train, ForeignCheckpointFailsEveryRank) {
  TrainOptions save = small_shape();
  save.steps = 2;
  save.save_dir = temp_dir("foreign");
  (void)train_on_mock_ranks(save, 2);

  auto failures_of = [](const TrainOptions& opt, int world) {
    std::vector<std::string> what(static_cast<size_t>(world));
    const auto errors = run_mock_ranks(world, [&](int r, std::shared_ptr<Communicator> comm) {
      try {
        (void)run_training(opt, comm, at::Device(at::kCPU), {"test", nullptr});
      } catch (const AgreedError& e) {
        what[size_t(r)] = e.what();
      }
    });
    for (int r = 0; r < world; ++r) EXPECT_FALSE(errors[size_t(r)]) << describe_exception(errors[size_t(r)]);
    return what;
  };
  TrainOptions other_shape = small_shape();
  other_shape.steps = 4;
  other_shape.ffn = 256;
  other_shape.load_dir = save.save_dir;
  for (const std::string& w : failures_of(other_shape, 2))
    EXPECT_NE(w.find("written with ffn 128"), std::string::npos) << w;

  TrainOptions other_world = small_shape();
  other_world.steps = 4;
  other_world.load_dir = save.save_dir;
  for (const std::string& w : failures_of(other_world, 4)) EXPECT_NE(w.find("no such file"), std::string::npos) << w;
}

TEST_F(Train, AllreduceMeanIsTheRankOrderMean) {
  const int W = 3;
  std::vector<at::Tensor> out(W);
  const auto errors = run_mock_ranks(W, [&](int r, std::shared_ptr<Communicator> comm) {
    at::Tensor t = at::arange(5, at::kFloat) + float(10 * r);
    allreduce_mean(*comm, t);
    out[size_t(r)] = t;
  });
  for (const auto& e : errors) ASSERT_FALSE(e) << describe_exception(e);
  const at::Tensor want = at::arange(5, at::kFloat) + 10.f;  // (0 + 10 + 20) / 3
  for (int r = 0; r < W; ++r) EXPECT_TRUE(torch::equal(out[size_t(r)], want)) << "rank " << r << ": " << out[size_t(r)];
}

}  // namespace
}  // namespace epmoe::train
