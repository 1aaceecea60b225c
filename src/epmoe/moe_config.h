// The layer's shape and its place in the expert-parallel group.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace epmoe {

// hidden and ffn must be multiples of this (16 bf16 = 32 bytes: every row of x, act and the
// weights starts 32-byte aligned, so the 16-byte vector accesses never straddle a row).
inline constexpr int kDimAlignment = 16;
// The sm_90 kernels take these too: their TMA boxes read zeros past hidden and ffn, and their stores
// are predicated there (kernels/sm90/tensor_maps.cuh). Only the MXFP8 kernels need multiples of 128
// (mx::kGpuDimAlignment).
// Ranks in one group: the layout keeps one bit per destination rank in a 64-bit mask.
inline constexpr int kMaxWorldSize = 64;

struct MoeConfig {
  int num_experts = 0;  // E, over all ranks
  int top_k = 0;        // k slots per token (a slot may be -1: dropped)
  int hidden = 0;       // model dimension
  int ffn = 0;          // expert intermediate dimension (gate and up are ffn wide each)
  int world_size = 1;   // ranks in the expert-parallel group
  int rank = 0;         // this rank

  // Throws Error(invalid_config) naming the first rule broken.
  void validate() const;

  int experts_per_rank() const { return num_experts / world_size; }
  int first_expert() const { return rank * experts_per_rank(); }
  int owner_of(int expert) const { return expert / experts_per_rank(); }

  // The fields that every rank must agree on (all but rank), for the cross-rank check.
  static constexpr int kWords = 6;
  std::array<int64_t, kWords> agreement_words() const;
  std::string describe() const;
};

}  // namespace epmoe
