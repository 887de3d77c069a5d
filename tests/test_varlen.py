"""mamba_ssm's varlen interface on the CPU: cu_seqlens and return_varlen_states.

The float64 reference's per-sequence final states (``ssd.reference.chunk_state_varlen``, read
from the chunk where each sequence ends) against the recurrence run on each sequence alone; the
return convention; every argument error, of the reference and of ``ssd.api.validate``; and the
forward's launches with and without cu_seqlens.
"""
import numpy as np
import pytest

from ssd import reference as R
from ssd.problem import ProblemSpec

# float64 on both sides, a few hundred terms of O(1) with decays <= 1 (as tests/test_reference.py)
RTOL = 1e-12


def assert_close(actual, expected, name):
    err = np.abs(np.asarray(actual) - expected).max()
    scale = max(1.0, float(np.abs(expected).max()))
    print(f"{name}: max-abs {err:.2e}")
    assert actual.shape == expected.shape and err <= RTOL * scale, f"{name}: {err:.3e}"


def per_sequence(spec, inputs):
    """Each packed sequence's final state from the recurrence run on that sequence alone; the
    initial state feeds the first one where its seq_idx is 0. (num_sequences, h, p, n)."""
    cu, seq = spec.cu_seqlens(), inputs["seq_idx"][0]
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        part = {k: inputs[k][:, start:end] for k in ("x", "dt", "B", "C")}
        h0 = inputs.get("initial_states") if start == 0 and seq[0] == 0 else None
        _, final = R.ssd_recurrence(**part, A=inputs["A"], dt_bias=inputs.get("dt_bias"),
                                    initial_states=h0, dt_softplus=spec.dt_softplus,
                                    dt_limit=spec.dt_limit, return_final_states=True)
        out.append(final[0])
    return np.stack(out)


# (chunk size, seqlen, boundaries): one row of packed sequences each.
PACKINGS = {
    # shorter than a chunk, one token, one across two borders, a last one-token sequence
    "short-one-crossing": (16, 64, (1, 5, 16, 17, 40, 63)),
    # a boundary at 0 (the row starts at seq_idx 1: no initial state), one at a chunk start
    "first-at-0": (16, 64, (0, 3, 32)),
    "one-sequence": (32, 70, ()),
    "within-one-chunk": (64, 50, (7, 8, 30)),
    # the first sequence ends inside chunk 0 with an initial state (where mamba_ssm drops it)
    "first-ends-in-chunk-0": (32, 96, (10, 33)),
    "every-token": (16, 20, tuple(range(1, 20))),
}


@pytest.mark.parametrize("name", list(PACKINGS))
def test_varlen_states_are_each_sequence_run_alone(name):
    q, l, bounds = PACKINGS[name]
    spec = ProblemSpec(1, l, 4, 8, 6, 2, chunk_size=q, dt_bias=True, dt_softplus=True,
                       initial_states=True, seq_boundaries=bounds, name=name)
    inputs = spec.make_inputs(seed=3)
    inputs.setdefault("seq_idx", np.zeros((1, l), np.int32))  # one sequence: seq_idx all 0
    y, final, varlen = R.ssd_chunked(**inputs, **spec.options, cu_seqlens=spec.cu_seqlens(),
                                     return_final_states=True, return_varlen_states=True)
    want = per_sequence(spec, inputs)
    assert_close(varlen, want, f"{name} varlen_states vs recurrence")
    assert_close(varlen[-1], final[0], f"{name} last sequence's state = final_states")


def test_random_packings_against_the_recurrence():
    """Seeded random packings: lengths 1..3 chunks, boundaries anywhere (at chunk starts too)."""
    rng = np.random.default_rng(11)
    for case in range(12):
        q = int(rng.choice([16, 32]))
        l = int(rng.integers(1, 3 * q + 1))
        cuts = sorted(set(rng.integers(0, l, size=int(rng.integers(0, 6))).tolist()))
        spec = ProblemSpec(1, l, 2, 4, 5, 1, chunk_size=q, initial_states=bool(case % 2),
                           seq_boundaries=tuple(cuts), name=f"random{case}")
        inputs = spec.make_inputs(seed=case)
        inputs.setdefault("seq_idx", np.zeros((1, l), np.int32))
        _, varlen = R.ssd_chunked(**inputs, **spec.options, cu_seqlens=spec.cu_seqlens(),
                                  return_varlen_states=True)
        assert_close(varlen, per_sequence(spec, inputs), f"{spec}")


def test_return_order_is_mamba_ssms():
    spec = ProblemSpec(1, 40, 2, 4, 4, 1, chunk_size=16, seq_boundaries=(9, 20))
    inputs = spec.make_inputs(seed=0)
    cu = spec.cu_seqlens()
    y = R.ssd_chunked(**inputs, **spec.options)
    y1, varlen = R.ssd_chunked(**inputs, **spec.options, cu_seqlens=cu, return_varlen_states=True)
    y2, final, varlen2 = R.ssd_chunked(**inputs, **spec.options, cu_seqlens=cu,
                                       return_final_states=True, return_varlen_states=True)
    assert varlen.shape == (3, 2, 4, 4) and final.shape == (1, 2, 4, 4)
    assert np.array_equal(y, y1) and np.array_equal(y, y2) and np.array_equal(varlen, varlen2)
    # read only with return_varlen_states, as mamba_ssm: a bad one is not looked at otherwise
    assert np.array_equal(R.ssd_chunked(**inputs, **spec.options, cu_seqlens=[5]), y)


def test_spec_cu_seqlens_agree_with_seq_idx():
    spec = ProblemSpec(1, 50, 2, 4, 4, seq_boundaries=((0, 16, 49),))
    assert spec.cu_seqlens().tolist() == [0, 16, 49, 50] and spec.cu_seqlens().dtype == np.int32
    R.check_cu_seqlens(spec.cu_seqlens(), 50, spec.seq_idx())
    with pytest.raises(ValueError, match="^cu_seqlens: packs sequences along one batch row"):
        ProblemSpec(2, 50, 2, 4, 4).cu_seqlens()


SEQ = np.repeat(np.arange(3), [4, 10, 6])[None]  # l = 20: sequences [0, 4), [4, 14), [14, 20)
CU_CASES = {
    "float": (np.array([0.0, 4, 14, 20]), TypeError, "expected an integer array"),
    "2-d": (np.array([[0, 4, 14, 20]]), ValueError, r"expected shape \(num_sequences \+ 1,\)"),
    "no-sequence": (np.array([0]), ValueError, r"expected shape \(num_sequences \+ 1,\)"),
    "not-from-0": (np.array([1, 4, 14, 20]), ValueError, "must start at 0"),
    "decreasing": (np.array([0, 14, 4, 20]), ValueError, "must be strictly increasing"),
    "empty-sequence": (np.array([0, 4, 4, 14, 20]), ValueError, "must be strictly increasing"),
    "short-of-l": (np.array([0, 4, 14, 19]), ValueError, "the last offset must be the sequence "
                                                         "length l = 20"),
    "past-l": (np.array([0, 4, 14, 21]), ValueError, "the last offset must be"),
    "disagrees": (np.array([0, 5, 14, 20]), ValueError, r"starts sequences at \[5, 14\], but "
                                                        r"seq_idx changes at \[4, 14\]"),
}


@pytest.mark.parametrize("case", list(CU_CASES))
def test_bad_cu_seqlens_values_are_named(case):
    cu, exc, message = CU_CASES[case]
    with pytest.raises(exc, match=rf"^cu_seqlens: {message}"):
        R.check_cu_seqlens(cu, 20, SEQ)


def test_reference_varlen_argument_errors():
    spec = ProblemSpec(2, 20, 2, 4, 4, chunk_size=8, seq_boundaries=(4, 14))
    inputs = spec.make_inputs(seed=0)
    cu = np.array([0, 4, 14, 20])
    with pytest.raises(ValueError, match="^return_varlen_states: needs cu_seqlens"):
        R.ssd_chunked(**inputs, **spec.options, return_varlen_states=True)
    with pytest.raises(ValueError, match="^cu_seqlens: packs the sequences along one batch row, "
                                         "so x's batch must be 1, got b=2"):
        R.ssd_chunked(**inputs, **spec.options, cu_seqlens=cu, return_varlen_states=True)
    one = {k: v[:1] if k not in ("A",) else v for k, v in inputs.items()}
    del one["seq_idx"]
    with pytest.raises(ValueError, match="^cu_seqlens: needs seq_idx"):
        R.ssd_chunked(**one, **spec.options, cu_seqlens=cu, return_varlen_states=True)
    with pytest.raises(ValueError, match="^cu_seqlens: must be strictly increasing"):
        R.ssd_chunked(**one, seq_idx=SEQ, **spec.options, cu_seqlens=np.array([0, 14, 4, 20]),
                      return_varlen_states=True)


# ---- the public API's checks (CPU tensors: a valid call ends at the device check) ----------

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd.api import validate  # noqa: E402

L, H, P, N, Q = 20, 4, 8, 16, 16


def api_args(batch=1, **over):
    args = dict(x=torch.randn(batch, L, H, P, dtype=torch.bfloat16),
                dt=torch.rand(batch, L, H, dtype=torch.bfloat16), A=-torch.rand(H),
                B=torch.randn(batch, L, 1, N, dtype=torch.bfloat16),
                C=torch.randn(batch, L, 1, N, dtype=torch.bfloat16), chunk_size=Q,
                seq_idx=torch.from_numpy(SEQ).to(torch.int32).expand(batch, L),
                cu_seqlens=torch.tensor([0, 4, 14, 20], dtype=torch.int32),
                return_varlen_states=True)
    args.update(over)
    return args


def test_valid_varlen_call_reaches_the_device_check():
    for cu in (torch.tensor([0, 4, 14, 20]), torch.tensor([0, 4, 14, 20], dtype=torch.int32)):
        with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
            validate(**api_args(cu_seqlens=cu), check_values=True)


API_CASES = {
    "return-without-cu": ("return_varlen_states", dict(cu_seqlens=None), ValueError,
                          "needs cu_seqlens"),
    "float": ("cu_seqlens", dict(cu_seqlens=torch.tensor([0.0, 4, 14, 20])), TypeError,
              "dtype torch.float32 is not supported"),
    "list": ("cu_seqlens", dict(cu_seqlens=[0, 4, 14, 20]), TypeError,
             "expected a torch.Tensor"),
    "2-d": ("cu_seqlens", dict(cu_seqlens=torch.tensor([[0, 4, 14, 20]])), ValueError,
            r"expected shape \(num_sequences \+ 1,\)"),
    "batch-2": ("cu_seqlens", dict(batch=2), ValueError, "packs the sequences along one batch "
                                                         "row, so x's batch must be 1, got b=2"),
    "no-seq_idx": ("cu_seqlens", dict(seq_idx=None), ValueError, "needs seq_idx"),
    "other-device": ("cu_seqlens", dict(cu_seqlens=torch.zeros(4, dtype=torch.int32,
                                                               device="meta")),
                     ValueError, "on meta, but x is on cpu"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_varlen_errors_name_the_argument(case):
    name, over, exc, message = API_CASES[case]
    with pytest.raises(exc, match=rf"^{name}: {message}"):
        validate(**api_args(**over))


VALUE_CASES = {
    "decreasing": (torch.tensor([0, 14, 4, 20]), "must be strictly increasing"),
    "short-of-l": (torch.tensor([0, 4, 14, 18]), "the last offset must be the sequence length"),
    "not-from-0": (torch.tensor([2, 4, 14, 20]), "must start at 0"),
    "disagrees": (torch.tensor([0, 4, 12, 20]), "starts sequences at"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_api_cu_seqlens_values_on_request(case):
    """Offsets are values on the device: checked with check_values (a synchronisation)."""
    cu, message = VALUE_CASES[case]
    with pytest.raises(ValueError, match=rf"^cu_seqlens: {message}"):
        validate(**api_args(cu_seqlens=cu), check_values=True)
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):  # off by default
        validate(**api_args(cu_seqlens=cu))


def test_api_reads_cu_seqlens_only_for_varlen_states():
    """As mamba_ssm: without return_varlen_states, cu_seqlens is not read (a batch of two
    with a float cu_seqlens is a valid call then)."""
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
        validate(**api_args(batch=2, cu_seqlens=torch.tensor([0.5]), return_varlen_states=False))


def test_varlen_adds_one_launch_and_leaves_the_forward_as_it_was():
    """With cu_seqlens the forward launches its kernels exactly as with seq_idx alone (same
    kernels, grids and arguments, so the same y), then chunk_state_varlen, on the default
    stage 2 and on the grouped walk (whose chunk groups it reads)."""
    from ssd import launch
    from ssd.api import forward_stages
    from ssd.config import SSDConfig, StateConfig, default_config

    args = api_args()
    del args["return_varlen_states"]
    cu = args.pop("cu_seqlens")
    for config in (default_config((9, 0)), SSDConfig(state=StateConfig(groups=2))):
        with launch.capture() as plain:
            forward_stages(**args, config=config)
        with launch.capture() as varlen:
            r = forward_stages(**args, config=config, cu_seqlens=cu)
        assert [(v.kernel, v.grid) for v in varlen[:-1]] == [(p.kernel, p.grid) for p in plain]
        assert [repr(launch.signature(v)) for v in varlen[:-1]] == \
            [repr(launch.signature(p)) for p in plain]
        last = varlen[-1]
        assert last.kernel._pyfunc.__name__ == "chunk_state_varlen_kernel"
        assert last.grid[:2] == (3, H) and last.args[-1] is (config.state.groups > 1)
        assert r["varlen_states"].shape == (3, H, P, N)
        assert r["varlen_states"].dtype == torch.float32


def test_varlen_check_takes_stored_states_rounding_and_catches_a_dropped_state():
    """``ssd.validate.check_varlen_states``, the GPU tests' check: states formed from entering
    states rounded to bf16 (as stage 2 stores them) pass it; leaving the initial state out of a
    first sequence that ends inside the first chunk (what mamba_ssm's chunk_state_varlen does)
    fails it, naming that sequence."""
    from ssd.validate import check_varlen_states

    spec = ProblemSpec(1, 200, 4, 16, 16, 1, chunk_size=64, dt_bias=True, dt_softplus=True,
                       initial_states=True, seq_boundaries=(30, 100, 101, 190))
    inputs = spec.make_inputs(seed=2)
    ref = spec.reference(inputs)

    def varlen(prev_states):
        return R.chunk_state_varlen(inputs["B"], inputs["x"], ref["dt_out"], ref["dA_cumsum"],
                                    prev_states, spec.cu_seqlens(), inputs["seq_idx"])

    want = varlen(ref["prev_states"])
    stored = torch.from_numpy(ref["prev_states"]).to(torch.bfloat16).double().numpy()
    check = check_varlen_states(spec, varlen(stored), want, ref, "bfloat16", "bfloat16")
    assert check.ok, check.failure()
    without_h0 = ref["prev_states"].copy()
    without_h0[:, 0] = 0.0  # only the first sequence reads chunk 0's entering state
    check = check_varlen_states(spec, varlen(without_h0), want, ref, "bfloat16", "bfloat16")
    assert not check.elem.ok and check.elem.tile[0] == 0, check.failure()
    assert check.failure().startswith("varlen_states")
