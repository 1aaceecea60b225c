// A communicator that forwards every collective to another one after calling a hook with the
// collective's name: the fault-injecting decorators of the reliability tests (a rank that dies or
// stalls at its n-th collective) derive from it and override before().
#pragma once
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "epmoe/communicator.h"

namespace epmoe::test {

class HookedCommunicator : public Communicator {
 public:
  explicit HookedCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string name() const override { return inner_->name(); }
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  void alltoall_i64(const int64_t* s, int64_t* r, size_t n) override {
    before("alltoall_i64");
    inner_->alltoall_i64(s, r, n);
  }
  void alltoallv(std::span<const AlltoallvPlane> p) override {
    before("alltoallv");
    inner_->alltoallv(p);
  }
  void allreduce_max_i64(int64_t* v, size_t n) override {
    before("allreduce_max_i64");
    inner_->allreduce_max_i64(v, n);
  }
  void barrier() override {
    before("barrier");
    inner_->barrier();
  }
  Communicator& inner() { return *inner_; }

 protected:
  // Called before each collective is forwarded.
  virtual void before(const char* what) = 0;

 private:
  std::shared_ptr<Communicator> inner_;
};

}  // namespace epmoe::test
