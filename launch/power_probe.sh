#!/usr/bin/env bash
# Runs a command while nvidia-smi samples GPU 0's SM clock and board power every 50 ms, then prints
# the medians over the command's busy samples: utilization >= 90% and power >= 500 W, after the
# first 0.7 s of them (the climb into the power cap; the board's instantaneous power overshoots to
# 750-950 W there, so a threshold relative to the peak does not work). At the 700 W cap a kernel's
# time follows its energy per unit of work, so two implementations of the same FLOPs compare as
# (clock) x (work per cycle): this gives the first factor.
#   launch/power_probe.sh LABEL CMD [ARGS...]      writes ${OUT:-/tmp}/power_LABEL.csv
set -euo pipefail
label=$1
shift
csv="${OUT:-/tmp}/power_${label}.csv"
pq=power.draw.instant
nvidia-smi -i 0 --query-gpu=$pq --format=csv > /dev/null 2>&1 || pq=power.draw  # (older drivers)
nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,$pq,utilization.gpu --format=csv,noheader,nounits \
  -lms 50 > "$csv" 2> /dev/null &
smi=$!
rc=0
"$@" || rc=$?
sleep 0.2
kill "$smi" 2> /dev/null || true
wait "$smi" 2> /dev/null || true
python3 - "$csv" "$label" << 'PY'
import csv, statistics, sys
from datetime import datetime
rows = []
for r in csv.reader(open(sys.argv[1])):
    try:
        t = datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(r[1]), float(r[2]), float(r[3])))
    except (ValueError, IndexError):
        pass
if not rows:
    print(f"[power] {sys.argv[2]}: no samples"); sys.exit(0)
peak = max(p for _, _, p, _ in rows)
busy = [r for r in rows if r[3] >= 90 and r[2] >= 500]
t0 = busy[0][0] if busy else 0
busy = [r for r in busy if r[0] >= t0 + 0.7]
if not busy:
    print(f"[power] {sys.argv[2]}: no busy samples (peak {peak:.0f} W)"); sys.exit(0)
clk = statistics.median(r[1] for r in busy)
pw = statistics.median(r[2] for r in busy)
print(f"[power] {sys.argv[2]}: {len(busy)} busy samples of {len(rows)}, SM clock median {clk:.0f} MHz "
      f"(p10 {sorted(r[1] for r in busy)[len(busy)//10]:.0f}), power median {pw:.0f} W (peak {peak:.0f} W)")
PY
exit $rc
