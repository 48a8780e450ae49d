#!/usr/bin/env python3
"""FLA's chunk_kda (fla-core 0.6.0, Triton) and kda.prefill through Python, side by side, on the
prefill cases P1..P7 and S1..S11 of targets.md.

Same shapes, dtypes, distributions and options as bench/bench_gpu_prefill: bf16 q, k, v, g, beta
~ randn; A_log, dt_bias ~ U(0, 1); gate computed in the kernel with lower bound -5 (FLA's
``safe_gate`` form ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``); beta logits (sigmoid in
the kernel); l2norm in the kernel; fp32 initial state (0.1 randn) and final state, V-first.
Timing: triton.testing.do_bench (median, after its own warm-up, L2 cleared before every call),
the same for both libraries in the same process. Effective bandwidth counts the same bytes as
the C++ benchmark. ``--kda`` also times ``kda.prefill`` (this project's Python surface, eager, on
the same inputs and options) and prints its error against FLA's output; ``--no-fla`` times kda
alone (FLA's Triton compilation takes most of a case's time).

Usage: python3 bench/peers/fla_prefill_bench.py [--csv PATH] [--json PATH] [--case P3,S1]
       [--kda] [--no-fla]
Exits 0 with a message when torch or a CUDA GPU is missing, or fla is missing without --no-fla.
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
    ("S1", [1024], False, 4, 0, 0.123),
    ("S2", [2048], False, 12, 0, 0.236),
    ("S3", [4096], False, 8, 0, 0.420),
    ("S4", [8192], False, 12, 0, 0.857),
    ("S5", [16384], False, 4, 0, 1.531),
    ("S6", [8192] * 2, False, 8, 0, 0.883),
    ("S7", [4096] * 4, False, 16, 0, 0.618),
    ("S8", [2048] * 8, False, 24, 0, 0.649),
    ("S9", [16384], False, 16, 0, 1.722),
    ("S10", [1024] * 8, False, 12, 0, 0.207),
    ("S11", [65536], False, 4, 0, 6.107),
]
K = V = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", help="write the table as CSV to this path")
    ap.add_argument("--json", help="write the table as JSON to this path")
    ap.add_argument("--case", help="comma-separated cases to run (default: all)")
    ap.add_argument("--kda", action="store_true", help="also time kda.prefill through Python")
    ap.add_argument("--no-fla", action="store_true", help="do not run FLA (implies --kda)")
    args = ap.parse_args()
    run_fla, run_kda = not args.no_fla, args.kda or args.no_fla
    wanted = set(args.case.split(",")) if args.case else None

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
    except ImportError:
        print("fla_prefill_bench: triton is not installed; nothing to do")
        return 0
    chunk_kda = kda = None
    if run_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # ImportError, or a Triton/torch mismatch at import time
            print(f"fla_prefill_bench: fla (fla-core) is not importable ({type(e).__name__}: {e}); "
                  "nothing to do")
            return 0
    if run_kda:
        import kda

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    rows = []
    hdr = (f"{'case':4} {'sequences':26} {'H':>4} {'FLA ms':>8} {'kda ms':>8} {'FLA/kda':>8} "
           f"{'kda GB/s':>9} {'rel err':>8} {'targets FLA':>12} {'FlashKDA':>9} {'FKDA/kda':>9}")
    print(hdr)
    for name, lens, varlen, H, fla_target, fkda in CASES:
        if wanted is not None and name not in wanted:
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

        fla_ms = kda_ms = err = float("nan")
        ok = True
        o_fla = o_kda = None
        with torch.inference_mode():
            if run_fla:
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
                o_fla, ht = run()
                torch.cuda.synchronize()
                ok = ok and bool(torch.isfinite(o_fla).all()) and bool(torch.isfinite(ht).all())
                fla_ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                run = ht = None
            if run_kda:
                # kda takes the varlen tensors as [1, T, ...] and dt_bias as [HV, K].
                run = functools.partial(
                    kda.prefill, q, k, v, gate, beta,
                    A_log=A_log, dt_bias=dt_bias.view(HV, K), cu_seqlens=cu,
                    gate="lower_bound", lower_bound=-5.0, beta_logits=True,
                    use_qk_l2norm=True, initial_state=h0, output_final_state=True,
                )
                o_kda, ht = run()
                torch.cuda.synchronize()
                ok = ok and bool(torch.isfinite(o_kda).all()) and bool(torch.isfinite(ht).all())
                kda_ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                run = ht = None
            if o_fla is not None and o_kda is not None:
                d = (o_kda.float() - o_fla.float()).norm() / o_fla.float().norm().clamp_min(1e-30)
                err = float(d)
        nbytes = (total * (2 * H * K + 2 * HV * V + 2 * HV * K + 2 * HV * V + 2 * HV)
                  + 2 * N * HV * V * K * 4)
        gbps = nbytes / (kda_ms * 1e-3) / 1e9
        if varlen:
            more = ",..." if len(lens) > 6 else ""
            seqs = "varlen " + ",".join(str(n) for n in lens[:6]) + more
        else:
            seqs = f"{N} x {lens[0]}"
        print(f"{name:4} {seqs:26} {H:>4} {fla_ms:8.3f} {kda_ms:8.3f} {fla_ms / kda_ms:8.2f} "
              f"{gbps:9.0f} {err:8.1e} {fla_target:12.3f} {fkda:9.3f} {fkda / kda_ms:9.2f}"
              + ("" if ok else "  NON-FINITE OUTPUT"))
        sys.stdout.flush()
        rows.append(dict(case=name, sequences=seqs, H=H, fla_ms=fla_ms, kda_python_ms=kda_ms,
                         kda_gbps=gbps, rel_diff_vs_fla=err, targets_fla_ms=fla_target,
                         flashkda_ms=fkda, finite=ok))
        q = k = v = gate = beta = h0 = o_fla = o_kda = None
        torch.cuda.empty_cache()

    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,sequences,H,fla_ms,kda_python_ms,kda_gbps,rel_diff_vs_fla,"
                    "targets_fla_ms,flashkda_ms\n")
            for r in rows:
                f.write(f'{r["case"]},"{r["sequences"]}",{r["H"]},{r["fla_ms"]:.4f},'
                        f'{r["kda_python_ms"]:.4f},{r["kda_gbps"]:.1f},{r["rel_diff_vs_fla"]:.3e},'
                        f'{r["targets_fla_ms"]:.3f},{r["flashkda_ms"]:.3f}\n')
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
