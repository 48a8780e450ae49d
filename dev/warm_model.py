"""Model of warm-up segments (docs/design.md 6.10): uniform against sized per head.

Simulates the warm-up walks on targets.md's gates (g ~ N(0, 1), A_log, dt_bias ~ U(0, 1), lower
bound -5) for a case's (sequence, head) pairs and predicts the slowest CTA, in microseconds, of
(1) uniform segments (the best of 4..256 chunks, CTAs list-scheduled on the SMs, each its warm-up
and its segment at STEP_US a chunk plus its walk at WALK_US per step of 4 chunks) and (2) segments
sized per pair (t - need_p chunks for the least t that fits one CTA per SM; no walk). Launches,
the pass and the plan kernel are not counted.
    python3 dev/warm_model.py S1 S2 P7
"""

import heapq
import sys

import numpy as np

STEP_US, WALK_US = 2.3, 1.2
LB = -5.0
L2E = np.log2(np.e)
CASES = {
    "P1": (1, 8192, 96),
    "P2": (1, 8192, 64),
    "P5": (1, 32768, 32),
    "P7": (1, 2048, 32),
    "S1": (1, 1024, 4),
    "S2": (1, 2048, 12),
    "S3": (1, 4096, 8),
    "S4": (1, 8192, 12),
    "S5": (1, 16384, 4),
    "S6": (2, 8192, 8),
    "S7": (4, 4096, 16),
    "S9": (1, 16384, 16),
    "S11": (1, 65536, 4),
}


def chunk_sums(T, rng):
    A = np.exp(rng.uniform())
    dt = rng.uniform(size=128).astype(np.float32)
    out = np.empty(T // 16)
    for i in range(0, T, 4096):
        g = rng.standard_normal((min(4096, T - i), 128), dtype=np.float32)
        ymin = (A * (g + dt)).min(1)
        a2 = LB * L2E / (1 + np.exp(-ymin))
        out[i // 16 : (i + len(a2)) // 16] = a2.reshape(-1, 16).sum(1)
    return out


def need(cs, c0, bits, cap=48):
    s = 0.0
    for w in range(1, c0 + 1):
        s += cs[c0 - w]
        if s <= -bits:
            return w
        if w >= cap:
            return None
    return c0  # reaches start: exact from start


def sched(times, sms):
    h = [0.0] * sms
    heapq.heapify(h)
    for t in times:
        f = heapq.heappop(h)
        heapq.heappush(h, f + t)
    return max(h)


def run(case, bits, step=STEP_US, walk_step=WALK_US, sms=132, seed=0):
    N, T, H = CASES[case]
    rng = np.random.default_rng(seed)
    L = T // 16
    pairs = [chunk_sums(T, rng) for _ in range(N * H)]
    best = None
    for s in [4, 8, 16, 32, 64, 128, 256]:
        if s >= L:
            break
        times = []
        for j in range(0, L // s):
            for cs in pairs:  # blockIdx: slot-major, head-minor
                c0 = j * s
                w = need(cs, c0, bits) if c0 > 0 else 0
                if w is None:
                    w = 48
                times.append((w + s) * step + (np.ceil(w / 4) * walk_step if c0 > 0 else 0))
        t = sched(times, sms)
        if best is None or t < best[0]:
            best = (t, s)
    # per-pair sized: needs per pair = max over all starts
    nd = []
    for cs in pairs:
        m = 0
        for c0 in range(1, L):
            w = need(cs, c0, bits)
            m = max(m, 48 if w is None else w)
        nd.append(m)
    nd = np.array(nd)
    bestp = None
    for Tc in range(1, L + 64):
        segs = [max(1, min(L, Tc - w)) for w in nd]
        cnt = sum(-(-L // s) for s in segs)
        if cnt <= sms:
            times = []
            for cs, s in zip(pairs, segs):
                for c0 in range(0, L, s):
                    w = need(cs, c0, bits) if c0 > 0 else 0
                    if w is None:
                        w = 48
                    times.append((w + min(s, L - c0)) * step)  # walk replaced by chunk sums
            bestp = (max(times), Tc, cnt)
            break
    return best, bestp, int(np.median(nd)), int(nd.max())


if __name__ == "__main__":
    for case in sys.argv[1:]:
        for bits in (16, 12):
            b, bp, med, mx = run(case, bits)
            sized = f"t {bp[1]} -> {bp[0]:.0f} us, {bp[2]} CTAs" if bp else "-"
            print(
                f"{case} bits {bits}: uniform seg {b[1]} -> {b[0]:.0f} us | sized: {sized}"
                f" | needs median {med} max {mx}"
            )
