"""chunk_scan's quick first call (ssd.launch), on the CPU: the child process that compiles the
tuned build into cuTile's kernel cache, and the choice between the two builds at each launch.
(The GPU test test_quick_first_call_computes_what_the_tuned_build_computes runs both builds.)"""
import logging
import subprocess

import pytest

pytest.importorskip("cuda.tile")

import cuda.tile as ct  # noqa: E402

from ssd import launch  # noqa: E402
from ssd.tools import aot  # noqa: E402
from ssd.kernels import chunk_scan  # noqa: E402
from ssd.config import default_config  # noqa: E402


def scan_record(dims=(2, 256, 8, 64, 64, 1), q=64):
    b, l, h, p, n, g = dims
    config = default_config((9, 0), problem=(b, h, p, n), sms=132, chunk_size=q, seqlen=l)
    records = aot.capture_forward("bfloat16", "layer", config.state.fused, chunk_size=q,
                                  config=config, dims=dims)
    (record,) = [r for r in records if r.kernel._pyfunc.__name__ == "chunk_scan_kernel"]
    sc = config.scan
    rebuild = launch.Rebuild("ssd.kernels.chunk_scan", "build_kernel",
                              (ct.int32, sc.occupancy, sc.latency, sc.warps))
    return record, rebuild


def test_rebuild_names_the_same_kernel():
    record, rebuild = scan_record()
    assert launch.Rebuild.decode(rebuild.encode()) is record.kernel
    assert '"dtype": "int32"' in rebuild.encode()


def test_background_build_fills_the_kernel_cache_under_the_launch_signature(tmp_path):
    """The child's cubin is cached under the launch's own signature (its mangled name is the
    symbol cuTile's launcher compiles, test_aot checks that against a GPU run), and a second
    build of the same launch finds it there instead of adding an entry."""
    from cutile_cache._cache import cache_entries

    record, rebuild = scan_record()
    symbol = launch.signature(record).with_mangled_symbol("chunk_scan_kernel").symbol
    for _ in range(2):
        build = launch.start(record, rebuild, "sm_90", str(tmp_path))
        assert build.proc.wait(timeout=300) == 0, build.stderr.seek(0) or build.stderr.read()
        build.stderr.close()
        entries = cache_entries(str(tmp_path))
        assert [e.metadata.kernel_names for e in entries] == [[symbol]]


def test_child_refuses_a_symbol_of_another_kernel():
    record, rebuild = scan_record()
    other = launch.Rebuild("ssd.kernels.chunk_cumsum", "build_kernel", ())
    symbol = launch.signature(record).with_mangled_symbol("chunk_scan_kernel").symbol
    with pytest.raises(SystemExit, match="not chunk_scan_kernel"):
        launch.main(["sm_90", symbol, other.encode()])


class FakeProc:
    """A child process that finishes when told to."""
    pid = 4242

    def __init__(self):
        self.code = None

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        if self.code is None:
            self.code = 0  # waiting lets it finish
        return self.code


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "_pending", {})
    monkeypatch.setattr(launch, "settled", set())
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SSD_QUICK_FIRST_CALL", "1")
    procs = []

    def start(record, tuned, arch, cache):
        procs.append(FakeProc())
        return launch._Build("chunk_scan", procs[-1], open(tmp_path / "err", "w+b"), 0.0)

    monkeypatch.setattr(launch, "start", start)
    return procs


def pick(tuned, quick, capturing, args=()):
    """What ssd.launch.launch asks for a launch of ``tuned`` with ``args``, unless settled."""
    key = launch.launch_key(tuned, args)
    if key in launch.settled:
        return tuned
    return launch.pick(key, quick, launch.Launch(tuned, (1,), args), "sm_90", capturing)


def test_quick_build_runs_until_the_tuned_one_is_ready(fresh_state, caplog):
    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    with caplog.at_level(logging.INFO, logger="ssd"):
        assert pick(tuned, quick, False) is quick.quick
        assert pick(tuned, quick, False) is quick.quick
        assert len(fresh_state) == 1 and "pid 4242" in caplog.text
        fresh_state[0].code = 0
        assert pick(tuned, quick, False) is tuned
    assert (tuned,) in launch.settled and not launch._pending
    assert "tuned build ready" in caplog.text


def test_a_new_shape_of_a_settled_kernel_gets_its_own_build(fresh_state):
    """Keys are per launch, not per kernel: a never-seen shape compiles in the background too."""
    import torch

    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    a, b = torch.empty(2, 64), torch.empty(3, 64)
    assert pick(tuned, quick, False, (a, 64)) is quick.quick
    assert launch.wait_tuned() == 1 and pick(tuned, quick, False, (a, 64)) is tuned
    assert pick(tuned, quick, False, (torch.empty(2, 64), 64)) is tuned   # the same key
    assert pick(tuned, quick, False, (b, 64)) is quick.quick and len(fresh_state) == 2
    assert pick(tuned, quick, False, (a, 32)) is quick.quick and len(fresh_state) == 3
    assert launch.launch_key(tuned, (a.t(),)) != launch.launch_key(tuned, (a,))


def test_graph_capture_waits_for_the_tuned_build(fresh_state):
    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    assert pick(tuned, quick, False) is quick.quick
    assert pick(tuned, quick, True) is tuned
    assert fresh_state[0].code == 0 and (tuned,) in launch.settled


def test_wait_tuned_finishes_every_build(fresh_state):
    kernels = [object(), object()]
    for k in kernels:
        pick(k, launch.QuickFirst(object(), launch.Rebuild("m", "f")), False)
    assert launch.wait_tuned() == 2 and launch.settled == {(k,) for k in kernels}
    assert launch.wait_tuned() == 0


def test_a_failed_build_is_reported_and_the_tuned_kernel_compiles_in_place(fresh_state, caplog):
    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    pick(tuned, quick, False)
    fresh_state[0].code = 3
    with caplog.at_level(logging.WARNING, logger="ssd"):
        assert pick(tuned, quick, False) is tuned
    assert "failed (exit 3)" in caplog.text


@pytest.mark.parametrize("env", [dict(SSD_QUICK_FIRST_CALL="0"), dict(CUDA_TILE_CACHE_DIR="off")])
def test_no_quick_build_when_turned_off_or_without_a_cache(fresh_state, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    assert pick(tuned, quick, False) is tuned
    assert not fresh_state and (tuned,) in launch.settled


def test_a_timed_out_wait_leaves_the_build_pending(fresh_state, monkeypatch):
    tuned, quick = object(), launch.QuickFirst(object(), launch.Rebuild("m", "f"))
    pick(tuned, quick, False)

    def timeout(timeout=None):
        raise subprocess.TimeoutExpired("child", timeout)

    monkeypatch.setattr(fresh_state[0], "wait", timeout)
    with pytest.raises(subprocess.TimeoutExpired):
        launch.wait_tuned(timeout=0.1)
    assert (tuned,) in launch._pending


def test_chunk_scan_hands_its_launch_a_quick_build_at_occupancy_1(monkeypatch):
    """The launcher's QuickFirst: the same kernel function with the occupancy hint at 1, and a
    Rebuild that builds the very kernel it launches."""
    seen = []
    monkeypatch.setattr(chunk_scan, "launch", lambda kernel, grid, args, device=None, quick=None:
                        seen.append((kernel, quick)))
    config = default_config((9, 0), problem=(2, 8, 64, 64), sms=132, chunk_size=64, seqlen=256)
    aot.capture_forward("bfloat16", "layer", True, chunk_size=64, config=config,
                        dims=(2, 256, 8, 64, 64, 1))
    ((kernel, quick),) = seen
    assert kernel._compiler_options.occupancy != 1
    assert quick.quick._compiler_options.occupancy == chunk_scan.QUICK_OCCUPANCY == 1
    assert quick.quick._pyfunc.__code__ is kernel._pyfunc.__code__
    assert launch.Rebuild.decode(quick.tuned.encode()) is kernel
