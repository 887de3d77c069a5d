"""The backward's stage table and the cuTile stage launchers' host side, on the CPU.

* ``ssd.backward.StageBackwards``: the composition calls each stage from the table it is given,
  the autograd Function and the API hand theirs down, and the CPU's default is PyTorch (the
  kernels' values are the GPU tests', tests/test_gpu_stage_backward.py).
* ``<stage>_backward_cutile``: the torch function's arguments (plus the tiles), a clear
  ValueError naming a bad argument, and under ``ssd.launch.capture()`` the torch function's keys,
  shapes and dtypes for what it would compute.
"""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd import autograd as AG  # noqa: E402
from ssd import backward as TB  # noqa: E402
from ssd import launch  # noqa: E402
from ssd.problem import EDGE_SHAPES  # noqa: E402

#: The four stages every table holds (``fold`` is optional).
FOUR = ("chunk_scan", "state_passing", "chunk_state", "chunk_cumsum")


def test_cpu_default_is_pytorch_and_the_gpu_table_takes_every_kernel():
    assert TB.default_backwards(torch.empty(1)) is TB.TORCH_BACKWARDS
    assert TB.default_backwards(torch.empty(1, dtype=torch.float64)) is TB.TORCH_BACKWARDS
    table = TB.cutile_backwards()
    assert TB.StageBackwards._fields == (*FOUR, "fold")
    for stage in FOUR:
        assert getattr(table, stage).__name__ == f"{stage}_backward_cutile"
    assert table.fold is TB.chunk_scan_backward_cutile  # chunk_state's folded in by default
    assert TB.cutile_backwards(fold=False).fold is None and TB.TORCH_BACKWARDS.fold is None


#: The keyword-only parameters a launcher adds to its torch function's: the tiles, and for
#: chunk_scan the walk and dx's dtype that fold chunk_state's backward in (StageBackwards.fold).
EXTRA = dict(chunk_scan=("config", "walk", "dx_dtype"))


@pytest.mark.parametrize("stage", FOUR)
def test_kernel_launchers_take_the_torch_functions_arguments(stage):
    """Same parameters, names, kinds and defaults, plus keyword-only ones (:data:`EXTRA`)."""
    ours = inspect.signature(getattr(TB.cutile_backwards(), stage)).parameters
    theirs = inspect.signature(getattr(TB.TORCH_BACKWARDS, stage)).parameters
    extra = EXTRA.get(stage, ("config",))
    assert list(ours) == [*theirs, *extra]
    for name, param in theirs.items():
        assert (ours[name].kind, ours[name].default) == (param.kind, param.default), name
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extra)


def spy_table(calls):
    """TORCH_BACKWARDS with every call recorded."""
    def spy(name, fn):
        def stage(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)
        return stage

    return TB.StageBackwards(*(spy(name, fn) for name, fn in TB.TORCH_BACKWARDS._asdict().items()
                               if fn is not None))


def case(name="all-features", seed=40):
    spec = EDGE_SHAPES[name]
    inputs, grads = spec.make_inputs(seed=seed), spec.make_output_grads(seed=seed)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    return spec, t, {k: torch.from_numpy(v) for k, v in grads.items()}


def test_composition_calls_each_stage_of_its_table_once():
    spec, t, g = case()
    calls = []
    got = TB.ssd_chunked_backward(g["dy"], **t, **spec.options, dfinal_states=g["dfinal_states"],
                                  backwards=spy_table(calls))
    assert calls == ["chunk_scan", "state_passing", "chunk_state", "chunk_cumsum"]
    want = TB.ssd_chunked_backward_torch(g["dy"], **t, **spec.options,
                                         dfinal_states=g["dfinal_states"])
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_autograd_and_api_hand_their_table_down(monkeypatch):
    """``backwards`` of ssd.autograd.chunk_scan_combined (and of the API, which passes it on)
    is the table the backward composes."""
    from ssd import api

    spec, t, g = case("seq-idx-mid-chunk")
    seq = t.pop("seq_idx")
    for route in ("autograd", "api"):
        calls = []
        leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
        kw = dict(D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
                  initial_states=leaves.get("initial_states"), seq_idx=seq,
                  dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit,
                  backwards=spy_table(calls))
        args = [leaves[k] for k in ("x", "dt", "A", "B", "C")] + [spec.chunk_size]
        if route == "autograd":
            y = AG.chunk_scan_combined(*args, stages=AG.torch_stages, **kw)
        else:
            monkeypatch.setattr(api, "forward_stages", AG.torch_stages)
            monkeypatch.setattr(api, "validate", lambda *a, **k: None)
            y = api.mamba_chunk_scan_combined(*args, **kw)
        y.backward(g["dy"])
        assert calls == ["chunk_scan", "state_passing", "chunk_state", "chunk_cumsum"], route


def stage_arguments(dtype=torch.bfloat16):
    """Each stage's arguments (as the backward passes them: upstream gradients fp32, x, B, dt
    and the entering states in ``dtype``) on a small CPU problem with every option."""
    spec = EDGE_SHAPES["all-features"]
    b, l, h, p, n, g = spec.dims
    c, q = spec.nchunks, spec.chunk_size
    rng = np.random.default_rng(41)
    r = lambda *s, dt=torch.float32: torch.from_numpy(rng.standard_normal(s)).to(dt)  # noqa: E731
    seq = torch.from_numpy(spec.seq_idx())
    dt_out, dA = r(b, h, c, q).abs(), -r(b, h, c, q).abs()
    return dict(
        chunk_scan=((r(b, l, h, p), r(b, l, g, n, dt=dtype), r(b, l, g, n, dt=dtype),
                     r(b, l, h, p, dt=dtype), dt_out, dA, r(b, c, h, p, n, dt=dtype), r(h, p),
                     r(b, l, h, p, dt=dtype), seq), {}),
        state_passing=((r(b, c, h, p, n), r(b, c, h, p, n, dt=dtype), dA, r(b, h, p, n), seq),
                       dict(dfinal_states=r(b, h, p, n), dstates_dtype=dtype)),
        chunk_state=((r(b, c, h, p, n), r(b, l, g, n, dt=dtype), r(b, l, h, p, dt=dtype), dt_out,
                      dA, seq), {}),
        chunk_cumsum=((r(b, h, c, q), r(b, h, c, q), r(b, l, h, dt=dtype), -r(h).abs(), q, r(h),
                       True, spec.dt_limit), dict(dt_out=dt_out)))


@pytest.mark.parametrize("stage", FOUR)
def test_launchers_return_the_torch_functions_keys_shapes_and_dtypes(stage):
    """Under capture (no GPU: the launches are recorded, the outputs left unwritten). chunk_scan's
    dprev_states is the walk's unformed EnteringGradient (``ScanBackwardConfig.dprev_in_walk``)."""
    args, kw = stage_arguments()[stage]
    with launch.capture() as records:
        got = getattr(TB.cutile_backwards(), stage)(*args, **kw)
    want = getattr(TB.TORCH_BACKWARDS, stage)(*args, **kw)
    assert records and list(got) == list(want)
    for key in want:
        if isinstance(got[key], TB.EnteringGradient):  # chunk_scan's dprev_states, for the walk
            assert key == "dprev_states" and got[key].dy.shape == args[0].shape
            continue
        assert (got[key].shape, got[key].dtype) == (want[key].shape, want[key].dtype), key


def replaced(args, kw, index, value):
    """``args`` with argument ``index`` (an int, or a keyword's name) replaced by ``value``."""
    if isinstance(index, str):
        return args, {**kw, index: value}
    return args[:index] + (value,) + args[index + 1:], kw


# (stage, argument position or keyword, a bad value as a function of the good one, the name the
# error must start with)
BAD = [
    ("state_passing", 0, lambda t: t[0], "dprev_states"),
    ("state_passing", 0, lambda t: t.int(), "dprev_states"),
    ("state_passing", 1, lambda t: t[:, :-1], "prev_states"),
    ("state_passing", 1, lambda t: t.long(), "prev_states"),
    ("state_passing", 2, lambda t: t[..., :12], "dA_cumsum"),  # q not a power of two
    ("state_passing", 2, lambda t: t[0], "dA_cumsum"),
    ("state_passing", 4, lambda t: t[:, :40], "seq_idx"),  # too short for c chunks
    ("state_passing", 4, lambda t: t.float(), "seq_idx"),
    ("state_passing", "dfinal_states", lambda t: t[:1], "dfinal_states"),
    ("state_passing", "dstates_dtype", lambda t: torch.int32, "dstates_dtype"),
    ("chunk_state", 0, lambda t: t[:, :-1], "dstates"),
    ("chunk_state", 1, lambda t: t[:, :, :, :-1], "dstates"),  # n from B
    ("chunk_state", 1, lambda t: t[:, :-1], "B"),
    ("chunk_state", 1, lambda t: torch.cat([t, t[:, :, :1]], 2), "B"),  # 4 groups, 6 heads
    ("chunk_state", 2, lambda t: t.double(), "x"),
    ("chunk_state", 3, lambda t: t[:, :, :-1], "dt_out"),
    ("chunk_state", 4, lambda t: t[:, :-1], "dA_cumsum"),
    ("chunk_state", 5, lambda t: t[:, 1:], "seq_idx"),
    ("chunk_cumsum", 0, lambda t: t[..., :-1], "ddt_out"),
    ("chunk_cumsum", 1, lambda t: t.int(), "ddA_cumsum"),
    ("chunk_cumsum", 2, lambda t: t[0], "dt"),
    ("chunk_cumsum", 3, lambda t: t[:-1], "A"),
    ("chunk_cumsum", 4, lambda q: 24, "chunk_size"),
    ("chunk_cumsum", 5, lambda t: t[:-1], "dt_bias"),
    ("chunk_cumsum", 7, lambda lim: (0.1, 0.01), "dt_limit"),
    ("chunk_cumsum", "dt_out", lambda t: t[:, :-1], "dt_out"),
]


@pytest.mark.parametrize("stage, index, bad, name", BAD,
                         ids=[f"{s}-{n}-{i}" for i, (s, _, _, n) in enumerate(BAD)])
def test_launchers_reject_bad_input(stage, index, bad, name):
    args, kw = stage_arguments()[stage]
    good = kw[index] if isinstance(index, str) else args[index]
    args, kw = replaced(args, kw, index, bad(good))
    with launch.capture(), pytest.raises(ValueError, match=f"^{name}: "):
        getattr(TB.cutile_backwards(), stage)(*args, **kw)


def entering(args, dy=lambda t: t, C=lambda t: t):
    """state_passing's arguments with dprev_states unformed: chunk_scan's dy and C for the
    all-features problem, each passed through its function."""
    spec = EDGE_SHAPES["all-features"]
    b, l, h, p, n, g = spec.dims
    grad = TB.EnteringGradient(dy(torch.zeros(b, l, h, p)), C(torch.zeros(b, l, g, n)), None)
    return (grad,) + args[1:]


def test_state_passing_forms_dprev_states_in_its_walk():
    """Given (dy, C) in place of dprev_states, one walk launch forms it (FORM_DPREV) and the
    results are the torch function's for the formed tensor: keys, shapes, and fp32 but where
    dstates_dtype asks otherwise."""
    args, kw = stage_arguments()["state_passing"]
    with launch.capture() as records:
        got = TB.cutile_backwards().state_passing(*entering(args), **kw)
    walk = [r for r in records if r.kernel._pyfunc.__name__ == "state_passing_backward_kernel"]
    assert len(walk) == 1 and walk[0].args[-1] is True
    want = TB.TORCH_BACKWARDS.state_passing(*args, **kw)
    assert [(k, v.shape, v.dtype) for k, v in got.items()] == [
        (k, v.shape, kw["dstates_dtype"] if k == "dstates" else torch.float32)
        for k, v in want.items()]


@pytest.mark.parametrize("dy, C, name", [
    (lambda t: t[:, :, :-1], lambda t: t, "dprev_states.dy"),  # a head short
    (lambda t: t[:, :-30], lambda t: t[:, :-30], "dprev_states.dy"),  # too few chunks
    (lambda t: t, lambda t: t[:, :-1], "dprev_states.C"),
    (lambda t: t, lambda t: t.int(), "dprev_states.C"),
    (lambda t: t, lambda t: torch.cat([t, t[:, :, :1]], 2), "dprev_states.C"),  # 4 groups, 6 heads
])
def test_unformed_dprev_states_are_checked_by_name(dy, C, name):
    args, kw = stage_arguments()["state_passing"]
    with launch.capture(), pytest.raises(ValueError, match=f"^{name}: "):
        TB.cutile_backwards().state_passing(*entering(args, dy, C), **kw)


def test_the_torch_walk_refuses_an_unformed_dprev_states():
    """Only the cuTile walk forms an EnteringGradient: the torch one says so instead of failing
    on an attribute."""
    args, kw = stage_arguments()["state_passing"]
    with pytest.raises(TypeError, match="^dprev_states: an EnteringGradient"):
        TB.TORCH_BACKWARDS.state_passing(*entering(args), **kw)


def test_walk_and_chunk_state_take_their_occupancy_hints():
    """PassingBackwardConfig.occupancy and StateBackwardConfig.occupancy reach the kernels'
    compiler options (None: the compiler's choice); out-of-range hints are refused."""
    from ssd.config import PassingBackwardConfig, StateBackwardConfig

    args = stage_arguments()
    table = TB.cutile_backwards()
    for hint in (None, 4):
        with launch.capture() as records:
            for stage, config in (("state_passing", PassingBackwardConfig(occupancy=hint)),
                                  ("chunk_state", StateBackwardConfig(occupancy=hint))):
                positional, keywords = args[stage]
                getattr(table, stage)(*positional, **keywords, config=config)
        hinted = {r.kernel._pyfunc.__name__: r.kernel._compiler_options.occupancy
                  for r in records}
        assert hinted == {"state_passing_backward_kernel": hint,
                          "state_passing_backward_rows_kernel": None,
                          "chunk_state_backward_dx_kernel": hint,
                          "chunk_state_backward_dB_kernel": hint}
    for cls in (PassingBackwardConfig, StateBackwardConfig):
        with pytest.raises(ValueError, match="occupancy: expected None"):
            cls(occupancy=0)
