"""GPU tests of training (``pytest -m gpu``; skipped without a GPU).

The language model of ``ssd.layer.Mamba2LM`` trained through each GPU backend, with the PyTorch
or the cuTile conv and norm (``kernels``): its gradients against those of the torch backend and
kernels (autograd through the PyTorch SSD, conv and norm) on the same weights and tokens, and a short MQAR run of the tiny preset in the recorded run's precision (bf16 autocast)
whose held-out loss curve must follow the torch backend's.
"""
import math
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from ssd.layer import (BackendUnavailable, Mamba2Config, Mamba2LM,  # noqa: E402
                       backend_function, kernel_ops)
from ssd.tools import train as T  # noqa: E402

pytestmark = pytest.mark.gpu

BACKENDS = ("cutile", "mamba_ssm")
# fp32 model, the torch backend's SSD in fp32 without TF32: both peers' fp32 SSD may multiply in
# TF32 (10-bit mantissa, a relative error near 5e-4 a product); through two layers, the gated
# norm and the LM head that stays well within 1e-2 of each parameter's gradient norm.
GRAD_REL_TOL = 1e-2
# bf16 autocast, 30 steps: the backends round x, B, C and y alike but sum in different orders;
# the held-out loss (about 3.5 -> 2.8 nats) may drift apart by a few 1e-3.
CURVE_TOL = 0.05
LM_CONFIG = Mamba2Config(d_model=64, d_state=32, headdim=32, ngroups=2, chunk_size=32,
                         dtype="float32")


def _usable(backend, kernels="torch"):
    try:
        backend_function(backend)
        kernel_ops(kernels)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kernels", ("torch", "cutile"))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen", [64, 100])  # whole chunks, and a tail
def test_lm_gradients_match_the_torch_backend(backend, kernels, seqlen):
    _usable(backend, kernels)
    gen = torch.Generator(device="cuda").manual_seed(seqlen)
    tokens = torch.randint(0, 97, (2, seqlen), device="cuda", generator=gen)
    positions = torch.randint(0, seqlen, (2, 5), device="cuda", generator=gen)
    grads = {}
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for side, b, k in (("ref", "torch", "torch"), ("got", backend, kernels)):
            model = Mamba2LM(97, LM_CONFIG, 2, b, kernels=k, device="cuda", seed=0)
            model(tokens, positions).logsumexp(-1).sum().backward()
            grads[side] = {n: p.grad.double() for n, p in model.named_parameters()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    for name, ref in grads["ref"].items():
        got = grads["got"][name]
        assert torch.isfinite(got).all(), name
        err = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
        assert err <= GRAD_REL_TOL, (f"{backend} kernels={kernels} {name}: rel err {err:.2e} > "
                                     f"{GRAD_REL_TOL:.0e}")


def test_tiny_mqar_curves_follow_the_torch_backend():
    backends = [b for b in BACKENDS if T.usable_backends([b])[0]]
    if not backends:
        pytest.skip("neither cutile nor mamba_ssm can run here")
    config = replace(T.TRAIN_PRESETS["tiny"], precision="bf16", seq_len=64, chunk_size=32)
    record = T.run(config, ("torch", *backends), seeds=(0,), device="cuda", progress=False)
    assert record["failures"] == [], record["failures"]
    runs = {r["backend"]: r for r in record["runs"]}
    ref = runs["torch"]
    assert ref["eval_loss"][-1] < ref["eval_loss"][0] - 0.5  # it learns, as on the CPU
    for b in backends:
        r = runs[b]
        assert all(math.isfinite(v) for v in r["train_loss"]), b
        gap = max(abs(x - y) for x, y in zip(r["eval_loss"], ref["eval_loss"]))
        assert gap <= CURVE_TOL, f"{b}: held-out loss {gap:.3e} from the torch backend's"
        assert r["peak_mem_mib"] > 0 and r["steady"]["median_ms"] > 0
