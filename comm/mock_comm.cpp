// Mock ranks as threads, host buffers: the rendezvous world of comm/mock_world.h, copying with
// memcpy in its copy phase.
#include "comm/mock_comm.h"

#include "comm/mock_world.h"

namespace epmoe {
using mock::Arrival;
using mock::Collective;
using mock::MockWorld;
namespace {

// ---- one rank's communicator -----------------------------------------------------------------

class MockCommunicator final : public Communicator, public mock::MockRank {
 public:
  MockCommunicator(std::shared_ptr<MockWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_->size(); }
  std::string name() const override { return "mock"; }
  MemorySpace memory_space() const override { return MemorySpace::host; }

  void alltoall_i64(const int64_t* send, int64_t* recv, size_t count) override {
    Arrival mine{Collective::alltoall_i64, send, recv, count, {}};
    const std::vector<Arrival>& all = world_->arrive(rank_, mine);
    if (count > 0) {
      for (int p = 0; p < world_size(); ++p)
        std::memcpy(recv + size_t(p) * count, all[p].send + size_t(rank_) * count, count * sizeof(int64_t));
    }
    world_->depart();
  }

  void alltoallv(std::span<const AlltoallvPlane> planes) override {
    Arrival mine{Collective::alltoallv, nullptr, nullptr, 0, planes};
    const std::vector<Arrival>& all = world_->arrive(rank_, mine);
    for (size_t i = 0; i < planes.size(); ++i) {
      auto* recv = static_cast<char*>(planes[i].recv);
      for (int p = 0; p < world_size(); ++p) {
        const size_t n = planes[i].recv_bytes[p];
        if (n == 0) continue;
        const AlltoallvPlane& theirs = all[p].planes[i];
        std::memcpy(recv + planes[i].recv_offsets[p],
                    static_cast<const char*>(theirs.send) + theirs.send_offsets[rank_], n);
      }
    }
    world_->depart();
  }

  void allreduce_max_i64(int64_t* values, size_t count) override {
    mock::allreduce_max_i64(*world_, rank_, values, count);
  }
  void barrier() override { mock::barrier(*world_, rank_); }

  MockWorld& world() override { return *world_; }

 private:
  std::shared_ptr<MockWorld> world_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_mock_world(int world_size, double deadline_seconds) {
  EPMOE_CHECK(world_size >= 1, ErrorCode::invalid_argument, "make_mock_world: world_size must be >= 1, got ",
              world_size);
  EPMOE_CHECK(deadline_seconds > 0, ErrorCode::invalid_argument,
              "make_mock_world: deadline_seconds must be > 0, got ", deadline_seconds);
  auto world = std::make_shared<MockWorld>(world_size, deadline_seconds);
  std::vector<std::shared_ptr<Communicator>> comms;
  comms.reserve(world_size);
  for (int r = 0; r < world_size; ++r) comms.push_back(std::make_shared<MockCommunicator>(world, r));
  return comms;
}

void mock_world_abort(Communicator& any_rank_of_world, const std::string& why) {
  auto* mock = dynamic_cast<mock::MockRank*>(&any_rank_of_world);
  EPMOE_CHECK(mock != nullptr, ErrorCode::invalid_argument, "mock_world_abort: communicator is '",
              any_rank_of_world.name(), "', not a mock rank");
  mock->world().abort(why);
}

std::string describe_exception(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace epmoe
