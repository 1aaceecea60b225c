#include "epmoe/moe_config.h"

#include <sstream>

#include "epmoe/error.h"

namespace epmoe {

void MoeConfig::validate() const {
  constexpr auto C = ErrorCode::invalid_config;
  EPMOE_CHECK(num_experts > 0, C, "num_experts must be > 0, got ", num_experts);
  EPMOE_CHECK(top_k > 0, C, "top_k must be > 0, got ", top_k);
  EPMOE_CHECK(hidden > 0, C, "hidden must be > 0, got ", hidden);
  EPMOE_CHECK(ffn > 0, C, "ffn must be > 0, got ", ffn);
  EPMOE_CHECK(world_size > 0 && world_size <= kMaxWorldSize, C, "world_size must be in [1, ", kMaxWorldSize,
              "], got ", world_size);
  EPMOE_CHECK(rank >= 0 && rank < world_size, C, "rank ", rank, " outside [0, ", world_size, ")");
  EPMOE_CHECK(num_experts % world_size == 0, C, "num_experts (", num_experts, ") % world_size (", world_size,
              ") != 0: every rank must own the same number of experts");
  EPMOE_CHECK(top_k <= num_experts, C, "top_k (", top_k, ") > num_experts (", num_experts, ")");
  EPMOE_CHECK(hidden % kDimAlignment == 0, C, "hidden (", hidden, ") must be a multiple of ", kDimAlignment);
  EPMOE_CHECK(ffn % kDimAlignment == 0, C, "ffn (", ffn, ") must be a multiple of ", kDimAlignment);
}

std::array<int64_t, MoeConfig::kWords> MoeConfig::agreement_words() const {
  // A version word first so that two library builds with a different protocol also disagree.
  constexpr int64_t kProtocolVersion = 1;
  return {kProtocolVersion, num_experts, top_k, hidden, ffn, world_size};
}

std::string MoeConfig::describe() const {
  std::ostringstream os;
  os << "E=" << num_experts << " k=" << top_k << " hidden=" << hidden << " ffn=" << ffn << " world=" << world_size
     << " rank=" << rank;
  return os.str();
}

}  // namespace epmoe
