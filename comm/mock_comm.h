// Mock ranks: a world of N communicators for N threads of one process (make_mock_world, declared
// in epmoe/communicator.h). Collectives are rendezvous over shared memory, so the whole EP
// protocol runs and is tested on a CPU without MPI.
//
// Failure model: a collective that cannot complete (a rank missing past the deadline, ranks
// calling different collectives, inconsistent alltoallv sizes, an abort) raises an epmoe::Error
// on every rank of that round, and the world stays failed: every later collective on it throws at
// once. A world is for one run; make a new one after a failure.
#pragma once
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "epmoe/build_config.h"
#include "epmoe/communicator.h"

namespace epmoe {

// Mock ranks on ONE GPU (comm/device_mock_comm.cpp, CUDA builds): a world of N device
// communicators for N threads, each rank's collectives ordered on its own stream (set_stream), the
// blocks moved by device-to-device copies on the receiver's stream after the sender's stream
// reached the collective (events), so the GPU engine's whole EP protocol runs at world sizes > 1 on
// one device. The rendezvous and its failure model are the host mock's. Not capturable in a CUDA
// graph (the rendezvous is on the host).
#if EPMOE_WITH_CUDA
std::vector<std::shared_ptr<Communicator>> make_device_mock_world(int world_size, int device,
                                                                  double deadline_seconds = 60.0);
#endif

// Fails the world that `any_rank_of_world` belongs to: ranks waiting in a collective (and any
// that enter one later) throw Error(comm_error, "... mock world aborted: <why>"). For harnesses:
// when a rank thread fails outside a collective, its peers would otherwise wait for the deadline.
// A round that every rank already reached still completes (peers may be copying from its
// buffers). Throws Error(invalid_argument) if the communicator is not a mock one.
void mock_world_abort(Communicator& any_rank_of_world, const std::string& why);

// what() of a captured exception ("unknown exception" for non-std ones; "" for null).
std::string describe_exception(const std::exception_ptr& e);

// Runs fn(rank, std::shared_ptr<Communicator>) on `world` threads over a fresh mock world and
// joins them all. The threads share one fn (called concurrently, not copied). Returns one exception_ptr per rank (null where fn returned normally). The first
// rank to fail aborts the world, so no rank waits out the deadline because a peer died.
template <class F>
std::vector<std::exception_ptr> run_mock_ranks(int world, F fn, double deadline_seconds = 60.0) {
  std::vector<std::shared_ptr<Communicator>> comms = make_mock_world(world, deadline_seconds);
  std::vector<std::exception_ptr> errors(comms.size());
  std::vector<std::thread> threads;
  threads.reserve(comms.size());
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&fn, &comms, &errors, r] {
      try {
        fn(r, comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
        mock_world_abort(*comms[r], "rank " + std::to_string(r) + " failed: " + describe_exception(errors[r]));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

}  // namespace epmoe
