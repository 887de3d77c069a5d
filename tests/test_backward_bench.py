"""The forward + backward benchmark's CPU-checkable parts: the gradient gate (on the PyTorch
backward, run on the CPU), the choice of each implementation's fastest chunk size, the table and
the command line."""
import pytest

torch = pytest.importorskip("torch")

from ssd import autograd as AG  # noqa: E402
from ssd.tools import backward_bench as BB  # noqa: E402
from ssd.tools.bench import Shape, make_inputs  # noqa: E402

TINY = Shape("tiny", 2, 40, 4, 8, 16, 2)


def cpu_gradients(shape, inputs, dy, chunk_size=16):
    """Every leaf's gradient through the autograd Function, the PyTorch forward injected."""
    leaves = BB.leaves_of(inputs)
    x, dt, A, B, C, D, bias = (leaves[k] for k in BB.LEAVES)
    y = AG.chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias, dt_softplus=True,
                               stages=AG.torch_stages)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    return dict(zip(("d" + k for k in BB.LEAVES), grads))


def test_gate_passes_the_backward_and_fails_a_wrong_gradient():
    inputs = make_inputs(TINY, "bfloat16", device="cpu")
    dy = BB.upstream(TINY, "bfloat16", device="cpu")
    gate = BB.GradGate(TINY, inputs, dy)
    grads = cpu_gradients(TINY, inputs, dy)
    checked = gate(grads)
    print(checked)
    assert checked["ok"] and checked["gate_rel_err"] < 1e-2
    wrong = dict(grads, dA=grads["dA"] * 1.1)  # off by 10 % on every head
    assert not gate(wrong)["ok"]
    with pytest.raises(ValueError, match="^heads"):
        BB.GradGate(TINY, inputs, dy, heads=3)


def record(shape, impl, q, what, ms, mode="graph"):
    return dict(shape=shape, impl=impl, chunk_size=q, what=what, mode=mode, median_ms=ms,
                extra_peak_mb=100.0)


RECORDS = [
    record("a", "ssd", 64, "forward", 0.2), record("a", "ssd", 64, "forward+backward", 1.0),
    record("a", "ssd", 128, "forward", 0.1), record("a", "ssd", 128, "forward+backward", 1.2),
    record("a", "mamba_ssm", 64, "forward", 0.3),
    record("a", "mamba_ssm", 64, "forward+backward", 2.0),
    record("b", "ssd", 64, "forward", 0.5), record("b", "ssd", 64, "forward+backward", 4.0),
    record("b", "mamba_ssm", 64, "forward+backward", 2.0, mode="eager"),
]


def test_each_implementation_at_its_fastest_forward_and_backward():
    top = BB.best(RECORDS)
    assert top[("a", "ssd")]["forward+backward"]["chunk_size"] == 64  # not the faster forward's
    assert top[("a", "ssd")]["forward"]["median_ms"] == 0.2
    assert ("b", "mamba_ssm") not in top  # eager only
    assert BB.speedups(RECORDS) == {"a": 2.0}


def test_table_lists_the_best_records_and_the_geometric_mean():
    payload = dict(records=RECORDS, failures=[dict(shape="b", impl="mamba_ssm", error="boom")],
                   skipped={}, settings=dict(modes=["graph"], l2="flushed"))
    text = BB.table(payload)
    print(text)
    assert "geometric mean 2.00x over 1 shapes" in text and "FAILED" in text
    line = next(l for l in text.splitlines() if l.startswith("a") and "ssd " in l)
    assert line.split()[3:6] == ["0.200", "1.000", "5.00"] and line.endswith("2.00x")


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "7b"], "--shapes: 7b unknown"),
    (["--modes", "graph,fast"], "--modes: fast unknown"),
    (["--chunks", "48"], "--chunks: [48]"),
])
def test_main_rejects_what_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        BB.main(argv)
    assert message in capsys.readouterr().err


def test_merge_keeps_other_shapes_of_the_same_revision_only(tmp_path):
    env = dict(git_revision="abc", gpu="G")
    settings = dict(modes=["graph"], l2="flushed")

    def payload(shape, ms, revision="abc"):
        recs = [dict(r, median_ms=ms) for r in RECORDS if r["shape"] == shape]
        return dict(records=recs, failures=[], skipped={f"{shape}/tilegym": "no"},
                    mamba_ssm_configs={shape: {}}, settings=settings,
                    environment=dict(env, git_revision=revision))

    path = tmp_path / "backward.json"
    assert BB.merged(path, payload("a", 1.0)) == payload("a", 1.0)  # nothing there yet
    BB.write_json(path, payload("a", 1.0))
    both = BB.merged(path, payload("b", 2.0))
    assert {r["shape"] for r in both["records"]} == {"a", "b"}
    assert set(both["skipped"]) == {"a/tilegym", "b/tilegym"} and set(both["mamba_ssm_configs"]) == {"a", "b"}
    again = BB.merged(path, payload("a", 3.0))  # a shape run again replaces its records
    assert {r["median_ms"] for r in again["records"]} == {3.0}
    other = BB.merged(path, payload("b", 2.0, revision="def"))  # another revision: alone
    assert {r["shape"] for r in other["records"]} == {"b"}
