#!/usr/bin/env python3
"""Summarize steady-state A/Bs of epmoe_bench_experts (--ab-plan SPEC_A/SPEC_B --ab-blocks N).

  python3 launch/ab_summary.py OUT1.txt [OUT2.txt ...]   one line per shape and A/B
  python3 launch/ab_summary.py --self-test               check the parser on a built-in sample

Per shape: B/A of the medians over all blocks, how many rounds B won (a round is one A block and
one B block, run AB, BA, AB, ...), the spread of each variant's block medians, and what B's plan
changes against A's for that shape ('-' when both resolve to the same plan: an A/A control, or an
override the shape's default plan already has). Why the rounds: on the power-capped H200 one
variant's block medians spread +-1..3%, so a B/A is worth something only when most
rounds agree; run an A/A control (SPEC_A/SPEC_A, launch/ab_steady.sh does) on the same shapes to
see the noise of the day.

The bench's lines read here (src/programs/bench_experts.cu prints them after each table row):
  #   A/B plan A=[SPEC_A] B=[SPEC_B]: A_MS ms, B_MS ms, B/A RATIO (REGION, HOW)   (empty spec: default)
  #   A/B plan A: <resolved plan>      #   A/B plan B: <resolved plan>
  #   A/B block medians (ms, in run order; each round AB or BA): A ms B ms B ms A ms ...
"""
import re
import sys

ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|")
AB = re.compile(r"^#\s+A/B plan A=\[([^\]]*)\] B=\[([^\]]*)\]: ([0-9.]+) ms, ([0-9.]+) ms, B/A ([0-9.]+)")
PLAN = re.compile(r"^#\s+A/B plan ([AB]): (.*?)\s*$")
BLOCKS = re.compile(r"^#\s+A/B block medians[^:]*:\s*(.*)$")


def parse(lines):
    """Yields dicts: shape, a, b (the specs), a_ms, b_ms, ratio, plan_a, plan_b (resolved, or None)
    and (with --ab-blocks) blocks [(A|B, ms)]."""
    shape = None
    cur = None
    for line in lines:
        m = ROW.match(line)
        if m:
            shape = ",".join(m.groups())
            continue
        m = AB.match(line)
        if m:
            if cur is not None:
                yield cur
            a, b, a_ms, b_ms, ratio = m.groups()
            cur = dict(shape=shape, a=a, b=b, a_ms=float(a_ms), b_ms=float(b_ms), ratio=float(ratio),
                       plan_a=None, plan_b=None, blocks=[])
            continue
        m = PLAN.match(line)
        if m and cur is not None:
            cur["plan_" + m.group(1).lower()] = m.group(2)
            continue
        m = BLOCKS.match(line)
        if m and cur is not None:
            toks = m.group(1).split()
            if len(toks) % 2:
                raise ValueError("odd block list: " + line.strip())
            cur["blocks"] = [(toks[i], float(toks[i + 1])) for i in range(0, len(toks), 2)]
    if cur is not None:
        yield cur


def rounds(blocks):
    """(rounds B won, rounds) from [(label, ms)] in run order; a round is blocks 2r and 2r + 1."""
    won = n = 0
    for i in range(0, len(blocks) - 1, 2):
        pair = dict(blocks[i:i + 2])
        if set(pair) != {"A", "B"}:
            raise ValueError("round %d is not one A and one B block: %r" % (i // 2, blocks[i:i + 2]))
        n += 1
        won += pair["B"] < pair["A"]
    return won, n


def spread(blocks, label):
    v = sorted(ms for lab, ms in blocks if lab == label)
    if not v:
        return 0.0
    return (v[-1] - v[0]) / v[len(v) // 2]


def plan_diff(a, b):
    """'key=A->B ...' for the fields of two resolved plans ('key=value ...') that differ; '-' when
    none do, '?' when a plan is missing."""
    if a is None or b is None:
        return "?"
    pa = dict(t.split("=", 1) for t in a.split() if "=" in t)
    pb = dict(t.split("=", 1) for t in b.split() if "=" in t)
    d = ["%s=%s->%s" % (k, pa.get(k, "?"), pb.get(k, "?")) for k in list(pa) + [k for k in pb if k not in pa]
         if pa.get(k) != pb.get(k)]
    return " ".join(d) or "-"


def summarize(results):
    out = ["%-22s %-36s %8s %8s %7s %6s %7s %7s  %s" % ("shape (E,k,h,f,T)", "A/B", "A ms", "B ms", "B/A", "B won",
                                                        "A sprd", "B sprd", "B's plan against A's")]
    for r in results:
        won, n = rounds(r["blocks"]) if r["blocks"] else (0, 0)
        out.append("%-22s %-36s %8.4f %8.4f %7.4f %6s %6.1f%% %6.1f%%  %s" % (
            r["shape"] or "?", "%s/%s" % (r["a"], r["b"]), r["a_ms"], r["b_ms"], r["ratio"],
            "%d/%d" % (won, n) if n else "-", 100 * spread(r["blocks"], "A"), 100 * spread(r["blocks"], "B"),
            plan_diff(r["plan_a"], r["plan_b"])))
    return "\n".join(out)


SAMPLE = """\
#    E  k hidden   ffn       T |   full ms  TFLOP/s |     up ms   down ms | ...
    32  8   7168  2048    8192 |    0.0000      0.0 |    0.0000    0.0000 | ...
#   plan: up=pairs up_order=expert down_order=expert down=cluster split=none split_ctas=132 pad=none tail=on
#   A/B plan A=[down=single] B=[default]: 9.4537 ms, 9.3320 ms, B/A 0.9871 (full layer, 4 rounds of steady-state blocks)
#   A/B plan A: up=pairs up_order=expert down_order=expert down=single split=none split_ctas=132 pad=none tail=on
#   A/B plan B: up=pairs up_order=expert down_order=expert down=cluster split=none split_ctas=132 pad=none tail=on
#   A/B block medians (ms, in run order; each round AB or BA): A 9.3634 B 9.4178 B 9.3298 A 9.4614 A 9.5033 B 9.3148 B 9.3348 A 9.4589
    32  4   2048  1024   16384 |    0.0000      0.0 |    0.0000    0.0000 | ...
#   plan: up=pairs up_order=global down_order=global down=single split=none split_ctas=132 pad=none tail=on
#   A/B plan A=[order=global] B=[order=global]: 1.4000 ms, 1.4100 ms, B/A 1.0071 (full layer, interleaved replays)
#   A/B plan A: up=pairs up_order=global down_order=global down=single split=none split_ctas=132 pad=none tail=on
#   A/B plan B: up=pairs up_order=global down_order=global down=single split=none split_ctas=132 pad=none tail=on
"""


def self_test():
    rs = list(parse(SAMPLE.splitlines()))
    assert len(rs) == 2, rs
    a, b = rs
    assert a["shape"] == "32,8,7168,2048,8192" and a["a"] == "down=single" and a["b"] == "default", a
    assert abs(a["ratio"] - 0.9871) < 1e-9 and len(a["blocks"]) == 8, a
    assert a["plan_b"].endswith("tail=on") and "down=single" in a["plan_a"], a
    assert plan_diff(a["plan_a"], a["plan_b"]) == "down=single->cluster", plan_diff(a["plan_a"], a["plan_b"])
    assert rounds(a["blocks"]) == (3, 4), rounds(a["blocks"])  # B lost round 0 (9.4178 > 9.3634)
    assert abs(spread(a["blocks"], "A") - (9.5033 - 9.3634) / 9.4614) < 1e-12
    assert b["shape"] == "32,4,2048,1024,16384" and b["blocks"] == [], b
    assert plan_diff(b["plan_a"], b["plan_b"]) == "-" and plan_diff(None, b["plan_b"]) == "?"
    try:
        rounds([("A", 1.0), ("A", 2.0)])
        raise AssertionError("a round of two A blocks must be rejected")
    except ValueError:
        pass
    text = summarize(rs)
    assert "3/4" in text and "0.9871" in text and "down=single/default" in text, text
    print("ab_summary self-test: OK")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    results = []
    for path in argv[1:]:
        with open(path) as f:
            results.extend(parse(f))
    if not results:
        print("no A/B lines found in " + " ".join(argv[1:]), file=sys.stderr)
        return 1
    print(summarize(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
