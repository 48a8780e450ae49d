#!/usr/bin/env python3
"""Training: forward + backward of FLA's chunk_kda (fla-core 0.6.0, Triton) and of kda.prefill
(the CUDA backward) side by side, and every gradient's error against the fp64 reference.

Timing cases (targets.md "Training"): 1 x 8192 tokens, H = 64 and 4 x 4096, H = 32; K = V = 128;
bf16 q, k, v, g, beta ~ randn; A_log, dt_bias ~ U(0, 1); the softplus gate computed in the
kernel, beta logits (sigmoid in the kernel), l2norm in the kernel; fp32 initial state (0.1
randn) and final state, V-first; an upstream gradient on the output only (bf16 randn). One step
is the forward and torch.autograd.grad of every input; median time of triton.testing.do_bench
(L2 cleared before each call), both libraries in one process.

Accuracy (``--accuracy``): case A of targets.md (1 x 8192 tokens, H = 8, lower bound -5) and the
same with the softplus gate; each gradient's relative L2 error against kda's fp64 reference
backward on CPU copies of the same (bf16-exact) inputs, for FLA and kda. ``--accuracy-tokens``
shortens the sequence (the reference is single-threaded per head: ~1 min at 8192 tokens).

Profile (``--profile``): the GPU time of each kernel of one kda step on each timing case
(torch.profiler, CUPTI), summed over the step and sorted, then the step's total.

Usage: python3 bench/peers/fla_train_bench.py [--accuracy] [--accuracy-tokens N] [--json PATH]
       [--no-fla] [--profile] [--cases T1,T2]
Exits 0 with a message when torch or a CUDA GPU is missing, or fla is missing without --no-fla.
"""

import argparse
import functools
import os
import sys

CASES = [
    # name, B, T, H, FLA forward ms, FLA forward + backward ms (targets.md)
    ("T1", 1, 8192, 64, 1.94, 10.82),
    ("T2", 4, 4096, 32, 1.90, 10.77),
]
K = V = 128
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def make_inputs(torch, dev, B, T, H, seed=0):
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    x = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V), g=randn(B, T, H, K),
             beta=randn(B, T, H), A_log=torch.rand(H, device=dev, generator=gen),
             dt_bias=torch.rand(H, K, device=dev, generator=gen),
             initial_state=0.1 * torch.randn(B, H, V, K, device=dev, generator=gen))
    do = randn(B, T, H, V)
    return x, do


def fla_step(chunk_kda, x, do, gate):
    """FLA forward + backward; the gradients in kda's layouts (dt_bias [H, K])."""
    import torch
    t = {n: v.detach().clone().requires_grad_() for n, v in x.items()}
    extra = dict(safe_gate=True, lower_bound=-5.0) if gate == "lower_bound" else {}
    o, _ = chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"],
                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     state_v_first=True, A_log=t["A_log"], dt_bias=t["dt_bias"].view(-1),
                     **extra)
    return torch.autograd.grad(o, [t[n] for n in NAMES], do, allow_unused=True)


def fla_forward(chunk_kda, x):
    import torch
    with torch.no_grad():
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                         initial_state=x["initial_state"], output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, state_v_first=True, A_log=x["A_log"],
                         dt_bias=x["dt_bias"].view(-1))


def kda_forward(kda, x):
    import torch
    with torch.no_grad():
        return kda.prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                           dt_bias=x["dt_bias"], initial_state=x["initial_state"],
                           output_final_state=True, gate="softplus", beta_logits=True)


def kda_step(kda, x, do, gate, backend="auto"):
    import torch
    t = {n: v.detach().clone().requires_grad_() for n, v in x.items()}
    o, _ = kda.prefill(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"],
                       dt_bias=t["dt_bias"], initial_state=t["initial_state"],
                       output_final_state=True, gate=gate, lower_bound=-5.0, beta_logits=True,
                       use_qk_l2norm=True, backend=backend)
    return torch.autograd.grad(o, [t[n] for n in NAMES], do)


def profile_step(torch, kda, x, do, name):
    """GPU time of each kernel of one kda step (after a warm-up step), in ms, largest first."""
    from torch.profiler import ProfilerActivity, profile
    kda_step(kda, x, do, "softplus")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kda_step(kda, x, do, "softplus")
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us > 0:
            rows[e.key] = (us / 1e3, e.count)
    total = sum(ms for ms, _ in rows.values())
    print(f"{name} profile: GPU time per kernel of one kda step (ms, calls)")
    for key, (ms, count) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {ms:9.3f} {count:4d}  {key[:90]}")
    print(f"  {total:9.3f}       total")
    sys.stdout.flush()
    return {k: ms for k, (ms, _) in rows.items()}


def rel_l2(got, ref):
    if got is None:
        return float("nan")
    got, ref = got.double().cpu().reshape(ref.shape), ref.double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accuracy", action="store_true", help="also the gradient error table")
    ap.add_argument("--accuracy-tokens", type=int, default=8192)
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--no-fla", action="store_true", help="do not run FLA")
    ap.add_argument("--profile", action="store_true",
                    help="also the GPU time of each kernel of one kda step")
    ap.add_argument("--cases", default="T1,T2", help="timing cases, comma-separated")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("fla_train_bench: torch is not installed; nothing to do")
        return 0
    if not torch.cuda.is_available():
        print("fla_train_bench: no CUDA GPU; nothing to do")
        return 0
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    try:
        import triton
    except ImportError:
        print("fla_train_bench: triton is not installed; nothing to do")
        return 0
    chunk_kda = None
    if not args.no_fla:
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:
            print(f"fla_train_bench: fla (fla-core) is not importable ({type(e).__name__}: {e}); "
                  "nothing to do")
            return 0
    import kda

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    results = dict(timing=[], accuracy=[])

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    print(f"{'case':4} {'shape':12} {'FLA fwd':>8} {'FLA f+b':>8} {'kda fwd':>8} {'kda f+b':>8} "
          f"{'kda/FLA':>8} {'targets: FLA fwd':>16} {'f+b':>8}")
    cases = [c for c in CASES if c[0] in args.cases.split(",")]
    for name, B, T, H, fla_fwd_t, fla_fb_t in cases:
        x, do = make_inputs(torch, dev, B, T, H)
        if args.profile:
            results.setdefault("profile", {})[name] = profile_step(torch, kda, x, do, name)
        # kda first: FLA's first call compiles its Triton kernels (minutes).
        kda_fwd = bench(functools.partial(kda_forward, kda, x))
        kda_fb = bench(functools.partial(kda_step, kda, x, do, "softplus"))
        print(f"{name:4} kda fwd {kda_fwd:.3f} ms, fwd + bwd {kda_fb:.3f} ms")
        sys.stdout.flush()
        fla_fwd = fla_fb = float("nan")
        if chunk_kda is not None:
            fla_fwd = bench(functools.partial(fla_forward, chunk_kda, x))
            fla_fb = bench(functools.partial(fla_step, chunk_kda, x, do, "softplus"))
        print(f"{name:4} {f'{B} x {T}, H={H}':12} {fla_fwd:8.3f} {fla_fb:8.3f} {kda_fwd:8.3f} "
              f"{kda_fb:8.3f} {kda_fb / fla_fb:8.3f} {fla_fwd_t:8.2f} {fla_fb_t:8.2f}")
        sys.stdout.flush()
        results["timing"].append(dict(case=name, B=B, T=T, H=H, fla_fwd_ms=fla_fwd,
                                      fla_fwd_bwd_ms=fla_fb, kda_fwd_ms=kda_fwd,
                                      kda_fwd_bwd_ms=kda_fb, ratio=kda_fb / fla_fb))
        x = do = None
        torch.cuda.empty_cache()

    if args.accuracy:
        T = args.accuracy_tokens
        print(f"\ngradient error against the fp64 reference, 1 x {T} tokens, H = 8 "
              "(relative L2)")
        print(f"{'gate':12} {'gradient':16} {'FLA':>10} {'kda':>10}")
        for gate in ("lower_bound", "softplus"):
            x, do = make_inputs(torch, dev, 1, T, 8, seed=1)
            x["initial_state"] = (0.5 * x["initial_state"]).to(torch.bfloat16).float()
            xc = {n: v.float().cpu() for n, v in x.items()}
            ref = kda_step(kda, xc, do.float().cpu(), gate, backend="reference")
            got = kda_step(kda, x, do, gate)
            fla = fla_step(chunk_kda, x, do, gate) if chunk_kda is not None else [None] * 8
            for n, r, a, f in zip(NAMES, ref, got, fla):
                row = dict(gate=gate, gradient=n, fla=rel_l2(f, r), kda=rel_l2(a, r))
                results["accuracy"].append(row)
                print(f"{gate:12} {'d' + n:16} {row['fla']:10.2e} {row['kda']:10.2e}")
            sys.stdout.flush()
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
