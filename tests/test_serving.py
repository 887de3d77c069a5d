"""CPU tests of the serving scenario (ssd.tools.serving): the requests are drawn the same every
time; the harness runs end to end with the torch backend on a tiny stack and writes a
well-formed record; and what it generates is, token for token, what running each request alone
through the stack's forward gives at those positions (each step's input being the previous
step's output).

Tolerance: float64, relative Frobenius error 1e-10 per request (the chunked prefill and the
recurrent steps sum in different orders, ~1e-15; a state not handed over or a token off by one
gives 1e-3 and more, see tests/test_generation.py)."""
import json
import math

import pytest

torch = pytest.importorskip("torch")

from ssd.layer import Mamba2Config, Mamba2Stack  # noqa: E402
from ssd.tools import serving  # noqa: E402
from ssd.tools.env import dumps  # noqa: E402

TOL = 1e-10
TINY = Mamba2Config(d_model=32, d_state=8, headdim=16, ngroups=2, chunk_size=16, dtype="float64")
# prompts drawn from 2 to 40 tokens (these: 20, 21 and 31, each across a chunk border of 16)
SCENARIO = serving.Scenario(requests=3, prompt_min=2, prompt_max=40, generate=3, seed=1)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: a thread pool costs more than the work."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def rel_err(out, want) -> float:
    out, want = out.double(), want.double()
    return float(torch.linalg.norm(out - want) / torch.linalg.norm(want))


def test_the_requests_are_drawn_the_same_every_time():
    default = serving.Scenario()
    assert (default.requests, default.prompt_min, default.prompt_max, default.generate) == (
        32, 128, 4096, 128)
    lengths = default.prompt_lengths()
    assert lengths == serving.Scenario().prompt_lengths() and len(lengths) == 32
    assert all(128 <= n <= 4096 for n in lengths) and len(set(lengths)) > 16
    assert serving.Scenario(seed=1).prompt_lengths() != lengths
    u, cu = serving.packed_prompts(TINY, SCENARIO, "cpu")
    assert cu.tolist() == [0, *torch.tensor(SCENARIO.prompt_lengths()).cumsum(0).tolist()]
    assert u.shape == (1, int(cu[-1]), TINY.d_model) and u.dtype == torch.float64


@pytest.mark.parametrize("field, value", [("requests", 0), ("generate", 1.5),
                                          ("prompt_max", 1), ("prompt_min", True)])
def test_a_bad_scenario_is_a_clear_error(field, value):
    with pytest.raises(ValueError, match=field):
        serving.Scenario(**{"prompt_min": 2, "prompt_max": 8, field: value})


def test_the_scenario_runs_end_to_end_and_generates_what_the_forward_gives(tmp_path):
    outputs = {}
    out = tmp_path / "serving.json"
    payload = serving.run(TINY, 2, SCENARIO, ("torch", "cutile"), label="tiny", device="cpu",
                          reps=1, warmup=1, out=out, outputs=outputs)
    # the record: written as returned, one row for the backend that runs here
    disk = json.loads(out.read_text())
    assert disk == json.loads(dumps(payload)) and disk["environment"]["python"]
    assert payload["failures"] == []
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in payload["skipped"]["cutile"]
    assert payload["scenario"]["prompt_lengths"] == SCENARIO.prompt_lengths()
    assert payload["model"] == dict(config="tiny", n_layers=2, d_model=32,
                                    dims=[1, sum(SCENARIO.prompt_lengths()), 4, 16, 8, 2],
                                    dtype="float64", weights_seed=0)
    assert payload["amdahl"] == {"prefill": [], "decode": []}  # one backend: nothing to pair
    (row,) = payload["rows"]
    assert (row["backend"], row["config"], row["n_layers"]) == ("torch", "tiny", 2)
    assert row["decode_mode"] == "eager" and row["eager_because"] == {"decode": "no CUDA device"}
    tokens = SCENARIO.requests * SCENARIO.generate
    assert row["decode_tokens_per_s"] == pytest.approx(tokens / (row["decode_ms_total"] * 1e-3))
    assert row["ssd_prefill_share"] == pytest.approx(2 * row["ssd_prefill_ms_per_layer"]
                                                     / row["ttft_ms"])
    assert row["ssd_step_share"] == pytest.approx(row["ssd_step_ms_total"] / row["step_ms"])
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in
               ("ttft_ms", "step_ms", "ssd_prefill_ms_total", "ssd_step_ms_total"))
    # the generated outputs: each request alone through the forward, token for token
    stack = Mamba2Stack(TINY, 2, seed=0)
    u, cu = outputs["prompts"], outputs["cu_seqlens"]
    gen = outputs["torch"]
    assert gen["steps"].shape == (3, SCENARIO.generate, TINY.d_model)
    for i in range(SCENARIO.requests):
        prompt = u[0, int(cu[i]):int(cu[i + 1])]
        n = prompt.shape[0]
        # the inputs after the prompt are the outputs before them: first token, then steps
        fed = torch.cat([prompt, gen["first"][i:i + 1], gen["steps"][i, :-1]])
        whole = stack(fed[None])[0]
        err = max(rel_err(gen["first"][i], whole[n - 1]), rel_err(gen["steps"][i], whole[n:]))
        print(f"request {i} ({n} prompt tokens): rel err {err:.1e}")
        assert err <= TOL


def test_the_decode_loop_leaves_the_prefill_state_as_it_found_it():
    stack = Mamba2Stack(TINY, 2, seed=3)
    u, cu = serving.packed_prompts(TINY, SCENARIO, "cpu")
    hidden, caches = stack.prefill(u, cu)
    before = [(c.conv_state.clone(), c.ssm_state.clone()) for c in caches]
    first = serving.first_tokens(hidden, cu)
    a, ms, mode, why = serving.decode_loop(stack, caches, first, 2, "cpu", "graph")
    b, *_ = serving.decode_loop(stack, caches, first, 2, "cpu", "eager")
    assert torch.equal(a, b) and len(ms) == 2 and (mode, why) == ("eager", "no CUDA device")
    assert all(torch.equal(c.conv_state, x) and torch.equal(c.ssm_state, y)
               for c, (x, y) in zip(caches, before))


def test_amdahl_pairs_the_base_and_the_new_backend_of_each_phase():
    def row(backend, ttft, ssd_prefill, step, ssd_step):
        return dict(config="2.7b", backend=backend, ttft_ms=ttft, ssd_prefill_ms_total=ssd_prefill,
                    step_ms=step, ssd_step_ms_total=ssd_step)

    a = serving.amdahl_of([row("mamba_ssm", 100.0, 50.0, 2.0, 0.5),
                           row("cutile", 75.0, 25.0, 1.75, 0.25)])
    (pre,), (dec,) = a["prefill"], a["decode"]
    assert (pre["share"], pre["kernel_speedup"], pre["measured"]) == (0.5, 2.0, 100 / 75)
    assert pre["predicted"] == pytest.approx(1 / (0.5 + 0.25))
    assert (dec["share"], dec["kernel_speedup"]) == (0.25, 2.0)
    assert dec["predicted"] == pytest.approx(1 / (0.75 + 0.125))


def test_cli_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert serving.main(["--preset", "130m", "--layers", "1", "--requests", "2", "--prompt-min",
                         "3", "--prompt-max", "9", "--generate", "2", "--backend", "torch",
                         "--reps", "1", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "130m, 1 layers, float32: 2 requests" in text and "tokens/s" in text
    disk = json.loads(out.read_text())
    assert disk["rows"][0]["backend"] == "torch" and disk["settings"]["decode_mode"] == "eager"
    with pytest.raises(SystemExit):
        serving.main(["--requests", "0", "--device", "cpu"])
    assert "requests" in capsys.readouterr().err
