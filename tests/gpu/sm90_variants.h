// The plan tables of the sm_90a suite (test_sm90_experts.cu): the catalog cases (one per distinct
// default plan of the heuristics, Sm90Catalog.MatchesReference/<n>) and the kernel-variant rows
// (Sm90Variant.MatchesReference/<name>: a case and a plan override on top of its default); kept in
// their own file for size.
#pragma once
#include <ostream>
#include <string>
#include <vector>

#include "epmoe/sm90_plan.h"
#include "kernels/heuristics/sm90_heuristics.h"
#include "sm90_case.h"

namespace sm90_case {

// ---- the catalog: every plan the default rules pick -----------------------------------------------
// One case per entry of sm90_plan_catalog(kH200) (the smallest shape of each distinct plan): the
// entry's E, hidden, ffn and rows_capacity, uniform routing with k = 2 (1 for one expert) and T such
// that the pairs fill the capacity as the engine's bound would (T k = rows_capacity - 127 E), run
// with full_override(plan): the kernels run exactly the catalog's plan whatever the device.
struct CatalogCase {
  std::string name;  // "<index>_<plan tag>"
  Case c;
  epmoe::kernels::Sm90Shape shape;  // the catalog's
  epmoe::Sm90Plan plan;
};
const std::vector<CatalogCase>& catalog_cases();
void PrintTo(const CatalogCase& c, std::ostream* os);  // (gtest: the case's name)

// ---- kernel variants: a case and a plan override ---------------------------------------------------
// The named cases and the catalog run the default plans; these rows pin the non-default ones on the
// cases that stress each path's edges (see sm90_variants.cu). Every row's override must be valid for
// its shape (Sm90Variants.PlansAreValid resolves each on the host, no GPU needed).
struct Variant {
  const char* name;
  Case c;
  const char* plan;  // parse_sm90_plan_override syntax, on top of the case's default plan ("": none)
  // Where the plan splits UP / DOWN: the experts the host split rule must send to the 192-row half:
  // 1 at least one, 0 none, -1 either (asserted from CaseStats, and on the host by PlansAreValid).
  int up_tall = -1;
  int down_tall = -1;
};
const std::vector<Variant>& variants();
// A row's override: its plan text, plus swap=off unless the text says swap or fused=on (the other
// rows pin the 128-row kernels' forms, which the heuristics would replace by swap-AB on the small
// cases), and fused=off unless it says fused.
epmoe::Sm90PlanOverride variant_override(const Variant& v);
void PrintTo(const Variant& v, std::ostream* os);  // (gtest: the row's name)

}  // namespace sm90_case
