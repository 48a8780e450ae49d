#!/usr/bin/env python3
"""Model of the chain-prepares-its-own-chunks prefill (docs/design.md section 6.7).

One CTA (one warpgroup, two CTAs per SM: 264 slots on 132 SMs) per (sequence, value head,
segment) walks 16-token chunks with the whole 128 x 128 state; it builds chunk c + 1's operands
while chunk c's wgmmas run, so a chunk costs one step whatever the preparation needs within it.
A sequence splits into p segments, each starting WARMUP chunks early from a zero state (the
run-time bound of section 6.7: ~87 tokens for the lower-bound gate at -5 on targets.md's random
inputs); p is the best of 1 .. 264 // chains. A call takes the longest of its waves of CTAs
(greedy packing) plus 10 us of launch and tail, or its bytes at 4.3 TB/s, whichever is longer.

Prints the table of section 6.7 for steps of 1 and 2 us per chunk. With --ws, the
warp-specialized kernel of section 6.9 instead: one CTA per SM (132 slots), one segment per
sequence, a chunk costing the longer of the consumers' state step and the producer's preparation
(steps of 1.0 and 1.3 us).
"""
import heapq
import math
import sys

SLOTS = 264
LAUNCH_US = 10.0
WARMUP = 6  # chunks of 16 tokens
K = V = 128

# name, sequence lengths, heads, FlashKDA ms, must ms (targets.md), measured ms (2026-12-01)
CASES = [
    ("P1", [8192], 96, 1.405, 0.70, 1.170),
    ("P2", [8192], 64, 1.200, 0.60, 0.903),
    ("P3", [1300, 547, 2048, 963, 271, 3063], 96, 1.401, 0.70, 1.123),
    ("P4", [1024] * 8, 96, 1.194, 0.60, 1.129),
    ("P5", [32768], 32, 3.830, 1.90, 2.192),
    ("P6", [4096] * 16, 32, 3.024, 1.50, 2.744),
    ("P7", [2048], 32, 0.274, 0.137, 0.199),
    ("S1", [1024], 4, 0.123, 0.062, 0.088),
    ("S2", [2048], 12, 0.236, 0.118, 0.137),
    ("S3", [4096], 8, 0.420, 0.210, 0.168),
    ("S4", [8192], 12, 0.857, 0.43, 0.332),
    ("S5", [16384], 4, 1.531, 0.77, 0.272),
    ("S6", [8192] * 2, 8, 0.883, 0.44, 0.369),
    ("S7", [4096] * 4, 16, 0.618, 0.31, 0.484),
    ("S8", [2048] * 8, 24, 0.649, 0.32, 0.627),
    ("S9", [16384], 16, 1.722, 0.86, 0.629),
    ("S10", [1024] * 8, 12, 0.207, 0.10, 0.187),
    ("S11", [65536], 4, 6.107, 0.90, 0.696),
]


def predict(lens, heads, step_us, slots=SLOTS, max_segs=None):
    chains = len(lens) * heads
    tokens = sum(lens)
    floor_ms = (tokens * heads * (5 * K * 2 + 2) + 2 * len(lens) * heads * K * V * 4) / 4.3e12 * 1e3
    best = None
    top = max(1, slots // chains) if max_segs is None else max_segs
    for segs in range(1, top + 1):
        ctas = []
        for n in lens:
            chunks = math.ceil(n / 16)
            p = min(segs, chunks)
            ctas += [math.ceil(chunks / p) + (min(WARMUP, chunks) if p > 1 else 0)] * (p * heads)
        load = [0] * slots
        for w in sorted(ctas, reverse=True):
            heapq.heappush(load, heapq.heappop(load) + w)
        ms = max((max(load) * step_us + LAUNCH_US) / 1e3, floor_ms)
        if best is None or ms < best[1]:
            best = (segs, ms)
    return chains, best[0], floor_ms, best[1]


def main_ws():
    steps = (1.0, 1.3)
    print("| case | CTAs | floor ms | " + " | ".join(f"{s} us / chunk" for s in steps) +
          " | must ms | FlashKDA ms | two-kernel plan ms |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in steps) + " | --- | --- | --- |")
    for name, lens, heads, fk, must, now in CASES:
        res = [predict(lens, heads, s, slots=132, max_segs=1) for s in steps]
        cells = " | ".join(f"{r[3]:.3f}" for r in res)
        print(f"| {name} | {res[0][0]} | {res[0][2]:.3f} | {cells} | {must} | {fk} | {now:.3f} |")


def main():
    if "--ws" in sys.argv:
        main_ws()
        return
    print("| case | chains | segments | floor ms | 1 us / chunk | 2 us / chunk | must ms | "
          "measured ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = {1: [], 2: []}
    for name, lens, heads, fk, must, now in CASES:
        chains, segs, floor_ms, one = predict(lens, heads, 1.0)
        segs2, two = predict(lens, heads, 2.0)[1::2]
        if name.startswith("S"):
            ratios[1].append(fk / one)
            ratios[2].append(fk / two)
        print(f"| {name} | {chains} | {segs} / {segs2} | {floor_ms:.3f} | {one:.3f} | {two:.3f} | "
              f"{must} | {now:.3f} |")
    for s in (1, 2):
        g = math.exp(sum(map(math.log, ratios[s])) / len(ratios[s]))
        print(f"S1-S11 geomean vs FlashKDA at {s} us per chunk: {g:.1f}x")


if __name__ == "__main__":
    main()
