#!/usr/bin/env bash
# sass_diff.sh — compares the SASS of every CUDA kernel of two builds, kernel by kernel.
#
#   dev/sass_diff.sh OLD_BUILD NEW_BUILD [old_name=new_name ...]
#
# Dumps the SASS (cuobjdump -sass) of every object under BUILD/CMakeFiles/kda.dir/src/cuda, splits
# it per kernel and matches the kernels of the two builds by a key: the kernel's own name (no
# namespace, no parameter list; renamed through the old_name=new_name pairs, which default to the
# renames of the src/cuda restructuring below) and its template arguments. Instruction text is
# compared with the addresses, the encodings and the symbol names removed, so a kernel that only
# moved or was renamed reads "identical". Prints one line per kernel (identical / different /
# only in old / only in new) and a summary; exits 1 if any kernel differs or is unmatched.
# KEEP=DIR keeps the normalized listings there (for `diff DIR/old/KEY DIR/new/KEY`).
# Needs cuobjdump (CUDA toolkit or the nvidia-cuda-cuobjdump wheel) on PATH and c++filt.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0"
  exit 2
fi
OLD=$1
NEW=$2
shift 2
RENAMES=("$@")
if [ ${#RENAMES[@]} -eq 0 ]; then
  RENAMES=(decode_sm90_kernel=decode_tile_kernel)
fi
command -v cuobjdump >/dev/null || { echo "sass_diff.sh: cuobjdump not on PATH" >&2; exit 2; }
WORK=${KEEP:-$(mktemp -d)}
mkdir -p "$WORK"

dump() {  # build dir -> concatenated SASS of its CUDA objects
  find "$1/CMakeFiles/kda.dir/src/cuda" -name '*.cu.o' | sort | while read -r o; do
    cuobjdump -sass "$o"
  done
}
dump "$OLD" >"$WORK/old.sass"
dump "$NEW" >"$WORK/new.sass"

python3 - "$WORK" "${RENAMES[@]}" <<'EOF'
import os, re, subprocess, sys
work, renames = sys.argv[1], dict(r.split("=", 1) for r in sys.argv[2:])

def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()

def split(path):
    funcs, cur, body = {}, None, []
    for line in open(path):
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if cur: funcs[cur] = body
            cur, body = m.group(1), []
        elif cur and re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            ins = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
            ins = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", ins)
            ins = re.sub(r"\b_Z\w+", "SYM", ins)  # names of kernels / globals in relocations
            funcs[cur] = body
            body.append(" ".join(ins.split()))
    if cur: funcs[cur] = body
    keyed = {}
    for mangled, pretty in zip(funcs, demangle(list(funcs))):
        sig = re.sub(r"\(anonymous namespace\)::", "", pretty)
        depth, cut = 0, len(sig)
        for i, ch in enumerate(sig):  # drop the parameter list (the first '(' at depth 0)
            if ch == "<": depth += 1
            elif ch == ">": depth -= 1
            elif ch == "(" and depth == 0: cut = i; break
        sig = sig[:cut]
        lt = sig.find("<")
        base, args = (sig[:lt], sig[lt:]) if lt >= 0 else (sig, "")
        base = base.split("::")[-1]
        base = renames.get(base, base)
        args = re.sub(r"\b\w+::", "", args)
        keyed[base + args] = funcs[mangled]
    return keyed

old, new = split(os.path.join(work, "old.sass")), split(os.path.join(work, "new.sass"))
for side, d in (("old", old), ("new", new)):
    os.makedirs(os.path.join(work, side), exist_ok=True)
    for k, body in d.items():
        fn = re.sub(r"[^A-Za-z0-9_.,-]", "_", k)
        open(os.path.join(work, side, fn), "w").write("\n".join(body) + "\n")
counts = {"identical": 0, "different": 0, "only in old": 0, "only in new": 0}
for k in sorted(set(old) | set(new)):
    if k not in new: verdict = "only in old"
    elif k not in old: verdict = "only in new"
    elif old[k] == new[k]: verdict = "identical"
    else:
        n = sum(a != b for a, b in zip(old[k], new[k])) + abs(len(old[k]) - len(new[k]))
        verdict = "different"
        print(f"{verdict:12s} {k}  ({len(old[k])} -> {len(new[k])} instructions, {n} lines differ)")
        counts[verdict] += 1
        continue
    counts[verdict] += 1
    print(f"{verdict:12s} {k}" + (f"  ({len(old[k])} instructions)" if verdict == "identical" else ""))
print("summary: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
sys.exit(0 if counts["identical"] == len(set(old) | set(new)) else 1)
EOF
