// Sm90Plan's text form and the override syntax (epmoe/sm90_plan.h).
#include "epmoe/sm90_plan.h"

#include <charconv>
#include <sstream>
#include <vector>

#include "epmoe/error.h"

namespace epmoe {

const char* to_string(Sm90UpForm f) {
  switch (f) {
    case Sm90UpForm::single: return "single";
    case Sm90UpForm::cluster: return "cluster";
    case Sm90UpForm::pairs: return "pairs";
  }
  return "?";
}
const char* to_string(Sm90Order o) { return o == Sm90Order::by_expert ? "expert" : "global"; }

namespace {
const char* both(bool up, bool down) { return up && down ? "up+down" : up ? "up" : down ? "down" : "none"; }
}  // namespace

std::string to_string(const Sm90Plan& p) {
  std::ostringstream os;
  os << "up=" << to_string(p.up_form) << " up_order=" << to_string(p.up_order)
     << " down_order=" << to_string(p.down_order) << " down=" << (p.down_cluster ? "cluster" : "single")
     << " split=" << both(p.up_split, p.down_split) << " split_ctas=" << p.split_ctas
     << " pad=" << both(p.up_pad_halves, p.down_pad_halves) << " tail=" << (p.tail_split ? "on" : "off")
     << " swap=" << (p.swap_ab ? "on" : "off") << " fused=" << (p.fused ? "on" : "off");
  return os.str();
}

bool Sm90PlanOverride::empty() const {
  return !up_form && !up_order && !down_order && !down_cluster && !up_split && !down_split && !split_ctas &&
         !up_pad_halves && !down_pad_halves && !tail_split && !swap_ab && !fused;
}

Sm90Plan Sm90PlanOverride::applied_to(Sm90Plan p) const {
  if (up_form) p.up_form = *up_form;
  if (up_order) p.up_order = *up_order;
  if (down_order) p.down_order = *down_order;
  if (down_cluster) p.down_cluster = *down_cluster;
  if (up_split) p.up_split = *up_split;
  if (down_split) p.down_split = *down_split;
  if (split_ctas) p.split_ctas = *split_ctas;
  if (up_pad_halves) p.up_pad_halves = *up_pad_halves;
  if (down_pad_halves) p.down_pad_halves = *down_pad_halves;
  if (tail_split) p.tail_split = *tail_split;
  if (swap_ab) p.swap_ab = *swap_ab;
  if (fused) p.fused = *fused;
  return p;
}

Sm90PlanOverride parse_sm90_plan_override(std::string_view spec) {
  Sm90PlanOverride o;
  std::vector<std::string> tokens;
  std::string cur;
  for (char c : spec) {
    if (c == ',' || c == ' ' || c == ';') {
      if (!cur.empty()) tokens.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) tokens.push_back(cur);
  auto bad = [&](const std::string& t, const char* want) {
    EPMOE_FAIL(ErrorCode::invalid_argument, "plan override: '", t, "': expected ", want);
  };
  auto order_of = [&](const std::string& t, const std::string& v) {
    if (v == "global") return Sm90Order::global;
    if (v == "expert" || v == "by_expert") return Sm90Order::by_expert;
    bad(t, "global or expert");
    return Sm90Order::global;  // (not reached)
  };
  auto pair_of = [&](const std::string& t, const std::string& v, std::optional<bool>& up, std::optional<bool>& down) {
    if (v == "none" || v == "off") up = down = false;
    else if (v == "up") up = true, down = false;
    else if (v == "down") up = false, down = true;
    else if (v == "up+down" || v == "both" || v == "on") up = down = true;
    else bad(t, "none, up, down or up+down");
  };
  for (const std::string& t : tokens) {
    const size_t eq = t.find('=');
    if (eq == std::string::npos || eq == 0) bad(t, "key=value");
    const std::string k = t.substr(0, eq), v = t.substr(eq + 1);
    if (k == "up") {
      if (v == "single") o.up_form = Sm90UpForm::single;
      else if (v == "cluster") o.up_form = Sm90UpForm::cluster;
      else if (v == "pairs") o.up_form = Sm90UpForm::pairs;
      else bad(t, "up=single|cluster|pairs");
    } else if (k == "order") {
      o.up_order = o.down_order = order_of(t, v);
    } else if (k == "up_order") {
      o.up_order = order_of(t, v);
    } else if (k == "down_order") {
      o.down_order = order_of(t, v);
    } else if (k == "down") {
      if (v == "single") o.down_cluster = false;
      else if (v == "cluster") o.down_cluster = true;
      else bad(t, "down=single|cluster");
    } else if (k == "split") {
      pair_of(t, v, o.up_split, o.down_split);
    } else if (k == "split_ctas") {
      int n = 0;
      const auto r = std::from_chars(v.data(), v.data() + v.size(), n);
      if (r.ec != std::errc() || r.ptr != v.data() + v.size() || n < 0) bad(t, "split_ctas=N, N >= 0 (>= 1 with a split)");
      o.split_ctas = n;
    } else if (k == "pad") {
      pair_of(t, v, o.up_pad_halves, o.down_pad_halves);
    } else if (k == "tail") {
      if (v == "on") o.tail_split = true;
      else if (v == "off") o.tail_split = false;
      else bad(t, "tail=on|off");
    } else if (k == "swap") {
      if (v == "on") o.swap_ab = true;
      else if (v == "off") o.swap_ab = false;
      else bad(t, "swap=on|off");
    } else if (k == "fused") {
      if (v == "on") o.fused = true;
      else if (v == "off") o.fused = false;
      else bad(t, "fused=on|off");
    } else {
      bad(t, "one of up, order, up_order, down_order, down, split, split_ctas, pad, tail, swap, fused");
    }
  }
  return o;
}

}  // namespace epmoe
