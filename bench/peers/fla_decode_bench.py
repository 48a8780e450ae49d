#!/usr/bin/env python3
"""FLA's decode (fla-core 0.6.0, fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd) on the shapes
of bench/bench_gpu_decode, for a side-by-side table.

Setup (targets.md, "Decode"): H = HV = 32, K = V = 128, bf16 q/k/v/g/beta/out, gate in kernel with
lower bound -5 (A_log, dt_bias ~ U(0, 1)), beta logits (sigmoid in kernel), l2norm in kernel, fp32
V-first state pool updated in place through state indices. Timing: triton.testing.do_bench
(median; it clears L2 before every call), rotating among disjoint sets of pool slots and inputs as
the C++ benchmark does. Effective bandwidth uses the same byte model:
2 x B x HV x K x V x state_bytes + bytes of q, k, v, g, beta, out.

Comparability notes: for T > 1 FLA needs [B, T] indices in continuous-batching mode and writes the
state after every token (T state writes, counted once here); bench_gpu_decode's T4 case uses [B]
indices and writes once.

Exits 0 with a message when torch, triton, fla or a CUDA GPU is missing.
usage: python bench/peers/fla_decode_bench.py [--csv PATH] [--filter SUBSTRING]
"""
import argparse
import math
import sys

H = HV = 32
K = V = 128


def bench_case(torch, testing, fwd, dev, gen, name, B, T, sdt, graph_calls):
    """Times one case; returns (name, B, T, state, graph_calls, us, TB/s, rotation sets)."""
    es = torch.tensor([], dtype=sdt).element_size()
    touched = B * HV * K * V * es
    sets = int(min(max(math.ceil(240e6 / touched), 1), 64))  # >= 4x L2 of state per rotation
    P = sets * B + 8
    pool = (0.1 * torch.randn(P, HV, V, K, device=dev, generator=gen)).to(sdt)
    A_log = torch.rand(HV, device=dev, generator=gen)
    dt_bias = torch.rand(HV, K, device=dev, generator=gen)
    perm = torch.randperm(sets * B, device=dev, generator=gen).to(torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    inputs = []
    for s in range(sets):
        idx = perm[s * B:(s + 1) * B].contiguous()
        if T > 1:
            idx = idx[:, None].expand(B, T).contiguous()  # continuous batching needs [B, T]
        out = torch.empty(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        inputs.append(dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V),
                           g=rnd(B, T, HV, K), beta=rnd(B, T, HV), out=out, idx=idx))

    def call(i):
        x = inputs[i % sets]
        fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=A_log, dt_bias=dt_bias,
            initial_state=pool, scale=None, inplace_final_state=True, state_v_first=True,
            ssm_state_indices=x["idx"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=x["out"])

    for i in range(3):  # compile + warm up
        call(i)
    torch.cuda.synchronize()
    if graph_calls == 0:
        counter = [0]

        def fn():
            call(counter[0])
            counter[0] += 1

        ms = testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(graph_calls):  # warm up on the side stream before capture
                call(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(graph_calls):
                call(i)
        ms = testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
        ms /= graph_calls
    us = ms * 1e3
    nbytes = 2.0 * B * HV * K * V * es + B * T * (2 * H * K + HV * V + HV * K + HV + HV * V) * 2.0
    tbps = nbytes / (us * 1e-6) / 1e12
    return (name, B, T, "fp32" if sdt == torch.float32 else "bf16", graph_calls, us, tbps, sets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default="", help="also write the table as CSV here")
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("fla_decode_bench: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("fla_decode_bench: no CUDA GPU visible to torch; nothing to measure")
        return 0
    try:
        import triton.testing
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:  # ImportError, or fla failing to import without its deps
        print(f"fla_decode_bench: fla (fla-core 0.6.0) / triton not importable ({exc!r}); "
              "nothing to measure")
        return 0

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    # (name, B, T, state dtype, calls captured in one CUDA graph; 0 = plain calls)
    cases = [
        ("T1_B1", 1, 1, torch.float32, 0),
        ("T1_B32", 32, 1, torch.float32, 0),
        ("T1_B256", 256, 1, torch.float32, 0),
        ("T1_B1024", 1024, 1, torch.float32, 0),
        ("T1_B256_bf16state", 256, 1, torch.bfloat16, 0),
        ("T4_B256", 256, 4, torch.float32, 0),
        ("T1_B1_graph1", 1, 1, torch.float32, 1),
        ("T1_B1_graph20", 1, 1, torch.float32, 20),
    ]
    gen = torch.Generator(device=dev)
    gen.manual_seed(2026)
    rows = []
    for case in cases:
        if args.filter and args.filter not in case[0]:
            continue
        row = bench_case(torch, triton.testing, fused_recurrent_kda_fwd, dev, gen, *case)
        rows.append(row)
        name, _, _, _, _, us, tbps, sets = row
        print(f"  ran {name:22s} {us:10.2f} us  {tbps:6.3f} TB/s  [{sets} rotation sets]")

    print("\nFLA fused_recurrent_kda_fwd")
    print(f"{'case':22s} {'B':>6s} {'T':>3s} {'state':>6s} {'graph':>6s} "
          f"{'median_us':>11s} {'TB/s':>8s}")
    for name, B, T, st, gc, us, tbps, _ in rows:
        print(f"{name:22s} {B:6d} {T:3d} {st:>6s} {gc:6d} {us:11.2f} {tbps:8.3f}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,B,T,H,HV,K,V,state_dtype,graph_calls,median_us,"
                    "effective_TBps,impl\n")
            for name, B, T, st, gc, us, tbps, _ in rows:
                f.write(f"{name},{B},{T},{H},{HV},{K},{V},{st},{gc},{us:.3f},{tbps:.4f},fla\n")
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
