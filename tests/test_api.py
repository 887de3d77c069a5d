"""The public forward's argument checks, on the CPU (every error names its argument).

``ssd.api.validate`` runs every check before the one that needs a CUDA device, so each class
of bad input is exercised here; a valid call on CPU tensors ends at the device check.
"""
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd.api import chunk_seq_last, validate  # noqa: E402

B_, L, H, P, N, G, Q = 2, 40, 4, 8, 16, 2, 16


def good(**over):
    args = dict(x=torch.randn(B_, L, H, P, dtype=torch.bfloat16),
                dt=torch.rand(B_, L, H, dtype=torch.bfloat16), A=-torch.rand(H),
                B=torch.randn(B_, L, G, N, dtype=torch.bfloat16),
                C=torch.randn(B_, L, G, N, dtype=torch.bfloat16), chunk_size=Q)
    args.update(over)
    return args


def test_valid_call_reaches_the_device_check():
    with pytest.raises(ValueError, match=r"^x: must be a CUDA tensor"):
        validate(**good())


BAD = [
    ("x", dict(x=[1.0]), TypeError),
    ("x", dict(x=torch.randn(B_, L, H, P, dtype=torch.float64)), TypeError),
    ("dt", dict(dt=None), TypeError),
    ("dt", dict(dt=torch.rand(B_, L + 1, H)), ValueError),
    ("A", dict(A=-torch.rand(H + 1)), ValueError),
    ("B", dict(B=torch.randn(B_, L, G, 512), C=torch.randn(B_, L, G, 512)), ValueError),  # dstate
    ("C", dict(C=torch.randn(B_, L, G + 1, N)), ValueError),
    ("B", dict(B=torch.randn(B_, L, 3, N), C=torch.randn(B_, L, 3, N)), ValueError),  # h % g
    ("B", dict(B=torch.randn(B_ + 1, L, G, N)), ValueError),
    ("D", dict(D=torch.randn(H, P + 1)), ValueError),
    ("z", dict(z=torch.randn(B_, L, H, P - 1)), ValueError),
    ("dt_bias", dict(dt_bias=torch.randn(H + 2)), ValueError),
    ("initial_states", dict(initial_states=torch.randn(B_, H, P, N + 1)), ValueError),
    ("seq_idx", dict(seq_idx=torch.zeros(B_, L)), TypeError),  # float seq_idx
    ("seq_idx", dict(seq_idx=torch.zeros(B_, L + 1, dtype=torch.int32)), ValueError),
    ("chunk_size", dict(chunk_size=48), ValueError),
    ("chunk_size", dict(chunk_size=512), ValueError),
    ("chunk_size", dict(chunk_size=True), ValueError),
    ("dt_limit", dict(dt_limit=(0.1, 0.01)), ValueError),
    ("dt_limit", dict(dt_limit=5), TypeError),
]


@pytest.mark.parametrize("name,over,exc", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(name, over, exc):
    args = good(**over)
    with pytest.raises(exc, match=rf"^{name}\b"):
        validate(**args)


def test_inputs_that_require_grad_are_accepted():
    """Differentiable (ssd.autograd): with or without grad mode, such inputs pass every check."""
    x = torch.randn(B_, L, H, P, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
        validate(**good(x=x))
    with torch.no_grad(), pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
        validate(**good(x=x))


def _one(t, value, index=(0,)):
    """A copy of ``t`` with one element set to ``value``."""
    t = t.clone()
    t[index] = value
    return t


def _seq(rows):
    return torch.tensor([rows] * B_, dtype=torch.int32)


# Every rule of check_values, on every argument it covers; each case breaks that rule alone
# (a NaN A is not > 0, a negative seq_idx here never decreases, a decreasing one is >= 0), so
# that each case fails if its rule is removed.
VALUE_CASES = {
    "A-positive": ("A", dict(A=_one(-torch.rand(H), 0.5, 2)), "must be finite and <= 0"),
    "A-nan": ("A", dict(A=_one(-torch.rand(H), math.nan, 1)), "must be finite and <= 0"),
    "x-nan": ("x", dict(x=_one(good()["x"], math.nan, (1, 7, 2, 3))), "contains NaN or inf"),
    "dt-nan": ("dt", dict(dt=_one(good()["dt"], math.nan, (0, 5, 1))), "contains NaN or inf"),
    "dt-inf": ("dt", dict(dt=_one(good()["dt"], math.inf, (1, 39, 3))), "contains NaN or inf"),
    "B-nan": ("B", dict(B=_one(good()["B"], math.nan, (1, 3, 1, 4))), "contains NaN or inf"),
    "C-nan": ("C", dict(C=_one(good()["C"], math.nan, (0, 20, 0, 15))), "contains NaN or inf"),
    "C-inf": ("C", dict(C=_one(good()["C"], -math.inf, (1, 0, 1, 0))), "contains NaN or inf"),
    "z-nan": ("z", dict(z=_one(torch.randn(B_, L, H, P, dtype=torch.bfloat16), math.nan,
                               (0, 11, 2, 5))), "contains NaN or inf"),
    "seq_idx-negative": ("seq_idx", dict(seq_idx=_seq([-1] * 10 + [0] * 30)),
                         "must be >= 0 and non-decreasing"),
    "seq_idx-decreasing": ("seq_idx", dict(seq_idx=_seq([0] * 10 + [2] * 10 + [1] * 20)),
                           "must be >= 0 and non-decreasing"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_value_checks_on_request(case):
    name, over, message = VALUE_CASES[case]
    with pytest.raises(ValueError, match=rf"^{name}: {message}"):
        validate(**good(**over), check_values=True)
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):  # off by default
        validate(**good(**over))


def test_value_checks_pass_valid_inputs_with_every_feature():
    """check_values on a valid call with z, seq_idx (several sequences, the first at 0), D,
    dt_bias and initial states: it reaches the device check."""
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
        validate(**good(z=torch.randn(B_, L, H, P, dtype=torch.bfloat16),
                        seq_idx=_seq([0] * 10 + [1] * 10 + [3] * 20), D=torch.randn(H),
                        dt_bias=torch.randn(H), initial_states=torch.randn(B_, H, P, N)),
                 check_values=True)


# Each optional and required tensor on another device than x ("meta": no memory, no GPU needed).
DEVICE_CASES = {
    "dt": dict(dt=torch.rand(B_, L, H, dtype=torch.bfloat16, device="meta")),
    "A": dict(A=torch.empty(H, device="meta")),
    "B": dict(B=torch.empty(B_, L, G, N, dtype=torch.bfloat16, device="meta")),
    "C": dict(C=torch.empty(B_, L, G, N, dtype=torch.bfloat16, device="meta")),
    "D": dict(D=torch.empty(H, device="meta")),
    "z": dict(z=torch.empty(B_, L, H, P, dtype=torch.bfloat16, device="meta")),
    "dt_bias": dict(dt_bias=torch.empty(H, device="meta")),
    "initial_states": dict(initial_states=torch.empty(B_, H, P, N, device="meta")),
    "seq_idx": dict(seq_idx=torch.zeros(B_, L, dtype=torch.int32, device="meta")),
}


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_inputs_on_another_device_than_x_are_named(name):
    with pytest.raises(ValueError, match=rf"^{name}: on meta, but x is on cpu; all inputs must "
                                         "share one CUDA device"):
        validate(**good(**DEVICE_CASES[name]))


def test_x_on_another_device_than_the_rest():
    x = torch.empty(B_, L, H, P, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="^dt: on cpu, but x is on meta"):
        validate(**good(x=x))
    everything = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in good().items()}
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor \\(got device meta\\)"):
        validate(**everything)


def test_chunk_seq_last_reads_each_chunks_last_valid_position():
    seq = torch.tensor([[0] * 5 + [1] * 30 + [2] * 5])  # l = 40, q = 16: chunks end at 15, 31, 39
    assert chunk_seq_last(seq, 16).tolist() == [[1, 1, 2]]
    assert chunk_seq_last(seq, 64).tolist() == [[2]]


def test_forward_launches_only_its_three_kernels(torch_ops):
    """A Mamba-2 layer's call (D per head, dt_bias, softplus) runs the three cuTile kernels and no
    torch kernel: no fill for absent inputs, no copy of D (on a GPU each is a launch of its own,
    in eager mode and in a CUDA graph)."""
    from ssd import launch
    from ssd.api import forward_stages
    from ssd.config import default_config

    b, l, h, p, n = 1, 300, 8, 64, 128
    x = torch.randn(b, l, h, p, dtype=torch.bfloat16)
    B, C = (torch.randn(b, l, 1, n, dtype=torch.bfloat16) for _ in range(2))
    dt, A, D, bias = torch.randn(b, l, h, dtype=torch.bfloat16), -torch.rand(h), *torch.randn(2, h)
    with launch.capture() as launches, torch_ops() as ops:
        forward_stages(x, dt, A, B, C, 128, D=D, dt_bias=bias, dt_softplus=True,
                       config=default_config((9, 0)))
    assert len(launches) == 3
    allocating = {"empty.memory_format", "empty_like.default"}
    assert set(ops.names) <= allocating | {"unsqueeze.default", "view.default"}, ops.names
