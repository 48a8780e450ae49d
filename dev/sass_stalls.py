"""Warp-stall samples of one kernel per source line, from ncu's per-SASS-instruction export.

ncu's source page (`ncu --import rep --page source --csv --print-source sass`, as the srcprofile
stage of scripts/gpu_check.sh writes it) lists stall samples per SASS address but no source line.
This maps each address to a line through the cubin's line table (`nvdisasm -gi`, the binary built
with -lineinfo) and sums the samples per line: by default the outermost line, the kernel's own
statement that the inlined code came from (`--inner` takes the innermost).

  python3 dev/sass_stalls.py src_T1_sass.csv build-gpu/bench/bench_gpu_backward \\
      --kernel bwd_chunk_kernelILb1ELb1E [--cubin backward] [--top 30] [--inner]

cuobjdump and nvdisasm come from the CUDA toolkit's bin/ or from PyPI (nvidia-cuda-cuobjdump,
nvidia-cuda-nvdisasm); NVDISASM_DIR names a folder that holds both.
"""

import argparse
import collections
import csv
import gzip
import os
import re
import subprocess
import tempfile

LINE = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")


def tool(name: str) -> str:
    d = os.environ.get("NVDISASM_DIR")
    return os.path.join(d, name) if d else name


def sass_lines(binary: str, cubin: str, kernel: str, inner: bool) -> dict:
    """Offset -> (file, line) for the first kernel whose symbol contains `kernel`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [tool("cuobjdump"), "-xelf", "all", os.path.abspath(binary)],
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        names = [f for f in os.listdir(tmp) if f.endswith(".cubin") and cubin in f]
        if not names:
            raise SystemExit(f"no cubin matching {cubin!r} in {binary}")
        text = subprocess.run(
            [tool("nvdisasm"), "-gi", "-c", os.path.join(tmp, names[0])],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    out, active, chain, fresh = {}, False, [], True
    for line in text.split("\n"):
        if line.startswith(".text."):
            if active:
                break
            active = kernel in line
            continue
        if not active:
            continue
        m = LINE.search(line)
        if m:
            if fresh:
                chain, fresh = [], False
            f, n = m.group(1), int(m.group(2))
            chain.append(
                (os.path.basename(m.group(3) or f), int(m.group(4) or n), os.path.basename(f), n)
            )
            continue
        m = INSN.search(line)
        if m:
            fresh = True
            if chain:
                c = chain[0] if inner else chain[-1]
                out[int(m.group(1), 16)] = (c[2], c[3]) if inner else (c[0], c[1])
    if not out:
        raise SystemExit(f"kernel {kernel!r} not found (or no line table: build with -lineinfo)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("csv", help="ncu source page, SASS, CSV (optionally .gz)")
    ap.add_argument("binary", help="the executable the profile ran (built with -lineinfo)")
    ap.add_argument("--kernel", required=True, help="part of the kernel's mangled name")
    ap.add_argument("--cubin", default="", help="part of the embedded cubin's name (e.g. backward)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--inner", action="store_true", help="innermost line instead of outermost")
    a = ap.parse_args()
    offsets = sass_lines(a.binary, a.cubin, a.kernel, a.inner)
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    ia, isamp = hdr.index("Address"), hdr.index("Warp Stall Sampling (All Samples)")
    iexe = hdr.index("Instructions Executed")
    stalls = [
        (i, h[len("stall_") :])
        for i, h in enumerate(hdr)
        if h.startswith("stall_") and "Not Issued" not in h
    ]
    body = []
    for r in rows[2:]:
        if r and r[0] == "Kernel Name":
            break  # one kernel per export
        if len(r) == len(hdr):
            body.append(r)
    base = int(body[0][ia], 16)
    per = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    total = 0
    for r in body:
        key = offsets.get(int(r[ia], 16) - base, ("?", 0))
        s = int(r[isamp] or 0)
        total += s
        e = per[key]
        e[0] += s
        e[1] += int(r[iexe] or 0)
        for i, name in stalls:
            if r[i] and int(r[i]):
                e[2][name] += int(r[i])
    print(f"{total} samples over {len(body)} instructions")
    for (fname, n), (s, ex, reasons) in sorted(per.items(), key=lambda x: -x[1][0])[: a.top]:
        top = ", ".join(f"{k} {100 * v // max(s, 1)}%" for k, v in reasons.most_common(3))
        print(f"{100 * s / max(total, 1):5.1f}%  {fname}:{n:<5}  executed {ex:>11}  {top}")


if __name__ == "__main__":
    main()
