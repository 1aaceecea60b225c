#!/usr/bin/env python3
"""Timeline model of the split UP's waves (docs/PERF.md, session 29). No GPU, no numpy.

  python3 docs/experiments/split_up_timeline.py

Per-expert counts are multinomial (uniform routing, 40 draws per shape). The 128-row UP runs its
items (tiles x column blocks, cost 1 each) with static striding over G CTAs and its last wave halved
when it is at most half full (TailSplit; a half item costs HALF_COST); the 192-row UP's CTAs take the
SMs in the order they free, each running items j, j + G, ... at 1.5 c (c: a tall row's cost against a
128-row one, 0.96 measured at 7168/T=2k in session 28, 1.0 at T=8k). Printed: UP time against the
128-row UP alone, for every expert expert_prefers_tall picks (WAVES=off) and for the wave test
(split_tall_cut in kernels/sm90_schedule.cuh, the default). It has no clock, L2 or DRAM terms: at E=256
the UP is weight-bound and the measured layer did not move.
"""
import random

G = 132           # H200 SMs
HALF_COST = 0.6   # a halved last-wave item against a whole one


def tall_tiles(seg, real):  # tall_tile_count
    t = -(-seg // 192)
    return t - 1 if t > 0 and 192 * (t - 1) >= real else t


def picked(real):  # expert_prefers_tall: (tall items per block, 128-row tiles) or None
    seg = -(-real // 128) * 128
    if seg == 0:
        return None
    tt = tall_tiles(seg, real)
    return (tt, seg // 128) if 192 * tt < seg else None


def wave_cut(counts, blocks, ctas):  # split_tall_cut
    tall = freed = best = cut = 0
    for e, r in enumerate(counts):
        p = picked(r)
        if p is None:
            continue
        tall += p[0] * blocks
        freed += p[1] * blocks
        score = 3 * ctas * (-(-tall // ctas)) - 2 * freed
        if score < best:
            best, cut = score, e + 1
    return cut


def up_time(counts, blocks, c, cut):
    n128 = ntall = 0
    for e, r in enumerate(counts):
        p = picked(r)
        if p is not None and e < cut:
            ntall += p[0] * blocks
        else:
            n128 += -(-r // 128) * blocks
    fin = [0.0] * G
    rem = n128 % G
    if rem and 2 * rem <= G:
        for w in range(n128 - rem):
            fin[w % G] += 1
        for h in range(2 * rem):
            fin[(n128 - rem + h) % G] += HALF_COST
    else:
        for w in range(n128):
            fin[w % G] += 1
    fin.sort()
    end = max(fin)
    for j in range(min(G, ntall)):
        end = max(end, fin[j] + len(range(j, ntall, G)) * 1.5 * c)
    return end


def main():
    random.seed(1)
    shapes = [("7168/T=2k", 32, 512, 16), ("7168/T=4k", 32, 1024, 16), ("7168/T=8k", 32, 2048, 16),
              ("E64 4096/768 T=4k", 64, 512, 6), ("7168/T=2.5k", 32, 640, 16)]
    for name, E, mean, blocks in shapes:
        draws = []
        for _ in range(40):
            cnt = [0] * E
            for _ in range(mean * E):
                cnt[random.randrange(E)] += 1
            draws.append(cnt)
        for c in (0.96, 1.0):
            off = [up_time(d, blocks, c, len(d)) / up_time(d, blocks, c, 0) for d in draws]
            on = [up_time(d, blocks, c, wave_cut(d, blocks, G)) / up_time(d, blocks, c, 0) for d in draws]
            print(f"{name:18s} c={c:.2f}  every picked: mean {sum(off) / 40:.3f} max {max(off):.3f}   "
                  f"wave test: mean {sum(on) / 40:.3f} max {max(on):.3f}")


if __name__ == "__main__":
    main()
