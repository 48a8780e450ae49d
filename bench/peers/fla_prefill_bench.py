#!/usr/bin/env python3
"""FLA's chunk_kda (fla-core 0.6.0, Triton) on the prefill cases P1..P7 of targets.md.

Same shapes, dtypes, distributions and options as bench/bench_gpu_prefill: bf16 q, k, v, g, beta
~ randn; A_log, dt_bias ~ U(0, 1); gate computed in the kernel with lower bound -5 (FLA's
``safe_gate`` form ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``); beta logits (sigmoid in
the kernel); l2norm in the kernel; fp32 initial state (0.1 randn) and final state, V-first.
Timing: triton.testing.do_bench (median, after its own warm-up). Effective bandwidth counts the
same bytes as the C++ benchmark.

Usage: python3 bench/peers/fla_prefill_bench.py [--csv PATH] [--case P3]
Exits 0 with a message when torch, a CUDA GPU or fla is missing.
"""

import argparse
import functools
import os
import sys

CASES = [
    # name, sequence lengths, varlen, H, FLA ms (targets.md), FlashKDA ms (targets.md)
    ("P1", [8192], False, 96, 2.669, 1.405),
    ("P2", [8192], False, 64, 1.771, 1.200),
    ("P3", [1300, 547, 2048, 963, 271, 3063], True, 96, 2.668, 1.401),
    ("P4", [1024] * 8, True, 96, 2.635, 1.194),
    ("P5", [32768], False, 32, 3.706, 3.830),
    ("P6", [4096] * 16, False, 32, 7.418, 3.024),
    ("P7", [2048], False, 32, 0.984, 0.274),
]
K = V = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", help="write the table as CSV to this path")
    ap.add_argument("--case", help="run only this case (P1..P7)")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("fla_prefill_bench: torch is not installed; nothing to do")
        return 0
    if not torch.cuda.is_available():
        print("fla_prefill_bench: no CUDA GPU; nothing to do")
        return 0
    # FLA may hand chunk_kda to the FlashKDA CUDA backend when that package is installed: measure
    # FLA's own Triton path.
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    try:
        import triton
        from fla.ops.kda import chunk_kda
    except Exception as e:  # ImportError, or a Triton/torch mismatch at import time
        print(f"fla_prefill_bench: fla (fla-core) is not importable ({type(e).__name__}: {e}); "
              "nothing to do")
        return 0

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    rows = []
    hdr = (f"{'case':4} {'sequences':34} {'H':>4} {'FLA ms':>9} {'GB/s':>8} {'targets FLA':>12} "
           f"{'FlashKDA':>9}")
    print(hdr)
    for name, lens, varlen, H, fla_target, fkda in CASES:
        if args.case and args.case != name:
            continue
        HV = H
        N = len(lens)
        total = sum(lens)
        B, T = (1, total) if varlen else (N, lens[0])
        g = torch.Generator(device=dev)
        g.manual_seed(0)

        def randn(*shape, g=g):
            x = torch.randn(*shape, device=dev, dtype=torch.float32, generator=g)
            return x.to(torch.bfloat16)

        q, k = randn(B, T, H, K), randn(B, T, H, K)
        v, gate, beta = randn(B, T, HV, V), randn(B, T, HV, K), randn(B, T, HV)
        A_log = torch.rand(HV, device=dev, generator=g)
        dt_bias = torch.rand(HV * K, device=dev, generator=g)
        h0 = 0.1 * torch.randn(N, HV, V, K, device=dev, generator=g)  # V-first, fp32
        cu = None
        if varlen:
            offs = [0]
            for n in lens:
                offs.append(offs[-1] + n)
            cu = torch.tensor(offs, device=dev, dtype=torch.long)

        run = functools.partial(
            chunk_kda, q, k, v, gate, beta,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            lower_bound=-5.0,
            state_v_first=True,
            cu_seqlens=cu,
            A_log=A_log,
            dt_bias=dt_bias,
        )

        with torch.inference_mode():
            o, ht = run()
            torch.cuda.synchronize()
            ok = bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht).all())
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        nbytes = (total * (2 * H * K + 2 * HV * V + 2 * HV * K + 2 * HV * V + 2 * HV)
                  + 2 * N * HV * V * K * 4)
        gbps = nbytes / (ms * 1e-3) / 1e9
        if varlen:
            more = ",..." if len(lens) > 6 else ""
            seqs = "varlen " + ",".join(str(n) for n in lens[:6]) + more
        else:
            seqs = f"{N} x {lens[0]}"
        print(f"{name:4} {seqs:34} {H:>4} {ms:9.3f} {gbps:8.0f} {fla_target:12.3f} {fkda:9.3f}"
              + ("" if ok else "  NON-FINITE OUTPUT"))
        sys.stdout.flush()
        rows.append((name, seqs, H, ms, gbps, fla_target, fkda))
        run = q = k = v = gate = beta = h0 = o = ht = None
        torch.cuda.empty_cache()

    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,sequences,H,fla_ms,gbps,targets_fla_ms,flashkda_ms\n")
            for r in rows:
                f.write(f'{r[0]},"{r[1]}",{r[2]},{r[3]:.4f},{r[4]:.1f},{r[5]:.3f},{r[6]:.3f}\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
