// The kernel-variant table of the sm_90a suite (test_sm90_experts.cu runs each row as
// Sm90Variant.MatchesReference/<name>); kept in its own file for size.
#pragma once
#include <ostream>
#include <vector>

#include "sm90_case.h"

namespace sm90_case {

// ---- kernel variants: EPMOE_SM90_CLUSTER x EPMOE_SM90_GROUP x EPMOE_SM90_ORDER -----------------
// The default (single CTAs, groups of 16 row tiles cut from the global tile sequence at hidden < 4096,
// inside each expert from 4096 on) runs every case above; the variants at hidden >= 4096 below pin
// the global order, so it stays tested where auto no longer picks it. Pinned here: 2-CTA clusters
// multicasting the weight tile (mode 1) on the cases that stress the tile pairing - one tile in all
// (rank 1 idles), an odd tile count in one expert, pairs straddling expert boundaries (1-row and
// empty experts, skew), a half-out-of-range last W2 block, many tiles, graph capture, no PDL, the TMA
// (xs) A path, one cluster per item - with group sizes that leave short last groups; mode 2
// (clusters in DOWN only while UP gathers); single CTAs in tile-major order and with other group
// sizes; and the by-expert order (EPMOE_SM90_ORDER=expert) on the cases that stress it: an odd
// expert's last tile runs as a column pair - the single-row experts make every tile such a leftover,
// ffn 640 / hidden 640 give odd column-block counts (rank 1 idle on the last pair) - and groups split
// an expert's units into near-equal parts.
struct Variant {
  const char* name;
  const char* cluster;  // EPMOE_SM90_CLUSTER
  const char* group;    // EPMOE_SM90_GROUP
  Case c;
  const char* order = nullptr;  // EPMOE_SM90_ORDER (unset: the default, auto - by expert at hidden >= 4096)
  const char* knob = nullptr;   // one more EPMOE_SM90_* variable set to `value` (the non-default paths)
  const char* value = nullptr;
  const char* knob2 = nullptr;  // and another
  const char* value2 = nullptr;
  // Split UP rows (EPMOE_SM90_UP_ROWS=split): experts the 192-row half must run: 1 some, 0 none, -1
  // either (the harness checks the device's choice against the host rule in every case).
  int split_tall = 1;
};
// The rows (sm90_variants.cu).
const std::vector<Variant>& variants();
void PrintTo(const Variant& v, std::ostream* os);  // (gtest: the row's name)

}  // namespace sm90_case
