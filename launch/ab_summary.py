#!/usr/bin/env python3
"""Summarize steady-state A/Bs of epmoe_bench_experts (--ab VAR=A,B --ab-blocks N).

  python3 launch/ab_summary.py OUT1.txt [OUT2.txt ...]   one line per shape and A/B
  python3 launch/ab_summary.py --self-test               check the parser on a built-in sample

Per shape: B/A of the medians over all blocks, how many rounds B won (a round is one A block and
one B block, run AB, BA, AB, ...), and the spread of each variant's block medians. Why the rounds:
on the power-capped H200 one variant's block medians spread +-1..3% (docs/PERF.md, session 14), so a
B/A is worth something only when most rounds agree; run an A/A control (VAR=A,A) on the same shapes
to see the noise of the day.
"""
import re
import sys

ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|")
AB = re.compile(r"^#\s+A/B (\S+): (\S+) ([0-9.]+) ms, (\S+) ([0-9.]+) ms, B/A ([0-9.]+)")
BLOCKS = re.compile(r"^#\s+A/B block medians[^:]*:\s*(.*)$")


def parse(lines):
    """Yields dicts: shape, var, a, b, a_ms, b_ms, ratio, and (with --ab-blocks) blocks [(A|B, ms)]."""
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
            var, a, a_ms, b, b_ms, ratio = m.groups()
            cur = dict(shape=shape, var=var, a=a, b=b, a_ms=float(a_ms), b_ms=float(b_ms), ratio=float(ratio),
                       blocks=[])
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


def summarize(results):
    out = ["%-22s %-36s %8s %8s %7s %6s %7s %7s" % ("shape (E,k,h,f,T)", "A/B", "A ms", "B ms", "B/A", "B won",
                                                    "A sprd", "B sprd")]
    for r in results:
        won, n = rounds(r["blocks"]) if r["blocks"] else (0, 0)
        out.append("%-22s %-36s %8.4f %8.4f %7.4f %6s %6.1f%% %6.1f%%" % (
            r["shape"] or "?", "%s=%s,%s" % (r["var"], r["a"], r["b"]), r["a_ms"], r["b_ms"], r["ratio"],
            "%d/%d" % (won, n) if n else "-", 100 * spread(r["blocks"], "A"), 100 * spread(r["blocks"], "B")))
    return "\n".join(out)


SAMPLE = """\
#    E  k hidden   ffn       T |   seed ms  TFLOP/s |   full ms ...
    32  8   7168  2048    8192 |    0.0000      0.0 |    0.0000      0.0 | ...
#   A/B EPMOE_SM90_CLUSTER: 0 9.4537 ms, auto 9.3320 ms, B/A 0.9871 (full layer, 4 rounds of steady-state blocks)
#   A/B block medians (ms, in run order; each round AB or BA): A 9.3634 B 9.4178 B 9.3298 A 9.4614 A 9.5033 B 9.3148 B 9.3348 A 9.4589
    32  4   2048  1024   16384 |    0.0000      0.0 |    0.0000      0.0 | ...
#   A/B EPMOE_SM90_ORDER: global 1.4000 ms, expert 1.4100 ms, B/A 1.0071 (full layer, interleaved replays)
"""


def self_test():
    rs = list(parse(SAMPLE.splitlines()))
    assert len(rs) == 2, rs
    a, b = rs
    assert a["shape"] == "32,8,7168,2048,8192" and a["var"] == "EPMOE_SM90_CLUSTER" and a["b"] == "auto", a
    assert abs(a["ratio"] - 0.9871) < 1e-9 and len(a["blocks"]) == 8, a
    assert rounds(a["blocks"]) == (3, 4), rounds(a["blocks"])  # B lost round 0 (9.4178 > 9.3634)
    assert abs(spread(a["blocks"], "A") - (9.5033 - 9.3634) / 9.4614) < 1e-12
    assert b["shape"] == "32,4,2048,1024,16384" and b["blocks"] == [], b
    try:
        rounds([("A", 1.0), ("A", 2.0)])
        raise AssertionError("a round of two A blocks must be rejected")
    except ValueError:
        pass
    text = summarize(rs)
    assert "3/4" in text and "0.9871" in text, text
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
