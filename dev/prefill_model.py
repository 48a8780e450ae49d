#!/usr/bin/env python3
"""FLOP / byte / chain model of the KDA prefill on the targets.md cases (docs/design.md, section 6).

Prints, per case, the memory floor, the FLOPs, and the predicted time of the planned fused,
segment-parallel prefill: each pass takes the longest of its serial chain, its FLOPs at the
sustained tensor rate and its bytes at the sustained bandwidth; segmented cases add a transition
matrix per segment (pass 1), a scan over segments and a second pass from the true start states.
"""
import math

K = V = 128
L = 64                      # tokens per state step of the recurrence (the record's chunk)
SMS = 132
BW = 3.5e12                 # sustained bytes/s of a streaming kernel (copy peak ~4.3e12)
RATE = 300e12               # sustained FLOP/s (bf16 wgmma + the tf32 products)
STEP = 3.2e-6               # target serial step per 64 tokens (four 16-token steps of 0.8 us)
SCAN_STEP = 3e-6            # one 128 x 128 x 128 fp32 step of the segment scan
LAUNCH = 8e-6               # launches and tails per pass
CHAINS_PER_SM = 2           # independent chains interleaved on one SM (two consumer warpgroups,
                            # each a 64-column state slice of its own (segment, head) chain)



def flops_per_64(c):
    """FLOP per 64 tokens and value head with records of c tokens: state-independent (Akk + Aqk
    on triangles, W = Tm kg, Ut = Tm v), state-dependent (W S, qg S, kb^T U, Aqk U), and a
    segment's transition matrix carried as a 128-column state."""
    n = 64 // c
    prep = n * (2 * c * c * K * 2 * 0.5 + 2 * c * c * K + 2 * c * c * V)
    rec = n * (2 * c * K * V * 3 + 2 * c * c * V)
    trans = n * (2 * c * K * K * 2)
    return prep, rec, trans


CHUNK = 16                  # the record size of the plan (16-token records, as today's fast path)
PREP, REC, TRANS = flops_per_64(CHUNK)

CASES = {  # name: (sequence lengths, heads, FlashKDA ms, must ms)
    "P1": ([8192], 96, 1.405, 0.70), "P2": ([8192], 64, 1.200, 0.60),
    "P3": ([1300, 547, 2048, 963, 271, 3063], 96, 1.401, 0.70),
    "P4": ([1024] * 8, 96, 1.194, 0.60), "P5": ([32768], 32, 3.830, 1.90),
    "P6": ([4096] * 16, 32, 3.024, 1.50), "P7": ([2048], 32, 0.274, 0.137),
    "S1": ([1024], 4, 0.123, 0.062), "S2": ([2048], 12, 0.236, 0.118),
    "S3": ([4096], 8, 0.420, 0.210), "S4": ([8192], 12, 0.857, 0.43),
    "S5": ([16384], 4, 1.531, 0.77), "S6": ([8192] * 2, 8, 0.883, 0.44),
    "S7": ([4096] * 4, 16, 0.618, 0.31), "S8": ([2048] * 8, 24, 0.649, 0.32),
    "S9": ([16384], 16, 1.722, 0.86), "S10": ([1024] * 8, 12, 0.207, 0.10),
    "S11": ([65536], 4, 6.107, 0.90),
}


def floor_bytes(seqs, H):
    T = sum(seqs)
    return T * H * (K * 2 * 3 + V * 2 * 2 + 2) + len(seqs) * H * K * V * 4 * 2


def pass_time(seqs, H, S, flop_per_chunk, nbytes):
    """A pass over every chunk: the CTAs of a 2-CTA cluster per (segment, head) each own 64 value
    columns and build half of the records (shared through distributed shared memory), so a CTA
    spends flop_per_chunk / 2 per chunk; CHAINS_PER_SM chains share an SM's tensor cores."""
    per_seg = max(math.ceil(math.ceil(s / L) / S) for s in seqs)
    ctas = 2 * len(seqs) * H * S
    chunks = sum(math.ceil(s / L) for s in seqs) * H
    sm_rate = RATE / SMS
    busy = min(ctas, SMS * CHAINS_PER_SM)               # chains in flight
    per_sm = min(CHAINS_PER_SM, busy / SMS)             # chains sharing one SM
    step = max(STEP, per_sm * flop_per_chunk / 2 / sm_rate)  # one chunk of one chain
    chain = per_seg * step                              # the longest chain
    work = 2 * chunks * step / busy                     # all chains spread over those in flight
    return max(chain, work, nbytes / BW) + LAUNCH


def predict(seqs, H):
    """The segment count a heuristic should choose (the fastest predicted, at least 4 x 64
    tokens per segment), with its FLOPs and predicted time."""
    longest = max(math.ceil(s / L) for s in seqs)
    return min((predict_with(seqs, H, S) for S in range(1, max(1, longest // 4) + 1)),
               key=lambda r: r[2])


def predict_with(seqs, H, S):
    chunks = sum(math.ceil(s / L) for s in seqs) * H
    nbytes = floor_bytes(seqs, H)
    if S == 1:
        return S, chunks * (PREP + REC), pass_time(seqs, H, 1, PREP + REC, nbytes)
    later = (S - 1) / S                                  # share of chunks after a first segment
    f1 = PREP + REC + later * TRANS                      # pass 1: S_local, and M after segment 0
    f2 = (PREP + REC) * later                            # pass 2: later segments from S_start
    t1 = pass_time(seqs, H, S, f1, nbytes)
    t2 = pass_time(seqs, H, S, f2, nbytes * later)
    scan = (S - 1) * SCAN_STEP + LAUNCH
    return S, chunks * (f1 + f2), t1 + scan + t2


def main():
    for c in (64, 16):
        p, r, t = flops_per_64(c)
        print(f"{c}-token records, per 64 tokens and head: state-independent {p / 1e6:.2f} MFLOP, "
              f"state-dependent {r / 1e6:.2f}, segment transition {t / 1e6:.2f}")
    print(f"plan: {CHUNK}-token records, {RATE / 1e12:.0f} TFLOP/s sustained, "
          f"{BW / 1e12:.1f} TB/s, {STEP * 1e6:.1f} us serial step per 64 tokens")
    print("| case | chains | chunks per chain | floor GB | floor ms | GFLOP (1 pass) | segments "
          "| GFLOP (planned) | predicted ms | must ms | FlashKDA ms | predicted vs FlashKDA |")
    print("| --- " * 12 + "|")
    ratios = []
    for name, (seqs, H, fk, must) in CASES.items():
        chunks = sum(math.ceil(s / L) for s in seqs) * H
        nbytes = floor_bytes(seqs, H)
        S, flop, t = predict(seqs, H)
        ratios.append(fk / (t * 1e3)) if name.startswith("S") else None
        print(f"| {name} | {len(seqs) * H} | {max(math.ceil(s / L) for s in seqs)} | "
              f"{nbytes / 1e9:.3f} | {nbytes / 4.3e12 * 1e3:.3f} | "
              f"{chunks * (PREP + REC) / 1e9:.1f} | {S} | {flop / 1e9:.1f} | {t * 1e3:.3f} | "
              f"{must} | {fk} | {fk / (t * 1e3):.1f}x |")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"S1-S11 geomean vs FlashKDA (predicted): {geo:.1f}x")


if __name__ == "__main__":
    main()
