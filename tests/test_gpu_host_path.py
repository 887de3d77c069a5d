"""GPU tests of the API's plans (``pytest -m gpu``; skipped without a GPU).

A signature's first call runs the launchers, its second traces them and replays the trace, later
ones replay it (``ssd.api``). The kernels are deterministic, so every call must return exactly
what ``forward_stages`` (the launchers, into NaN-poisoned buffers) returns on the same inputs,
eagerly and replayed in a CUDA graph: the CPU tests (tests/test_host_path.py) show the same
kernels, grids and arguments are launched; here cuTile's launcher takes them on the GPU
(``ssd.launch.run``). Fresh random inputs each run.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import api, launch  # noqa: E402
from ssd.tools.bench import Shape, make_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def layer_call(dims, seed, packed=False) -> dict:
    """A Mamba-2 layer's call on (b, l, h, p, n, g): D per head, dt_bias, softplus, final
    states; ``packed``: one row of three sequences (lengths 1, 70, the rest) with their states."""
    kw = make_inputs(Shape("host", *dims), seed=seed)
    kw.update(chunk_size=64, dt_softplus=True, return_final_states=True)
    if packed:
        l = dims[1]
        cu = torch.tensor([0, 1, 71, l], dtype=torch.int32, device="cuda")
        ids = torch.arange(3, dtype=torch.int32, device="cuda")
        kw.update(seq_idx=torch.repeat_interleave(ids, cu.diff()).reshape(1, l), cu_seqlens=cu,
                  return_varlen_states=True)
    return kw


def launchers(kw) -> tuple:
    """What the launchers compute (forward_stages into NaN-poisoned buffers), in the API's order."""
    names = ("y", "final_states") + (("varlen_states",) if kw.get("return_varlen_states") else ())
    stage_kw = {k: v for k, v in kw.items() if not k.startswith("return_")}
    if not kw.get("return_varlen_states"):
        stage_kw.pop("cu_seqlens", None)
    first = api.forward_stages(**stage_kw)
    poisoned = {k: torch.full_like(first[k], float("nan")) for k in first}
    r = api.forward_stages(**stage_kw, outputs=poisoned)
    return tuple(r[k] for k in names)


@pytest.mark.parametrize("dims, packed", [((1, 512, 80, 64, 128, 1), False),
                                          ((1, 300, 8, 64, 128, 2), True)],
                         ids=["prompt-512-2.7b", "packed"])
def test_every_call_of_a_signature_returns_what_the_launchers_compute(dims, packed):
    kw = layer_call(dims, RUN_SEED, packed)
    api._plans.clear()
    expected = launchers(kw)
    launch.wait_tuned()
    for n in range(3):  # run in full, traced and replayed, replayed
        got = api.mamba_chunk_scan_combined(**kw)
        for name, a, b in zip(("y", "final_states", "varlen_states"), got, expected):
            assert torch.equal(a, b), f"seed {RUN_SEED}, call {n + 1}: {name} differs"
    assert next(iter(api._plans.values())).steps is not None
    # replayed inside a CUDA graph (the plan's launches captured, outputs from the graph's pool)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        api.mamba_chunk_scan_combined(**kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = api.mamba_chunk_scan_combined(**kw)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("y", "final_states", "varlen_states"), captured, expected):
        assert torch.equal(a, b), f"seed {RUN_SEED}, graph replay: {name} differs"


def test_a_call_that_needs_a_gradient_after_replays_runs_in_full():
    """Once a signature replays, the same call on inputs that require grad runs the full forward
    under autograd (ssd.api's invariant): its y and final_states are exactly the launchers', and
    the backward gives every input a finite gradient."""
    kw = layer_call((1, 300, 8, 64, 128, 2), RUN_SEED)
    api._plans.clear()
    expected = launchers(kw)
    launch.wait_tuned()
    for _ in range(3):
        api.mamba_chunk_scan_combined(**kw)
    assert next(iter(api._plans.values())).steps is not None
    leaves = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) else v
              for k, v in kw.items()}
    y, final = api.mamba_chunk_scan_combined(**leaves)
    assert type(y.grad_fn).__name__ == "ChunkScanCombinedBackward"
    assert torch.equal(y.detach(), expected[0]) and torch.equal(final.detach(), expected[1])
    (y.float().square().sum() + final.sum()).backward()
    for name in ("x", "dt", "A", "B", "C", "D", "dt_bias"):
        grad = leaves[name].grad
        assert grad is not None and torch.isfinite(grad).all(), f"seed {RUN_SEED}: d{name}"
