#!/usr/bin/env python3
"""reliability_matrix.py: the reliability matrix (issue 49) from ctest's JUnit files.

  python3 launch/reliability_matrix.py JUNIT.xml...
  python3 launch/reliability_matrix.py --self-test

Each reliability test prints rows "[matrix] case | expected | observed" (tests/test_support.h
matrix_row) after the checks behind them; ctest --output-junit keeps every test's output (gpu_check
raises the size kept for passed tests). Prints one table: case, expected, observed, the test and its
status, as a markdown table. A reliability test that failed before printing its rows shows as one row with its status, so
a missing row is never a silent pass. Exit status 1 when a listed test failed.
"""
import sys
import xml.etree.ElementTree as ET

# Tests whose names mark them as reliability cases: a failure of one of them is listed even when it
# printed no row.
RELIABILITY = ("Reliability", "BadNumbers", "Soak", "Capturable", "Deterministic", "Past32Bit", "PeerDeath",
               "Stalled", "RankDeath", "TimeOut", "Timeout")


def rows_of(path):
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        status = case.get("status", "")
        if case.find("failure") is not None or status == "fail":
            status = "FAILED"
        elif case.find("skipped") is not None or status in ("notrun", "disabled"):
            status = "skipped"
        else:
            status = "passed"
        text = "".join(e.text or "" for e in case.iter("system-out"))
        found = False
        for line in text.splitlines():
            line = line.strip()
            if not line.startswith("[matrix] "):
                continue
            parts = [p.strip() for p in line[len("[matrix] "):].split(" | ")]
            parts += [""] * (3 - len(parts))
            out.append((parts[0], parts[1], " | ".join(parts[2:]), name, status))
            found = True
        if not found and status != "passed" and any(k in name for k in RELIABILITY):
            out.append(("(no row printed)", "", "", name, status))
    return out


SELF_TEST_XML = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="x" tests="3" failures="1">
 <testcase name="ReliabilityA" status="run"><system-out>noise
[matrix] case one | must hold | held
more</system-out></testcase>
 <testcase name="ReliabilitySoakB" status="fail"><failure message="boom"/><system-out>no rows</system-out></testcase>
 <testcase name="OtherC" status="run"><system-out>[matrix] two | a | b | c</system-out></testcase>
</testsuite>
"""


def self_test():
    import os
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
        f.write(SELF_TEST_XML)
    try:
        rows = rows_of(f.name)
    finally:
        os.unlink(f.name)
    want = [("case one", "must hold", "held", "ReliabilityA", "passed"),
            ("(no row printed)", "", "", "ReliabilitySoakB", "FAILED"),
            ("two", "a", "b | c", "OtherC", "passed")]
    assert rows == want, rows
    print("reliability_matrix self-test: ok")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    rows = []
    for p in args:
        try:
            rows += rows_of(p)
        except (OSError, ET.ParseError) as e:
            print(f"# {p}: {e}")
    if not rows:
        print("# reliability matrix: no rows (no JUnit file with [matrix] lines)")
        return 0
    head = ("case", "expected", "observed", "test", "status")
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in head) + " |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    failed = sum(r[4] == "FAILED" for r in rows)
    print(f"# reliability matrix: {len(rows)} rows, {failed} from failed tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
