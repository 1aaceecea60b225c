#!/usr/bin/env python3
"""Side-by-side per-kernel counters from Nsight Compute raw CSV exports (launch/ncu_compare.sh).

  python3 launch/ncu_table.py SHAPE LABEL=FILE.csv [LABEL=FILE.csv ...]
  python3 launch/ncu_table.py --self-test          check the parser on a built-in sample

SHAPE is E,k,hidden,ffn,T. Each FILE is `ncu --import R.ncu-rep --csv --page raw --print-units base`.
Launches of the same kernel (demangled name and grid) are folded into their median. The table puts
every counter per useful MAC of the kernel's GEMM, so that kernels of different sizes and tiles
compare: the useful MACs of a kernel whose name holds "up" are T k hidden 2 ffn, of one whose name
holds "down" T k hidden ffn (a kernel that covers only part of the rows, as the split pipeline's
192-row halves, is then under-counted: read its 'exec/useful' column). Why per MAC: at the H200's
700 W cap a kernel's time follows its energy per unit of work (measured), and the
bytes each MAC moves through L2, DRAM and shared memory, and the instructions it takes, are where
that energy goes beside the tensor cores.
"""
import csv
import statistics
import sys

# (column title, metric, scale); scale None = print the raw value (percent, Hz, ns)
COLUMNS = [
    ("us", "gpu__time_duration.sum", 1e-3),
    ("GHz", "sm__cycles_elapsed.avg.per_second", 1e-9),
    ("Mcyc", "sm__cycles_elapsed.max", 1e-6),
    ("tensor%", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed", None),
    ("exec/useful", "sm__ops_path_tensor_src_bf16_dst_fp32.sum", "exec"),
    ("L2 B/kMAC", "lts__t_bytes.sum", "per_kmac"),
    ("L2rd sec/kMAC", "lts__t_sectors_op_read.sum", "per_kmac"),
    ("L2wr sec/kMAC", "lts__t_sectors_op_write.sum", "per_kmac"),
    ("L2red sec/kMAC", "lts__t_sectors_op_red.sum", "per_kmac"),
    ("DRAM rd B/kMAC", "dram__bytes_read.sum", "per_kmac"),
    ("DRAM wr B/kMAC", "dram__bytes_write.sum", "per_kmac"),
    ("smem wf/kMAC", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "per_kmac"),
    ("inst/kMAC", "smsp__inst_executed.sum", "per_kmac"),
    ("ldgsts/kMAC", "smsp__inst_executed_op_ldgsts.sum", "per_kmac"),
    ("L2 hit%", "lts__t_sector_hit_rate.pct", None),
]
PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
BASE_UNITS = ("second", "byte", "hz", "cycle", "sector", "inst", "warp", "wavefront")


def to_number(text, unit):
    t = text.replace(",", "").strip()
    if t in ("", "n/a", "N/A"):
        return None
    try:
        v = float(t)
    except ValueError:
        return None
    u = (unit or "").strip()
    # --print-units base gives base units; scale a prefixed unit anyway (Kbyte, msecond, Ghz, ...)
    # but not a percent or a plain count
    if len(u) > 1 and u[0] in PREFIX and u[1:].lower().startswith(BASE_UNITS):
        v *= PREFIX[u[0]]
    if u.lower().endswith("second") and not u.lower().endswith("/second"):
        v *= 1e9  # durations in ns
    return v


def read_launches(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Kernel Name' header (not an ncu --csv --page raw export?)")
    hdr, units = rows[start], rows[start + 1]
    out = []
    for r in rows[start + 2:]:
        if len(r) != len(hdr):
            continue
        d = dict(zip(hdr, r))
        vals = {h: to_number(v, u) for h, v, u in zip(hdr, r, units)}
        out.append((d["Kernel Name"], d.get("Grid Size", ""), vals))
    return out


def function_name(name):
    """The demangled name up to its parameter list, without namespaces: 'sm90_down_kernel<1>'."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not name.startswith("(anonymous", i):
            name = name[:i]
            break
    return name.replace("epmoe::kernels::", "").replace("(anonymous namespace)::", "").replace("void ", "")


def short_name(name, width=44):
    base = function_name(name)
    return base if len(base) <= width else base[: width - 1] + "~"


def useful_macs(name, shape):
    E, k, hidden, ffn, T = shape
    low = function_name(name).split("<")[0].lower()
    if "down" in low:
        return T * k * hidden * ffn
    if "up" in low:
        return T * k * hidden * 2 * ffn
    return None


def fmt(v):
    if v is None:
        return "-"
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 10 else f"{v:.3f}"


def build_table(shape, runs):
    """runs: [(label, csv path)] -> [(label, kernel, grid, launches, [cell per COLUMNS])]."""
    table = []
    for label, path in runs:
        groups = {}
        for name, grid, vals in read_launches(path):
            groups.setdefault((name, grid), []).append(vals)
        for (name, grid), launches in groups.items():
            # a dense GEMM's label names it (LABEL=dense_up / dense_down); ours are named by kernel
            macs = useful_macs(label if label.startswith("dense") else name, shape)
            cells = []
            for _, metric, scale in COLUMNS:
                xs = [r.get(metric) for r in launches if r.get(metric) is not None]
                v = statistics.median(xs) if xs else None
                if v is None:
                    cells.append(None)
                elif scale is None:
                    cells.append(v)
                elif scale == "exec":  # taken as 2 ops per MAC (FLOPs); ~0.5 here would mean it counts MACs
                    cells.append(v / 2 / macs if macs else None)
                elif scale == "per_kmac":
                    cells.append(v / macs * 1e3 if macs else None)
                else:
                    cells.append(v * scale)
            table.append((label, short_name(name), grid, len(launches), cells))
    return table


def render(shape_text, table):
    titles = ["run", "kernel", "grid", "n"] + [c[0] for c in COLUMNS]
    widths = [max(len(titles[0]), *(len(t[0]) for t in table)), max(len(titles[1]), *(len(t[1]) for t in table)),
              max(len(titles[2]), *(len(t[2]) for t in table)), 3]
    widths += [max(len(c[0]), 7) for c in COLUMNS]
    lines = [f"# ncu counters per useful MAC, shape E,k,hidden,ffn,T = {shape_text} (medians over each kernel's launches)",
             " | ".join(t.rjust(w) for t, w in zip(titles, widths)),
             "-+-".join("-" * w for w in widths)]
    for label, name, grid, n, cells in table:
        head = [label, name, grid, str(n)]
        lines.append(" | ".join(s.rjust(w) for s, w in zip(head + [fmt(c) for c in cells], widths)))
    return "\n".join(lines)


SAMPLE = """==PROF== Disconnected from process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum","sm__cycles_elapsed.avg.per_second","lts__t_bytes.sum","sm__ops_path_tensor_src_bf16_dst_fp32.sum"
"","","","","","","","","","","","usecond","Ghz","Gbyte",""
"0","1","b","h","void epmoe::kernels::(anonymous namespace)::sm90_down_kernel<true>(CUtensorMap, long const*, int)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","500","1.40","2","8,800,000,000"
"1","1","b","h","void epmoe::kernels::(anonymous namespace)::sm90_down_kernel<true>(CUtensorMap, long const*, int)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","520","1.44","4","8,800,000,000"
"2","1","b","h","void epmoe::kernels::(anonymous namespace)::sm90_up_pair_kernel<2>(CUtensorMap, long const*, int)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","n/a","1.5","1",""
"""


def self_test():
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.csv")
        with open(path, "w") as f:
            f.write(SAMPLE)
        shape = (2, 2, 1024, 512, 4096)  # T k = 8192 rows: DOWN 4.29e9 MACs, UP 8.59e9
        table = build_table(shape, [("ours", path)])
    assert [(t[1], t[3]) for t in table] == [("sm90_down_kernel<true>", 2), ("sm90_up_pair_kernel<2>", 1)], table
    col = {c[0]: i for i, c in enumerate(COLUMNS)}
    down, up = table[0][4], table[1][4]
    assert abs(down[col["us"]] - 510.0) < 1e-9, down  # median of 500 and 520 us, through ns
    assert abs(down[col["GHz"]] - 1.42) < 1e-9, down  # Ghz -> Hz -> GHz
    macs = 8192 * 1024 * 512
    assert abs(down[col["L2 B/kMAC"]] - 3e9 / macs * 1e3) < 1e-9, down  # median 3 Gbyte per kMAC
    assert abs(down[col["exec/useful"]] - 8.8e9 / 2 / macs) < 1e-12, down  # thousands separators
    assert up[col["us"]] is None and up[col["exec/useful"]] is None, up  # n/a and empty cells
    assert abs(up[col["L2 B/kMAC"]] - 1e9 / (2 * macs) * 1e3) < 1e-9, up  # UP's MACs are twice DOWN's
    assert useful_macs("dense_up", shape) == 2 * macs and useful_macs("nvjet_tst_256x128", shape) is None
    text = render("2,2,1024,512,4096", table)
    assert "sm90_down_kernel<true>" in text and "510.0" in text, text
    print("ncu_table self-test: OK")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    shape = tuple(int(v) for v in sys.argv[1].split(","))
    if len(shape) != 5:
        raise SystemExit("SHAPE is E,k,hidden,ffn,T")
    runs = [tuple(arg.partition("=")[::2]) for arg in sys.argv[2:]]
    print(render(sys.argv[1], build_table(shape, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
