// One EP forward case run on one rank, with every check the protocol promises: each received row
// came from the right (source rank, token) bit for bit, with the right local experts and weights;
// each source sent a token once per destination (deduplicated rows); the output matches the dense
// reference within the stated tolerance. Shared by the mock-rank, MPI and GPU suites.
#pragma once
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "epmoe/communicator.h"
#include "epmoe/moe_layer.h"
#include "test_support.h"

namespace epmoe::test {

struct EpCase {
  int E = 8, k = 2, hidden = 128, ffn = 128, world = 1;
  std::vector<int64_t> tokens;  // per rank; empty: 64 on every rank
  RoutingKind routing = RoutingKind::uniform;
  int focus = 0;                // expert (one_expert) or rank (local_only)
  uint64_t seed = 1;
  Tolerance tol = kCpuTolerance;
  int64_t tokens_of(int rank) const { return tokens.empty() ? 64 : tokens[rank]; }
  std::string name() const;
};

// Every rank gets T tokens; the seed is the caller's, so each suite keeps its own data.
EpCase make_ep_case(int world, int E, int k, int hidden, int ffn, int64_t T, RoutingKind routing, int focus,
                    uint64_t seed);

inline void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name(); }

Routing routing_of(const EpCase& c, int rank);

struct EpRankReport {
  int64_t rows_received = 0;
  int64_t rows_sent = 0;
  ForwardStats stats;
};

// Builds the layer on `comm` (cpu weights: CPU engine), runs one forward and checks it with gtest
// assertions (thread-safe). Returns the stats for further checks.
EpRankReport run_ep_case_cpu(const EpCase& c, std::shared_ptr<Communicator> comm);

}  // namespace epmoe::test
