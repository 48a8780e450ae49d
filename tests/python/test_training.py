"""A few training steps of a one-layer model: the loss with kda's CUDA backward follows the one
with FLA's Triton chunk_kda from the same initialisation (fla-core 0.6.0; skipped without a
supported GPU or an importable fla.ops.kda.chunk_kda), and the one with kda's CPU reference
backward (fp32 copies of the same model) on any machine with a GPU.

The model is the README's KDA layer at head dim 128 (the CUDA kernels' head dim), in fp32 with
the kernel's inputs cast to bf16; the layer calls ``chunk_kda`` through FLA's own signature
(``kda.fla.chunk_kda`` is the drop-in), with the softplus gate and the beta sigmoid in the kernel.
Tolerances: the kernel's bf16 inputs put ~1e-3 relative noise into each gradient (the first
step's parameter gradients, A_log and dt_bias included, are held to 1e-2 of the CPU
reference's) and into each loss; over 8 AdamW steps at lr 1e-2, in which the loss falls by about
half, the trajectories stay within 3e-2 relative of each other.
"""

import copy

import pytest

import kda

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available() and kda.cuda_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="no supported CUDA device")


class Layer(torch.nn.Module):
    def __init__(self, chunk_kda, dim=128, heads=2, head_dim=128):
        super().__init__()
        self.chunk_kda, self.heads, self.head_dim = chunk_kda, heads, head_dim
        self.qkvg = torch.nn.Linear(dim, 4 * heads * head_dim, bias=False)
        self.b = torch.nn.Linear(dim, heads, bias=False)
        self.A_log = torch.nn.Parameter(torch.zeros(heads))
        self.dt_bias = torch.nn.Parameter(torch.zeros(heads * head_dim))
        self.proj = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        shape = (*x.shape[:2], self.heads, 4 * self.head_dim)
        dt = torch.bfloat16 if x.is_cuda else torch.float32
        q, k, v, g = (t.to(dt) for t in self.qkvg(x).view(shape).chunk(4, dim=-1))
        o, _ = self.chunk_kda(q, k, v, g, self.b(x).to(dt), A_log=self.A_log,
                              dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=True,
                              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        return self.proj(o.float().flatten(2))


def train(layer, xs, target, steps=8):
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(layer(xs), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def data(device):
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(2, 96, 128, generator=gen)
    target = torch.tanh(xs.cumsum(1) / 4)  # a causal function of the inputs: learnable
    return xs.to(device), target.to(device)


def close(a, b, tol=3e-2):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b))


def grads(layer, xs, target):
    layer.zero_grad()
    torch.nn.functional.mse_loss(layer(xs), target).backward()
    return {n: p.grad.detach().double().cpu() for n, p in layer.named_parameters()}


@cuda
def test_cuda_training_follows_cpu_reference():
    torch.manual_seed(0)
    ref = Layer(kda.fla.chunk_kda)
    gpu = copy.deepcopy(ref).cuda()
    # Every parameter's gradient of the first step (A_log and dt_bias included), then the losses.
    gc, gg = grads(ref, *data("cpu")), grads(gpu, *data("cuda"))
    for n in gc:
        err = float((gg[n] - gc[n]).norm() / gc[n].norm())
        assert err < 1e-2, (n, err)
    lc = train(ref, *data("cpu"))
    lg = train(gpu, *data("cuda"))
    assert lg[-1] < lg[0], lg
    assert close(lg, lc), (lg, lc)


@cuda
def test_cuda_training_follows_fla():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as e:  # not installed, or Triton / torch mismatch at import time
        pytest.skip(f"fla.ops.kda.chunk_kda is not importable ({type(e).__name__})")
    torch.manual_seed(0)
    ours = Layer(kda.fla.chunk_kda).cuda()
    theirs = copy.deepcopy(ours)
    theirs.chunk_kda = fla_chunk_kda
    lo = train(ours, *data("cuda"))
    lf = train(theirs, *data("cuda"))
    assert lo[-1] < lo[0], lo
    assert close(lo, lf), (lo, lf)
