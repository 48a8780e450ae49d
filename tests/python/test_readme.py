"""The README's examples run as written.

Every ```python block of README.md is executed in order in one namespace (so a later block may use
what an earlier one built); the ```cpp block is compiled against include/kda/kda.h
(-fsyntax-only) inside a function whose parameters are the names it leaves undefined.
"""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def blocks(language: str):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```" + language + r"\n(.*?)^```", text, re.M | re.S)


def test_readme_has_examples():
    assert len(blocks("python")) >= 1
    assert len(blocks("cpp")) == 1


def test_python_examples_run():
    pytest.importorskip("torch")
    namespace = {"__name__": "readme"}
    for i, code in enumerate(blocks("python")):
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)
    # The example's own asserts checked the varlen and pool results; check what the rest returned.
    torch = namespace["torch"]
    B, T, HV, V, K = (namespace[n] for n in ("B", "T", "HV", "V", "K"))
    assert namespace["out"].shape == (B, T, HV, V)
    assert namespace["ht"].shape == (B, HV, V, K)
    assert namespace["y"].shape == (B, 1, HV, V)
    assert namespace["y2"].shape == (B, 1, HV, V)
    for name in ("out", "ht", "out_p", "ht_p", "pool", "y", "o2", "h2", "o3", "h3", "y2"):
        assert torch.isfinite(namespace[name].float()).all(), name
    slots = namespace["slots"].tolist()
    untouched = [p for p in range(namespace["pool"].shape[0]) if p not in slots]
    assert not namespace["pool"][untouched].any(), "pool slots outside state_indices written"
    # fwd with a zero initial state equals chunk_kda without one (both the lower-bound gate).
    assert torch.allclose(namespace["o3"].float(), namespace["o2"].float(), atol=1e-2)


# Declarations for the names the C++ block uses without defining them.
CPP_PARAMETERS = ("void* q_ptr, void* cu_ptr, int64_t T, int64_t H, int64_t N, "
                  "kda::TensorView pool, kda::TensorView slots, void* stream")


def test_cpp_example_compiles(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler")
    code = blocks("cpp")[0]
    body = "\n".join(line for line in code.splitlines() if not line.startswith("#include"))
    src = tmp_path / "readme_example.cpp"
    src.write_text("#include <kda/kda.h>\n\n"
                   f"void readme_example({CPP_PARAMETERS}) {{\n{body}\n}}\n")
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror",
                          "-Wno-unused-variable", "-I", os.path.join(ROOT, "include"), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
