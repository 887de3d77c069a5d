"""ssd.book.training: the tables and figures read recordings made by the tools' own code on the
CPU: ``backward_bench.run`` with its GPU parts (inputs, timing, the gradient gate, memory)
replaced by stand-ins whose times are known, ``train.step_sweep`` and ``train.run`` with the
torch backend on tiny sizes, their rows then standing for both backends. Each speedup, share,
goal and curve comparison is checked against what was put in."""
import dataclasses
import math

import matplotlib
import pytest

matplotlib.use("Agg")

torch = pytest.importorskip("torch")

from ssd.book import training as TR  # noqa: E402
from ssd.tools import backward_bench as BB  # noqa: E402
from ssd.tools import peers  # noqa: E402
from ssd.tools import train as T  # noqa: E402
from ssd.tools.bench import SUITES  # noqa: E402

SHAPES = SUITES["models"][:3]
#: (forward, forward + backward) ms of each implementation at chunk 64 (chunk 128: twice), and
#: its extra peak MB; ours is 2.5x mamba_ssm on the first shape, 1.8x on the others; 2.0x
#: TileGym untuned on the first, 1.44x on the others; 1.1x TileGym tuned on the first, 0.79x on
#: the others. TileGym runs at chunk 64 only.
TIMES = {"ssd": (0.2, 1.0), "mamba_ssm": (0.5, 2.5), "tilegym": (0.6, 2.0),
         "tilegym_tuned": (0.3, 1.1)}
MB = {"ssd": 300.0, "mamba_ssm": 250.0, "tilegym": 200.0, "tilegym_tuned": 200.0}
OURS_OTHER = TIMES["mamba_ssm"][1] / 1.8  # ours' forward + backward on the other shapes


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a thread pool costs more than the work."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def recorded(monkeypatch, impls=BB.DEFAULT_IMPLS):
    """backward_bench.run on the CPU with stand-ins: a forward + backward "returns" its time
    seven times over (the seven gradients), the forward its time; chunk 128 takes twice
    chunk 64's."""
    def impls_(leaves, names, chunks):
        table = {}
        for impl in names:
            f, fb = TIMES[impl]
            if impl == "ssd" and leaves["shape"] != SHAPES[0].name:
                fb = OURS_OTHER
            sizes = (64,) if impl.startswith("tilegym") else chunks
            table[impl] = {q: (lambda f=f * q / 64, fb=fb * q / 64: (f, fb)) for q in sizes}
        return table, {}

    def time_fn(fn, mode, l2, reps):
        out = fn()
        ms = out[0] if isinstance(out, tuple) else out
        return dict(median_ms=ms, q20_ms=ms, q80_ms=ms, min_ms=ms, reps=reps)

    monkeypatch.setattr(BB, "make_inputs", lambda shape, dtype: dict(shape=shape.name))
    monkeypatch.setattr(BB, "upstream", lambda shape, dtype: None)
    monkeypatch.setattr(BB, "GradGate", lambda shape, inputs, dy: (
        lambda grads: dict(gate_rel_err=1e-3, gate_elem_ratio=0.1, ok=True)))
    monkeypatch.setattr(BB, "leaves_of", lambda inputs: inputs)
    monkeypatch.setattr(BB, "implementations", impls_)
    monkeypatch.setattr(BB, "inference", lambda fwd: (lambda: fwd()[0]))
    monkeypatch.setattr(BB, "training_step", lambda fwd, leaves, dy: (
        lambda: (fwd()[1],) * len(BB.LEAVES)))
    monkeypatch.setattr(BB, "extra_peak_mb", lambda fn: 0.0)
    monkeypatch.setattr(BB, "time_fn", time_fn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(peers, "retune_mamba_ssm", lambda: 0)
    monkeypatch.setattr(peers, "mamba_ssm_configs", lambda: {})
    monkeypatch.setattr(peers, "retune_tilegym", lambda: 0)
    monkeypatch.setattr(peers, "tilegym_configs", lambda tuned: {"k": [f"tuned={tuned}"]})
    payload = BB.run(SHAPES, impls=impls, chunks=(64, 128), reps=3)
    for r in payload["records"]:  # what torch.cuda's peak would have said, per implementation
        r["extra_peak_mb"] = MB[r["impl"]]
    return payload


@pytest.fixture
def backward(monkeypatch):
    """The default run: ours, mamba_ssm, TileGym untuned."""
    return recorded(monkeypatch)


@pytest.fixture
def tuned(monkeypatch):
    """make gpu-tilegym-backward's run: ours and TileGym tuned."""
    return recorded(monkeypatch, ("ssd", "tilegym_tuned"))


def test_fb_table_and_goals(backward):
    assert not backward["failures"]
    table = TR.fb_table(backward)
    print(table)
    rows = {r["shape"]: r for r in table}
    first, other = rows[SHAPES[0].name], rows[SHAPES[1].name]
    assert first["x_mamba_ssm"] == pytest.approx(2.5) and other["x_mamba_ssm"] == \
        pytest.approx(1.8)
    assert first["bwd_over_fwd"] == pytest.approx((1.0 - 0.2) / 0.2)
    assert rows["geometric mean"]["x_mamba_ssm"] == pytest.approx((2.5 * 1.8 * 1.8) ** (1 / 3))
    goals = {r["goal"]: r for r in TR.fb_goals(backward)}
    print(TR.fb_goals(backward))
    mean = goals["fwd+bwd over mamba_ssm, geometric mean"]
    assert mean["met"] is ((2.5 * 1.8 * 1.8) ** (1 / 3) >= 2.0)
    assert goals["fwd+bwd over mamba_ssm, every shape"]["met"] is True
    memory = goals["extra peak memory over mamba_ssm's, every shape"]
    assert memory["met"] is False and memory["margin"] == pytest.approx(250 / 300 - 1)
    untuned = goals["faster than TileGym fwd+bwd, every shape"]
    low = TIMES["tilegym"][1] / OURS_OTHER
    assert untuned["met"] is True and untuned["margin"] == pytest.approx(low - 1)
    assert untuned["where"] == SHAPES[1].name  # tied with SHAPES[2]: min takes the lesser name
    assert goals["faster than TileGym tuned fwd+bwd, every shape"]["where"] == "not recorded"
    assert first["x_tilegym"] == pytest.approx(2.0)
    assert backward["tilegym_configs"][SHAPES[0].name] == {"tilegym": {"k": ["tuned=False"]}}
    assert all(r["chunk_size"] == 64 for r in backward["records"] if r["impl"] == "tilegym")
    assert goals["stretch: our backward over our forward, every shape"]["met"] is False
    assert goals["first fwd+bwd call of a shape, compiles included (s)"]["met"] is True
    TR.plot_fb(backward)
    none = dict(backward, records=[r for r in backward["records"] if r["impl"] != "tilegym"])
    goals = {r["goal"]: r for r in TR.fb_goals(none)}
    assert goals["faster than TileGym fwd+bwd, every shape"]["where"] == "not recorded"
    assert goals["faster than TileGym fwd+bwd, every shape"]["met"] is None



def test_memory_table_counts_the_entering_states_and_their_gradient(backward):
    """One row per shape and chunk size of ours, mamba_ssm's beside it at the same chunk; the
    states' MiB are 2 b ceil(l/q) h p n bf16 elements, halving from chunk 64 to 128."""
    table = TR.memory_table(backward)
    print(table)
    assert len(table) == len(SHAPES) * 2
    for shape in SHAPES:
        b, l, h, p, n, _ = shape.dims
        at64, at128 = (table.find(shape=shape.name, chunk=q) for q in (64, 128))
        assert at64["states_mb"] == pytest.approx(2 * b * -(-l // 64) * h * p * n * 2 / 2**20)
        assert at128["states_mb"] == pytest.approx(at64["states_mb"] / 2, rel=0.02)
        assert at64["ours_mb"] == MB["ssd"] and at64["mamba_mb"] == MB["mamba_ssm"]
        assert at64["states_share"] == pytest.approx(at64["states_mb"] / MB["ssd"])
        assert at128["mamba_ms"] == pytest.approx(2 * TIMES["mamba_ssm"][1])

def test_tilegym_tuned_goal_read_from_its_own_recording(backward, tuned):
    assert all(r.get("tuning") == "searched" for r in tuned["records"]
               if r["impl"] == "tilegym_tuned")
    assert tuned["tilegym_configs"][SHAPES[0].name] == {"tilegym_tuned": {"k": ["tuned=True"]}}
    goals = {r["goal"]: r for r in TR.fb_goals(backward, tuned=tuned)}
    row = goals["faster than TileGym tuned fwd+bwd, every shape"]
    low = TIMES["tilegym_tuned"][1] / OURS_OTHER
    assert row["met"] is False and row["margin"] == pytest.approx(low - 1)
    assert row["where"] == SHAPES[1].name and row["measured"] == f"{low:.2f}×"
    assert goals["faster than TileGym fwd+bwd, every shape"]["met"] is True  # still untuned's


@pytest.fixture(scope="module")
def step():
    """train.step_sweep on the smoke stack with the torch backend; its row then stands for
    mamba_ssm's and ours, with times put in."""
    payload = T.step_sweep(T.SMOKE_STEP_SHAPES, ("torch",), chunk_size=T.SMOKE_STEP_CHUNK,
                           reps=1, warmup=0, device="cpu", progress=False)
    (row,) = payload["rows"]
    rows = []
    # times a GPU might record (CPU times of a tiny stack are noise): the SSD's forward +
    # backward 20 % of mamba_ssm's step, then twice as fast with ours
    for backend, ssd in ((T.BASE, 2.0), (T.NEW, 1.0)):
        rows.append(dict(row, backend=backend, ssd_ms_total=ssd, step_ms=8.0 + ssd,
                         ssd_share=ssd / (8.0 + ssd)))
    return dict(payload, rows=rows, amdahl=T._amdahl(rows))


def test_step_table(step):
    (row,) = TR.step_table(step)
    assert row["kernel_speedup"] == pytest.approx(2.0)
    assert row["measured"] == pytest.approx(row["predicted"])
    assert row["share"] == pytest.approx(0.2) and row["measured"] == pytest.approx(10 / 9)
    TR.plot_step(step)


@pytest.fixture(scope="module")
def training():
    """train.run on the tiny preset, torch backend, two seeds; each run then also stands for
    the other backend (what a GPU run records: same seed, same data)."""
    config = dataclasses.replace(T.TRAIN_PRESETS["tiny"], steps=4, eval_every=2,
                                 train_examples=64, eval_examples=32)
    payload = T.run(config, ("torch",), seeds=(0, 1), device="cpu", progress=False,
                    name="tiny")
    runs = []
    for r in payload["runs"]:
        runs.append(dict(r, backend=T.BASE))
        runs.append(dict(r, backend=T.NEW, eval_loss=[v + 1e-4 for v in r["eval_loss"]]))
    return dict(payload, runs=runs)


def test_mqar_tables_and_curves(training):
    assert "MQAR: 4 key-value pairs" in TR.task_line(training)
    table = TR.mqar_table(training)
    assert len(table) == 4 and set(table.column("backend")) == {T.BASE, T.NEW}
    noise = TR.noise_table(training)
    between = [r for r in noise if r["kind"].startswith("backends")]
    seeds = [r for r in noise if r["kind"].startswith("noise")]
    assert len(between) == 2 and len(seeds) == 2
    assert all(r["mean_abs"] == pytest.approx(1e-4) for r in between)
    assert all(math.isfinite(r["mean_abs"]) for r in seeds)
    TR.plot_curves(training)
