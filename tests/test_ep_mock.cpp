// The EP forward on mock ranks (threads), world in {1, 2, 4, 8}, checked against the dense
// reference with exact origin checks on every dispatched row (tests/ep_case.h).
#include <gtest/gtest.h>

#include "comm/mock_comm.h"
#include "ep_case.h"

namespace epmoe::test {
namespace {

using RK = RoutingKind;

EpCase make_case(int world, int E, int k, int hidden, int ffn, int64_t T, RK routing, int focus = 0) {
  return make_ep_case(world, E, k, hidden, ffn, T, routing, focus, uint64_t(world * 1000 + E * 10 + k));
}

void run_on_mock_ranks(const EpCase& c) {
  auto run = [&](int, std::shared_ptr<Communicator> comm) { run_ep_case_cpu(c, comm); };
  report_rank_errors(run_mock_ranks(c.world, run), c.name());
}

class EpMock : public ::testing::TestWithParam<EpCase> {};
TEST_P(EpMock, MatchesReferenceWithExactOrigins) { run_on_mock_ranks(GetParam()); }

// Shapes cover hidden {128, 2048}, ffn {128, 768, 1024}, E {8, 32, 128}, k {1, 2, 4, 8} across
// worlds 1..8; the large-hidden ones use few tokens so the fp64 reference stays quick.
INSTANTIATE_TEST_SUITE_P(
    Shapes, EpMock,
    ::testing::Values(make_case(1, 8, 2, 128, 128, 64, RK::uniform), make_case(2, 8, 2, 128, 128, 64, RK::uniform),
                      make_case(4, 32, 4, 128, 768, 96, RK::uniform), make_case(8, 32, 8, 128, 128, 64, RK::uniform),
                      make_case(8, 128, 8, 128, 128, 96, RK::zipf), make_case(1, 128, 8, 128, 1024, 48, RK::zipf),
                      make_case(4, 32, 4, 2048, 1024, 6, RK::uniform), make_case(2, 8, 1, 2048, 768, 16, RK::uniform),
                      make_case(8, 8, 1, 128, 128, 64, RK::uniform), make_case(2, 32, 4, 128, 128, 2048, RK::uniform)),
    [](const auto& info) { return info.param.name(); });

INSTANTIATE_TEST_SUITE_P(
    Routing, EpMock,
    ::testing::Values(make_case(4, 8, 2, 128, 128, 64, RK::one_expert, 5),   // every token to one expert
                      make_case(4, 32, 4, 128, 128, 64, RK::local_only, 0),  // ranks 1-3's experts get nothing
                      make_case(4, 32, 4, 128, 128, 64, RK::with_drops),     // scattered -1 and all -1 rows
                      make_case(2, 8, 2, 128, 128, 32, RK::all_dropped),     // nothing is sent at all
                      make_case(4, 32, 4, 128, 768, 128, RK::zipf), make_case(8, 32, 4, 128, 128, 1, RK::uniform)),
    [](const auto& info) { return info.param.name() + "_T" + std::to_string(info.param.tokens_of(0)); });

TEST(EpMockEdge, RankWithZeroTokens) {
  EpCase c = make_case(4, 32, 4, 128, 128, 0, RK::uniform);
  c.tokens = {64, 0, 33, 1};
  run_on_mock_ranks(c);
}

TEST(EpMockEdge, AllRanksZeroTokens) {
  EpCase c = make_case(2, 8, 2, 128, 128, 0, RK::uniform);
  run_on_mock_ranks(c);
}

TEST(EpMockEdge, UnevenTokensZipf) {
  EpCase c = make_case(8, 128, 8, 128, 128, 0, RK::zipf);
  c.tokens = {1, 200, 0, 17, 64, 3, 128, 5};
  run_on_mock_ranks(c);
}

// hidden and ffn multiples of 16 but not of 128 (the CPU engine takes them; kDimAlignment).
TEST(EpMockEdge, DimsMultipleOf16) {
  for (const auto& [H, F] : {std::pair{144, 80}, std::pair{16, 16}, std::pair{272, 48}}) {
    EpCase c = make_case(2, 8, 2, H, F, 40, RK::zipf);
    run_on_mock_ranks(c);
  }
}

// Different token counts and seeds through the same code paths.
TEST(EpMockEdge, SeveralSizes) {
  for (int64_t T : {64, 300, 5}) {
    EpCase c = make_case(4, 32, 4, 128, 128, T, RK::uniform);
    c.seed = 77 + T;
    run_on_mock_ranks(c);
  }
}

}  // namespace
}  // namespace epmoe::test
