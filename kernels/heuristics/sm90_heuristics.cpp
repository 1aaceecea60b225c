// The sm_90a kernels' default rules (sm90_heuristics.h). Each rule's measured reason is one line of
// docs/DECISIONS.md; the golden table in tests/test_sm90_heuristics.cpp pins what they return.
#include "kernels/heuristics/sm90_heuristics.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "epmoe/error.h"
#include "kernels/sm90/schedule.cuh"
#include "kernels/sm90/tile_config.h"

namespace epmoe::kernels {

using namespace sm90;

namespace {
int64_t row_tiles(const Sm90Shape& s) { return (s.rows_capacity + kBM - 1) / kBM; }
int up_blocks(const Sm90Shape& s) { return ceil_div(s.ffn, 128); }
int down_blocks(const Sm90Shape& s) { return (s.hidden + kBN - 1) / kBN; }
}  // namespace

int64_t sm90_tiles_bound(const Sm90Shape& s) {
  const int64_t by_capacity = row_tiles(s);
  if (s.pairs <= 0) return by_capacity;
  return std::min(by_capacity, std::min<int64_t>(s.experts, s.pairs) + s.pairs / kBM);
}

bool sm90_by_expert_fits(int experts, size_t staging) { return fits_smem(dyn_smem_bytes(true, experts, staging)); }

int64_t sm90_work_items(int64_t tiles, int experts, int blocks, bool cluster, bool by_expert) {
  if (!cluster) return tiles * blocks;
  return by_expert ? expert_items_bound(tiles, experts, blocks, true) : (tiles + 1) / 2 * blocks;
}

bool sm90_pad_halves_pay(int64_t tiles, int experts, int k_dim, int64_t grid, int group, int64_t l2_bytes) {
  if (tiles <= 0 || experts <= 0 || k_dim <= 0 || grid <= 0 || l2_bytes <= 0) return false;
  const int64_t partners = std::clamp<int64_t>(tiles / experts, 1, std::max(group, 1));
  const int64_t slices = (grid + partners - 1) / partners;
  const int64_t wave_bytes = slices * kBN * int64_t(k_dim) * 2;
  return kPadHalvesL2Fraction * wave_bytes <= l2_bytes;
}

Sm90Plan choose_sm90_plan(const Sm90Shape& s, const Sm90Device& d) {
  Sm90Plan p;
  const int64_t tiles = row_tiles(s);
  // Weight multicast where the weights are large and each expert has many rows.
  const bool multicast = s.hidden >= kClusterMinHidden && s.experts > 0 &&
                         s.rows_capacity / s.experts >= kClusterMinRowsPerExpert;
  // UP: the A-sharing pairs wherever the column blocks pair up (they halve the gather's copies),
  // else the multicast clusters where those pay, else single CTAs.
  p.up_form = s.ffn % 256 == 0 ? Sm90UpForm::pairs : multicast ? Sm90UpForm::cluster : Sm90UpForm::single;
  p.down_cluster = multicast;
  const bool wide = s.hidden >= kOrderByExpertMinHidden;
  p.up_order = wide && sm90_by_expert_fits(s.experts, kUpStagingBytes) ? Sm90Order::by_expert : Sm90Order::global;
  p.down_order = wide && sm90_by_expert_fits(s.experts, kDownStagingBytes) ? Sm90Order::by_expert : Sm90Order::global;
  // The 192-row halves run by expert, where their own schedule fits.
  p.up_split = p.up_order == Sm90Order::by_expert && tall_up_dims(s.ffn) && fits_smem(tall_up_smem_bytes(s.experts));
  p.down_split = p.down_order == Sm90Order::by_expert &&
                 fits_smem(tall_down_smem_bytes(s.experts), kTallStaticSmemReserve);
  p.split_ctas = std::max(d.sms, 1);
  // Padding halves (single CTAs): a wave is the CTAs resident at once.
  if (p.up_form == Sm90UpForm::single) {
    const int64_t items = sm90_work_items(tiles, s.experts, up_blocks(s), false, p.up_order == Sm90Order::by_expert);
    p.up_pad_halves =
        sm90_pad_halves_pay(tiles, s.experts, s.hidden, std::min<int64_t>(items, d.sms), kGroupTiles, d.l2_bytes);
  }
  if (!p.down_cluster) {
    const int64_t items =
        sm90_work_items(tiles, s.experts, down_blocks(s), false, p.down_order == Sm90Order::by_expert);
    p.down_pad_halves =
        sm90_pad_halves_pay(tiles, s.experts, s.ffn, std::min<int64_t>(items, d.sms), kGroupTiles, d.l2_bytes);
  }
  p.tail_split = true;
  // Swap-AB where the 128-row UP would leave most SMs idle.
  p.swap_ab = s.pairs > 0 && sm90_tiles_bound(s) * up_blocks(s) * kSwapAbSmsDivisor <= d.sms;
  return p;
}

void check_sm90_plan(const Sm90Plan& p, const Sm90Shape& s) {
  EPMOE_CHECK(s.experts > 0 && s.hidden > 0 && s.hidden % kDimMultiple == 0 && s.ffn > 0 &&
                  s.ffn % kDimMultiple == 0 && s.rows_capacity > 0,
              ErrorCode::invalid_argument, "sm90 plan: bad shape E=", s.experts, " hidden=", s.hidden,
              " ffn=", s.ffn, " rows_capacity=", s.rows_capacity);
  const std::string plan = to_string(p);
  EPMOE_CHECK(p.up_form != Sm90UpForm::pairs || s.ffn % 256 == 0, ErrorCode::invalid_argument,
              "sm90 plan '", plan, "': up=pairs needs ffn % 256 == 0, ffn = ", s.ffn);
  EPMOE_CHECK(p.up_order == Sm90Order::global || sm90_by_expert_fits(s.experts, kUpStagingBytes),
              ErrorCode::invalid_argument, "sm90 plan '", plan, "': up_order=expert: the schedule of ",
              s.experts, " experts does not fit in UP's shared memory");
  EPMOE_CHECK(p.down_order == Sm90Order::global || sm90_by_expert_fits(s.experts, kDownStagingBytes),
              ErrorCode::invalid_argument, "sm90 plan '", plan, "': down_order=expert: the schedule of ",
              s.experts, " experts does not fit in DOWN's shared memory");
  EPMOE_CHECK(!p.up_split || (p.up_order == Sm90Order::by_expert && fits_smem(tall_up_smem_bytes(s.experts))),
              ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': split=up needs up_order=expert and a 192-row UP schedule that fits (E = ", s.experts, ")");
  EPMOE_CHECK(!p.up_split || tall_up_dims(s.ffn), ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': split=up needs ffn % 128 == 0 (the 192-row UP's W1 blocks), ffn = ", s.ffn);
  EPMOE_CHECK(!p.down_split || (p.down_order == Sm90Order::by_expert &&
                                fits_smem(tall_down_smem_bytes(s.experts), kTallStaticSmemReserve)),
              ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': split=down needs down_order=expert and a 192-row DOWN schedule that fits (E = ", s.experts, ")");
  EPMOE_CHECK(!(p.up_split || p.down_split) || p.split_ctas >= 1, ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': a split needs split_ctas >= 1");
  EPMOE_CHECK(!p.up_pad_halves || p.up_form == Sm90UpForm::single, ErrorCode::invalid_argument, "sm90 plan '",
              plan, "': pad=up needs up=single (clusters and pairs run whole tiles)");
  EPMOE_CHECK(!p.down_pad_halves || !p.down_cluster, ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': pad=down needs down=single");
  EPMOE_CHECK(!p.fused || p.swap_ab, ErrorCode::invalid_argument, "sm90 plan '", plan,
              "': fused=on needs swap=on (the fused pipeline is built in the swap-AB form only)");
}

Sm90Plan resolve_sm90_plan(const Sm90Shape& s, const Sm90Device& d, const Sm90PlanOverride& o) {
  Sm90Plan p = o.applied_to(choose_sm90_plan(s, d));
  // Fields the caller left unset follow the ones set: a default that the set fields rule out is
  // dropped, not an error (padding halves are single-CTA only, the split needs the by-expert order).
  if (!o.up_pad_halves && p.up_form != Sm90UpForm::single) p.up_pad_halves = false;
  if (!o.down_pad_halves && p.down_cluster) p.down_pad_halves = false;
  if (!o.up_split &&
      (p.up_order != Sm90Order::by_expert || !tall_up_dims(s.ffn) || !fits_smem(tall_up_smem_bytes(s.experts))))
    p.up_split = false;
  if (!o.down_split && (p.down_order != Sm90Order::by_expert ||
                        !fits_smem(tall_down_smem_bytes(s.experts), kTallStaticSmemReserve)))
    p.down_split = false;
  // fused=on asks for the swap-AB form it is built in; swap=off drops a default fused.
  if (o.fused && *o.fused && !o.swap_ab) p.swap_ab = true;
  if (!o.fused && !p.swap_ab) p.fused = false;
  check_sm90_plan(p, s);
  return p;
}

Sm90PlanOverride full_override(const Sm90Plan& p) {
  Sm90PlanOverride o;
  o.up_form = p.up_form;
  o.up_order = p.up_order;
  o.down_order = p.down_order;
  o.down_cluster = p.down_cluster;
  o.up_split = p.up_split;
  o.down_split = p.down_split;
  o.split_ctas = p.split_ctas;
  o.up_pad_halves = p.up_pad_halves;
  o.down_pad_halves = p.down_pad_halves;
  o.tail_split = p.tail_split;
  o.swap_ab = p.swap_ab;
  o.fused = p.fused;
  return o;
}

std::vector<std::pair<Sm90Shape, Sm90Plan>> sm90_plan_catalog(const Sm90Device& d) {
  // Keyed by the plan's text; the value is the smallest problem (rows x hidden x ffn) that picks it.
  std::map<std::string, std::pair<Sm90Shape, Sm90Plan>> best;
  auto cost = [](const Sm90Shape& s) { return double(s.rows_capacity) * s.hidden * s.ffn; };
  for (int E : {1, 2, 4, 8, 16, 32, 64, 128, 160, 224, 256})
    for (int hidden : {256, 2048, 4096, 7168})
      for (int ffn : {256, 384, 768, 1024, 1040, 2048, 2064})
        for (int64_t rows_per_expert : {1, 64, 128, 512, 1024, 2048, 4096}) {
          // Capacity as the engine bounds it: every pair, plus each segment's padding to 128 rows.
          const int64_t rows = rows_per_expert * E;
          Sm90Shape s{E, hidden, ffn, (rows + int64_t(E) * (kBM - 1) + kBM - 1) / kBM * kBM, rows};
          const Sm90Plan p = choose_sm90_plan(s, d);
          // (swap-AB plans run the same kernels whatever their other fields: one entry per form)
          const std::string key = p.swap_ab ? std::string(p.fused ? "fused" : "swap") : to_string(p);
          auto it = best.find(key);
          if (it == best.end() || cost(s) < cost(it->second.first)) best[key] = {s, p};
        }
  std::vector<std::pair<Sm90Shape, Sm90Plan>> out;
  for (auto& [key, v] : best) out.push_back(v);
  std::sort(out.begin(), out.end(), [&](const auto& a, const auto& b) { return cost(a.first) < cost(b.first); });
  return out;
}

}  // namespace epmoe::kernels
