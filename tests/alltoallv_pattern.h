// An uneven variable all-to-all pattern that every rank can regenerate: used by the mock and MPI
// communicator suites (and usable by any Communicator test) to check alltoallv byte for byte.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "epmoe/communicator.h"

namespace epmoe::test {


// Byte counts bytes[src * world + dst] for one plane; about a quarter of the blocks are empty.
inline std::vector<size_t> random_block_sizes(int world, int plane, uint32_t seed, size_t max_bytes) {
  std::mt19937 rng(seed * 7919u + uint32_t(plane) * 104729u + uint32_t(world));
  std::uniform_int_distribution<size_t> size(1, max_bytes);
  std::vector<size_t> bytes(size_t(world) * world);
  for (size_t& b : bytes) b = rng() % 4 == 0 ? 0 : size(rng);
  return bytes;
}

inline uint8_t pattern_byte(int plane, int src, int dst, size_t i) {
  return uint8_t(src * 37 + dst * 11 + plane * 101 + i * 7 + (i >> 8));
}

constexpr uint8_t kUntouched = 0xEE;

// One rank's buffers for one plane: send blocks in destination order, receive blocks in reverse
// source order, with small gaps that must stay untouched.
struct RankPlane {
  std::vector<uint8_t> send, recv;
  AlltoallvPlane plane;
};

inline RankPlane make_rank_plane(const std::vector<size_t>& bytes, int world, int plane, int me) {
  RankPlane rp;
  AlltoallvPlane& pl = rp.plane;
  pl.send_bytes.resize(world);
  pl.send_offsets.resize(world);
  pl.recv_bytes.resize(world);
  pl.recv_offsets.resize(world);
  size_t send_end = 0, recv_end = 0;
  for (int p = 0; p < world; ++p) {
    pl.send_offsets[p] = send_end;
    pl.send_bytes[p] = bytes[size_t(me) * world + p];
    send_end += pl.send_bytes[p] + size_t(p % 3);
  }
  for (int p = world - 1; p >= 0; --p) {
    pl.recv_offsets[p] = recv_end;
    pl.recv_bytes[p] = bytes[size_t(p) * world + me];
    recv_end += pl.recv_bytes[p] + size_t(p % 2);
  }
  rp.send.assign(send_end, kUntouched);
  rp.recv.assign(recv_end, kUntouched);
  for (int p = 0; p < world; ++p)
    for (size_t i = 0; i < pl.send_bytes[p]; ++i) rp.send[pl.send_offsets[p] + i] = pattern_byte(plane, me, p, i);
  pl.send = rp.send.data();
  pl.recv = rp.recv.data();
  return rp;
}

// Wrong bytes in rp.recv: block p must hold what p sent me, everything else stays untouched.
inline size_t count_wrong_bytes(const RankPlane& rp, int world, int plane, int me) {
  std::vector<uint8_t> want(rp.recv.size(), kUntouched);
  for (int p = 0; p < world; ++p)
    for (size_t i = 0; i < rp.plane.recv_bytes[p]; ++i) want[rp.plane.recv_offsets[p] + i] = pattern_byte(plane, p, me, i);
  size_t wrong = 0;
  for (size_t i = 0; i < want.size(); ++i) wrong += want[i] != rp.recv[i];
  return wrong;
}

// Exchanges num_planes random planes in one call and expects every received byte right.
// A plane that moves nothing (null buffers are fine then).
inline AlltoallvPlane empty_plane(int world) {
  AlltoallvPlane p;
  p.send_bytes.assign(size_t(world), 0);
  p.send_offsets.assign(size_t(world), 0);
  p.recv_bytes.assign(size_t(world), 0);
  p.recv_offsets.assign(size_t(world), 0);
  return p;
}

inline void check_alltoallv(Communicator& comm, int num_planes, uint32_t seed, size_t max_bytes) {
  const int world = comm.world_size(), me = comm.rank();
  std::vector<RankPlane> rps;
  std::vector<AlltoallvPlane> planes;
  for (int i = 0; i < num_planes; ++i) {
    rps.push_back(make_rank_plane(random_block_sizes(world, i, seed, max_bytes), world, i, me));
    planes.push_back(rps.back().plane);
  }
  comm.alltoallv(planes);
  for (int i = 0; i < num_planes; ++i)
    EXPECT_EQ(count_wrong_bytes(rps[i], world, i, me), 0u) << "rank " << me << " plane " << i << " seed " << seed;
}

}  // namespace epmoe::test
