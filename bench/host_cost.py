"""Host cost of one call from Python: wall time of back-to-back calls, no synchronization.

Prints microseconds per call for kda.prefill, kda.fwd and kda.decode (on CUDA also on a side
stream), for the parts of one call (an output allocation, the stream lookup, the capture check
and the kept workspace, a no-op extension call, the autograd test, the extension's argument
reading and validation alone, the extension call with everything preallocated), and for FLA's
chunk_kda / fused_recurrent_kda_fwd and FlashKDA's fwd when they are importable; as JSON, then as
a table.

Protocol (targets.md, "Host cost of one call"): warm up, then time `--calls` calls in a row without
synchronizing and divide by the number of calls; repeat `--repeats` times and report the median.
On inputs small enough that the GPU is not the limit the GPU queue never fills, so the figure is
the host time per call. With torch CUDA tensors the inputs default to S1 (1 x 1024 tokens, H = 4,
K = V = 128) for prefill and B = 1, H = 32, K = V = 128 for decode; without CUDA, torch CPU tensors
of tiny shapes (the kernels' own time is then part of the figure).

    python bench/host_cost.py                 # defaults for the device found
    python bench/host_cost.py --T 16 --H 1    # other prefill shapes
    python bench/host_cost.py --only kda.prefill,kda.decode --repeats 15   # some calls only
"""

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List

import torch

import kda


def time_calls(fn: Callable[[], Any], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median over `repeats` of the wall time of `calls` back-to-back calls, in us per call."""
    for _ in range(max(10, calls // 10)):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(runs)


def prefill_inputs(dev: str, T: int, H: int, K: int, V: int, dtype: torch.dtype) -> Dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dt)

    return dict(q=randn(1, T, H, K), k=randn(1, T, H, K), v=randn(1, T, H, V),
                g=randn(1, T, H, K), beta=randn(1, T, H),
                A_log=torch.rand(H, generator=gen).to(dev),
                dt_bias=torch.rand(H, K, generator=gen).to(dev),
                h0=(0.1 * torch.randn(1, H, V, K, generator=gen)).to(dev))


def decode_inputs(dev: str, B: int, H: int, K: int, dtype: torch.dtype) -> Dict[str, Any]:
    gen = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, dt)

    slots = torch.randperm(2 * B, generator=gen)[:B].to(dev, torch.int32)
    return dict(q=randn(B, 1, H, K), k=randn(B, 1, H, K), v=randn(B, 1, H, K),
                g=randn(B, 1, H, K), beta=randn(B, 1, H),
                A_log=torch.rand(H, generator=gen).to(dev),
                dt_bias=torch.rand(H, K, generator=gen).to(dev),
                pool=(0.1 * torch.randn(2 * B, H, K, K, generator=gen)).to(dev), slots=slots)


def kda_calls(p: Dict[str, Any], d: Dict[str, Any], threads: int) -> Dict[str, Callable[[], Any]]:
    # CPU tensors: `threads` CPU backend threads; CUDA tensors: the default (0, unused there).
    # Passed as a plain keyword: a **dict in the call would add its own building to each figure.
    nt = 0 if p["q"].is_cuda else threads
    out = torch.empty_like(p["v"])
    ht = torch.empty_like(p["h0"])

    def prefill() -> Any:
        return kda.prefill(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                           dt_bias=p["dt_bias"], gate="lower_bound", beta_logits=True,
                           initial_state=p["h0"], output_final_state=True, num_threads=nt)

    def prefill_given() -> Any:  # the same call with both outputs preallocated
        return kda.prefill(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                           dt_bias=p["dt_bias"], gate="lower_bound", beta_logits=True,
                           initial_state=p["h0"], final_state=ht, out=out, num_threads=nt)

    def prefill_out_given() -> Any:  # only the final state allocated
        return kda.prefill(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                           dt_bias=p["dt_bias"], gate="lower_bound", beta_logits=True,
                           initial_state=p["h0"], output_final_state=True, out=out,
                           num_threads=nt)

    def fwd() -> Any:
        return kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], None, out, p["A_log"],
                       p["dt_bias"], -5.0, initial_state=p["h0"], final_state=ht)

    def decode() -> Any:
        return kda.decode(d["q"], d["k"], d["v"], d["g"], d["beta"], d["pool"],
                          A_log=d["A_log"], dt_bias=d["dt_bias"], state_indices=d["slots"],
                          gate="softplus", beta_logits=True, num_threads=nt)

    return {"kda.prefill": prefill, "kda.prefill (out given)": prefill_out_given,
            "kda.prefill (outputs given)": prefill_given, "kda.fwd": fwd, "kda.decode": decode}


def breakdown_calls(p: Dict[str, Any], d: Dict[str, Any],
                    threads: int) -> Dict[str, Callable[[], Any]]:
    """The parts of one call: an output allocation, the stream lookup, the capture check and the
    kept workspace's round trip (CUDA), a no-op extension call, the autograd test, the
    extension's argument reading and validation alone (read_*), and the extension call with every
    output and the workspace preallocated (_C.prefill / _C.decode)."""
    from kda import _C, _torch_ops

    q, v = p["q"], p["v"]
    cuda = q.is_cuda
    stream = _torch_ops.stream(q) if cuda else 0
    out, ht, dout = torch.empty_like(v), torch.empty_like(p["h0"]), torch.empty_like(d["v"])
    pre = dict(q=q, k=p["k"], v=v, g=p["g"], beta=p["beta"], A_log=p["A_log"],
               dt_bias=p["dt_bias"], cu_seqlens=None, out=out, initial_state=p["h0"],
               final_state=ht, state_pool=None, state_indices=None, checkpoints=None,
               checkpoint_offsets=None, workspace=None, checkpoint_every=0, check_indices=False,
               state_layout="v_first", use_qk_l2norm=True, scale=None, gate="lower_bound",
               lower_bound=-5.0, beta_logits=True, allow_neg_eigval=False, backend="auto",
               num_threads=threads, stream=stream,
               allocate=_torch_ops.allocate_workspace if cuda else None, names=None)
    pre["workspace"] = _C.prefill(*[pre[n] for n in _C.prefill_arguments])
    pre["allocate"] = None
    pre_args = tuple(pre[n] for n in _C.prefill_arguments)
    dec = dict(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d["A_log"],
               dt_bias=d["dt_bias"], cu_seqlens=None, out=dout, state=d["pool"],
               state_indices=d["slots"], num_accepted_tokens=None, final_state=None,
               intermediate_states=None, use_initial_state=True, store_final_state=True,
               check_indices=False, state_layout="v_first", use_qk_l2norm=True, scale=None,
               gate="softplus", lower_bound=-5.0, beta_logits=True, allow_neg_eigval=False,
               backend="auto", num_threads=threads, stream=stream, names=None)
    dec_args = tuple(dec[n] for n in _C.decode_arguments)
    shape = tuple(v.shape)
    calls: Dict[str, Callable[[], Any]] = {
        "torch.empty(out shape)": lambda: torch.empty(shape, dtype=q.dtype, device=q.device),
        "torch.empty_like(v) (as kda)": lambda: torch.empty_like(
            v, dtype=q.dtype, memory_format=torch.contiguous_format),
        "no-op extension call": _C.cuda_compiled,
        "_C.requires_grad (8 inputs, as kda)": lambda: _C.requires_grad(
            q, p["k"], v, p["g"], p["beta"], p["A_log"], p["dt_bias"], p["h0"]),
        "_C.read_prefill (read, validate)": lambda: _C.read_prefill(*pre_args),
        "_C.prefill (all preallocated)": lambda: _C.prefill(*pre_args),
        "_C.read_decode (read, validate)": lambda: _C.read_decode(*dec_args),
        "_C.decode (out preallocated)": lambda: _C.decode(*dec_args),
    }
    if cuda:
        calls["stream lookup (raw)"] = lambda: _torch_ops.stream(q)
        calls["capture check (torch)"] = _torch_ops._capturing

        def workspace_round() -> None:  # what kda.prefill does around the call on CUDA
            _, ws, _, key = _torch_ops.prefill_device(q, None)
            if key is not None:
                _torch_ops.keep_workspace(key, ws, None)
        calls["stream, capture check, kept workspace"] = workspace_round
        calls["torch.cuda.current_stream()"] = torch.cuda.current_stream
    return calls


def side_stream_calls(
    calls: Dict[str, Callable[[], Any]], side: "torch.cuda.Stream"
) -> Dict[str, Callable[[], Any]]:
    """kda's calls again, to be timed with a side stream (torch.cuda.Stream) current instead of
    the legacy default one: main() enters `torch.cuda.stream(side)` once around their timing, as
    a model's layers run inside one such block; the context manager's own cost per entry is a
    row of its own."""

    def enter_exit() -> None:
        with torch.cuda.stream(side):
            pass

    return {"torch.cuda.stream(side) enter + exit": enter_exit,
            **{f"{name} (side stream)": fn for name, fn in calls.items()}}


def peer_calls(p: Dict[str, Any], d: Dict[str, Any]) -> Dict[str, Callable[[], Any]]:
    """FLA's and FlashKDA's entries on the same inputs, where importable (CUDA only)."""
    calls: Dict[str, Callable[[], Any]] = {}
    if not p["q"].is_cuda:
        return calls
    try:
        from fla.ops.kda import chunk_kda

        def fla_chunk() -> Any:
            return chunk_kda(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                             dt_bias=p["dt_bias"].flatten(), initial_state=p["h0"],
                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             lower_bound=-5.0, state_v_first=True)
        calls["fla.chunk_kda"] = fla_chunk
    except ImportError:
        pass
    try:
        from fla.ops.kda import fused_recurrent_kda_fwd  # type: ignore[attr-defined]
    except ImportError:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        except ImportError:
            fused_recurrent_kda_fwd = None
    if fused_recurrent_kda_fwd is not None:
        def fla_decode() -> Any:
            return fused_recurrent_kda_fwd(
                q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d["A_log"],
                dt_bias=d["dt_bias"].flatten(), initial_state=d["pool"], output_final_state=True,
                inplace_final_state=True, state_v_first=True, ssm_state_indices=d["slots"],
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True)
        calls["fla.fused_recurrent_kda_fwd"] = fla_decode
    try:
        import flash_kda

        out = torch.empty_like(p["v"])
        ht = torch.empty_like(p["h0"])

        def flash_fwd() -> Any:
            return flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], None, out, p["A_log"],
                                 p["dt_bias"], -5.0, initial_state=p["h0"], final_state=ht)
        calls["flash_kda.fwd"] = flash_fwd
    except ImportError:
        pass
    return calls


def main() -> None:
    cuda = torch.cuda.is_available() and kda.cuda_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1024 if cuda else 16, help="prefill tokens")
    ap.add_argument("--H", type=int, default=4 if cuda else 1, help="prefill heads")
    ap.add_argument("--K", type=int, default=128 if cuda else 32, help="head dim (K = V)")
    ap.add_argument("--decode-B", type=int, default=1)
    ap.add_argument("--decode-H", type=int, default=32 if cuda else 1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads (CPU tensors)")
    ap.add_argument("--json", default=None, help="also write the JSON to this file")
    ap.add_argument("--only", default=None,
                    help="comma-separated call names: time only these (e.g. kda.prefill,kda.fwd)")
    a = ap.parse_args()

    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    p = prefill_inputs(dev, a.T, a.H, a.K, a.K, dtype)
    d = decode_inputs(dev, a.decode_B, a.decode_H, a.K, dtype)
    kda_fns = kda_calls(p, d, a.threads)
    calls = {**breakdown_calls(p, d, a.threads), **kda_fns}
    side = torch.cuda.Stream() if cuda else None
    if cuda:
        calls.update(side_stream_calls(kda_fns, side))
    calls.update(peer_calls(p, d))
    if a.only:
        wanted = a.only.split(",")
        missing = [name for name in wanted if name not in calls]
        if missing:
            ap.error(f"--only: no call named {', '.join(missing)} here (calls: {', '.join(calls)})")
        calls = {name: calls[name] for name in wanted}

    rows: List[Dict[str, Any]] = []
    for name, fn in calls.items():
        ctx = torch.cuda.stream(side) if name.endswith("(side stream)") else nullcontext()
        try:
            with ctx:
                us = time_calls(fn, a.calls, a.repeats, sync)
        except Exception as e:  # a peer that cannot run these inputs: reported, not fatal
            rows.append({"call": name, "us_per_call": None, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append({"call": name, "us_per_call": round(us, 2)})

    shapes = {"prefill": f"1 x {a.T}, H = {a.H}, K = V = {a.K}",
              "decode": f"B = {a.decode_B}, H = {a.decode_H}, K = V = {a.K}"}
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
           "calls": a.calls, "repeats": a.repeats, "shapes": shapes, "results": rows}
    print(json.dumps(doc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"host cost per call ({dev}, {str(dtype).split('.')[-1]}, {a.calls} calls, median of "
          f"{a.repeats}); prefill {shapes['prefill']}; decode {shapes['decode']}")
    print(f"{'call':<44} {'us/call':>10}")
    for r in rows:
        fig = f"{r['us_per_call']:.2f}" if r["us_per_call"] is not None else "error"
        print(f"{r['call']:<44} {fig:>10}" + (f"  ({r['error'][:60]})" if "error" in r else ""))


if __name__ == "__main__":
    main()
