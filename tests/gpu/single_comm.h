// The single-rank NCCL communicator the 1-GPU layer suites share: made on first use, released by
// release_single_comm() in each suite's TearDownTestSuite (before exit, not in a static destructor
// after the CUDA runtime may be gone).
#pragma once
#include <memory>

#include "epmoe/nccl_communicator.h"

namespace epmoe::test {

inline std::shared_ptr<Communicator>& single_comm_slot() {
  static std::shared_ptr<Communicator> comm;
  return comm;
}
inline std::shared_ptr<Communicator> single_comm() {
  if (!single_comm_slot()) single_comm_slot() = make_nccl_communicator_single();
  return single_comm_slot();
}
inline void release_single_comm() { single_comm_slot().reset(); }

}  // namespace epmoe::test
