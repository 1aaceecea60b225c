// The choices the Hopper (sm_90a) expert kernels make for a shape: a plan. The heuristics tier
// (kernels/heuristics/sm90_heuristics.h) picks one from the shape and the device; a caller may
// override any field (LayerOptions::sm90_plan, the benchmarks' --plan). Which kernel each choice
// runs, and why the defaults are what they are: docs/ARCHITECTURE.md ("Kernel map").
//
// EPMOE_PRINT_PLAN=1 prints each plan the sm_90 path launches (once per distinct shape and plan).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace epmoe {

// The 128-row UP kernel's form (UP gathers its A rows from the token-ordered input itself):
enum class Sm90UpForm : uint8_t {
  single,   // one CTA per SM, each its own tiles
  cluster,  // 2-CTA clusters of two row tiles of one expert, multicasting each W1 tile into both
  pairs,    // 2-CTA clusters on ONE row tile, two column blocks, each gathering half of the A tile
            // for both (needs ffn % 256 == 0)
};
// Work order of a kernel's (row tile, column block) items.
enum class Sm90Order : uint8_t {
  global,     // scheduling groups cut from the global tile sequence
  by_expert,  // groups cut inside each expert (its weights stream once per group); the schedule
              // lives in shared memory, so it needs E small enough to fit
};

struct Sm90Plan {
  Sm90UpForm up_form = Sm90UpForm::pairs;
  Sm90Order up_order = Sm90Order::global;
  Sm90Order down_order = Sm90Order::global;
  bool down_cluster = false;  // DOWN on 2-CTA clusters multicasting each W2 tile into two row tiles
  // The split: experts whose rows 192-row tiles cover with fewer padding rows than 128-row tiles run
  // in a second, 192-row kernel (decided on the device from the counts; by-expert order only).
  bool up_split = false, down_split = false;
  int split_ctas = 0;  // the split rule's CTA count (the device's SMs); 1 sends every such expert
  // All-padding upper tile halves run as half items (no tensor work). Single CTAs only.
  bool up_pad_halves = false, down_pad_halves = false;
  bool tail_split = true;  // the last wave's items run as row halves on twice the CTAs (single CTAs, pairs)
  // Swap-AB (seed 004): UP and DOWN with the weights in wgmma's M and each tile's real rows in N
  // (8..128, per tile on the device), 64 weight rows per CTA item. For experts with few rows (decode);
  // the fields above then do not apply.
  bool swap_ab = false;
  // The fused swap-AB pipeline (seed 000's single launch): each UP item goes on to its 32 act
  // columns' share of DOWN (a split-K GEMM over ffn, reduced in fp32 in the memory system), the
  // activation never leaving shared memory. Needs swap_ab (the 128-row fused form is not built);
  // runs only where the experts' inputs allow it (an inference forward: no h kept, not
  // deterministic, an fp32 accumulator given), else the split swap-AB kernels run.
  bool fused = false;

  bool operator==(const Sm90Plan&) const = default;
};

// Every field optional: unset fields keep the heuristics' choice.
struct Sm90PlanOverride {
  std::optional<Sm90UpForm> up_form;
  std::optional<Sm90Order> up_order, down_order;
  std::optional<bool> down_cluster, up_split, down_split;
  std::optional<int> split_ctas;
  std::optional<bool> up_pad_halves, down_pad_halves, tail_split, swap_ab, fused;

  bool empty() const;
  Sm90Plan applied_to(Sm90Plan p) const;
};

// "up=pairs up_order=global down_order=expert down=single split=up+down split_ctas=132
//  pad=down tail=on swap=off fused=off" - one line, the override syntax below reads it back.
std::string to_string(const Sm90Plan& p);
// Parses "key=value,key=value,..." (or space-separated): up=single|cluster|pairs,
// order=global|expert (both kernels), up_order=, down_order=, down=single|cluster,
// split=none|up|down|up+down, split_ctas=N, pad=none|up|down|up+down, tail=on|off, swap=on|off,
// fused=on|off.
// Throws Error(invalid_argument) naming the bad token.
Sm90PlanOverride parse_sm90_plan_override(std::string_view spec);

const char* to_string(Sm90UpForm f);
const char* to_string(Sm90Order o);

}  // namespace epmoe
