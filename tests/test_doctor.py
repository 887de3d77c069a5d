"""`python -m ssd doctor`: each verdict from made-up facts, and a real run on this machine."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssd.tools import doctor
from ssd.tools.doctor import FAIL, OK, WARN, CompileResult, Facts, Tool, Toolchain

ROOT = Path(__file__).resolve().parents[1]


def toolchain(tileiras="13.4.92", ptxas="13.4.92", libnvvm="13.4.92", source="pip wheels"):
    def tool(name, version):
        return Tool(None if version is None else f"/x/{name}", version)
    return Toolchain(source=source, tileiras=tool("tileiras", tileiras),
                     ptxas=tool("ptxas", ptxas), libnvvm=tool("libnvvm", libnvvm),
                     searched_libnvvm=["/x/nvvm/lib64/libnvvm.so", "/x/lib/libnvvm.so.4"])


def good_facts(**changes) -> Facts:
    """Facts of a machine that can run every chapter (an H200 with the pip toolchain)."""
    facts = Facts(python=(3, 12, 3), numpy="2.1.0", matplotlib="3.9.0", torch="2.11.0+cu130",
                  torch_cuda="13.0", gpu_name="NVIDIA H200", gpu_cc=(9, 0), gpu_count=1,
                  driver="580.159.03", cuda_tile="1.7.0", toolchain=toolchain(),
                  compile=CompileResult("sm_90", True, 0.3),
                  mamba_ssm_ssd="/sp/mamba_ssm/ops/triton/ssd_combined.py", triton="3.6.0",
                  tilegym="1.5.1")
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


# ----------------------------------------------------------------- one check at a time

@pytest.mark.parametrize("cc, tileiras, status", [
    ((7, 0), "13.4.92", FAIL),   # Volta: not a cuTile target
    ((7, 5), "13.4.92", FAIL),
    ((11, 0), "13.4.92", FAIL),
    ((8, 0), "13.2.0", OK),
    ((8, 6), "13.1.80", FAIL),   # Ampere needs 13.2
    ((9, 0), "13.2.51", FAIL),   # Hopper needs 13.3
    ((9, 0), "13.3.0", OK),
    ((9, 0), "13.4.92", OK),
    ((10, 0), "13.1.80", OK),
    ((12, 0), "13.1.80", OK),
    ((9, 0), None, WARN),        # version unknown: the toolchain line says why
])
def test_gpu_compute_capability_and_tileiras(cc, tileiras, status):
    check = doctor.check_gpu("GPU", cc, tileiras)
    assert check.status == status, check
    if cc == (9, 0) and status == FAIL:
        assert "13.3" in check.detail and "13.2.51" in check.detail
    if cc[0] in (7, 11):
        assert "8.x, 9.x, 10.x and 12.x" in check.remedy


def test_no_gpu_fails():
    check = doctor.check_gpu(None, None, "13.4.92")
    assert check.status == FAIL and "no NVIDIA GPU" in check.detail


@pytest.mark.parametrize("version, status", [
    (None, FAIL), ("575.57.08", FAIL), ("579.99", FAIL), ("580.65.06", OK), ("590.1", OK),
    ("garbage", FAIL),
])
def test_driver(version, status):
    assert doctor.check_driver(version).status == status


def test_driver_remedy_names_r580():
    assert "r580" in doctor.check_driver("575.57.08").remedy


@pytest.mark.parametrize("version, status", [
    (None, FAIL), ("1.5.0", FAIL), ("1.6.9", FAIL), ("1.7.0", OK), ("1.8.1", OK), ("2.0", OK),
])
def test_cuda_tile(version, status):
    assert doctor.check_cuda_tile(version).status == status


@pytest.mark.parametrize("version, cuda, status", [
    (None, None, FAIL), ("2.13.0+cpu", None, FAIL), ("2.11.0+cu130", "13.0", OK),
])
def test_torch(version, cuda, status):
    assert doctor.check_torch(version, cuda).status == status


def test_torch_import_error_is_reported():
    check = doctor.check_torch(None, None, "OSError: libcudart.so.13 missing")
    assert check.status == FAIL and "libcudart" in check.detail


def test_python():
    assert doctor.check_python((3, 9, 18)).status == FAIL
    assert doctor.check_python((3, 10, 0)).status == OK


def test_toolchain_consistent_is_ok():
    check = doctor.check_toolchain(toolchain())
    assert check.status == OK
    assert "13.4" in check.detail and "/x/ptxas" in check.detail


@pytest.mark.parametrize("versions, culprit", [
    (dict(ptxas="13.0.88"), "ptxas 13.0.88"),
    (dict(libnvvm="13.0.88"), "libnvvm 13.0.88"),
    (dict(ptxas="12.8.93", libnvvm="13.2.0"), "ptxas 12.8.93 and libnvvm 13.2.0"),
])
def test_toolchain_mismatch_names_the_cause(versions, culprit):
    check = doctor.check_toolchain(toolchain(**versions))
    assert check.status == FAIL
    headline = check.detail.splitlines()[0]
    assert culprit in headline and "another release" in headline
    assert "Return code 5" in headline and "failed to compile Tile IR program" in headline
    assert "13.4" in check.remedy


@pytest.mark.parametrize("missing", ["ptxas", "libnvvm"])
def test_toolchain_missing_piece_names_return_code_5(missing):
    check = doctor.check_toolchain(toolchain(**{missing: None}))
    assert check.status == FAIL
    headline = check.detail.splitlines()[0]
    assert f"{missing} not found" in headline and "Return code 5" in headline
    if missing == "libnvvm":
        assert "/x/lib/libnvvm.so.4" in check.detail  # where it looked


def test_toolchain_without_tileiras():
    check = doctor.check_toolchain(Toolchain(notes=["pip wheels incomplete"]))
    assert check.status == FAIL and "tileiras not found" in check.detail
    assert "cuda-tile[tileiras]" in check.remedy and "incomplete" in check.detail


def test_toolchain_unknown_libnvvm_release_warns():
    assert doctor.check_toolchain(toolchain(libnvvm=None, source="PATH")).status == FAIL
    tc = toolchain(source="PATH")
    tc.libnvvm.version = None
    assert doctor.check_toolchain(tc).status == WARN


def test_toolchain_too_old():
    assert doctor.check_toolchain(toolchain("13.0.88", "13.0.88", "13.0.88")).status == FAIL


def test_compile_failure_with_return_code_5_points_at_toolchain():
    check = doctor.check_compile(CompileResult(
        "sm_90", False, 0.1, "CompilerExecutionError: Return code 5 failed to compile Tile IR program"))
    assert check.status == FAIL and "ptxas or libnvvm" in check.detail
    assert doctor.check_compile(CompileResult("sm_90", True, 0.2)).status == OK
    assert doctor.check_compile(None).status == WARN


def test_peers_only_warn():
    assert doctor.check_mamba_ssm(None, "3.6.0").status == WARN
    assert doctor.check_mamba_ssm("/p/ssd_combined.py", None).status == WARN
    assert doctor.check_mamba_ssm("/p/ssd_combined.py", "3.6.0").status == OK
    assert doctor.check_tilegym(None).status == WARN


def test_major_minor():
    assert doctor.major_minor("13.4.92") == (13, 4)
    assert doctor.major_minor("2.3.2.post1") == (2, 3)
    assert doctor.major_minor("580") == (580, 0)
    assert doctor.major_minor(None) is None and doctor.major_minor("n/a") is None


# ----------------------------------------------------------------- the verdict

def test_good_machine_exits_zero():
    v = doctor.verdict(doctor.run_checks(good_facts()))
    assert v["exit_code"] == 0 and v["gpu_chapters"] and v["cpu_chapters"]


@pytest.mark.parametrize("changes", [
    dict(gpu_cc=None, gpu_name=None),
    dict(gpu_cc=(7, 0)),
    dict(driver="575.64"),
    dict(cuda_tile=None),
    dict(torch_cuda=None),
    dict(toolchain=toolchain(ptxas="13.0.88")),
    dict(toolchain=toolchain("13.2.51", "13.2.51", "13.2.51")),  # Hopper needs 13.3
    dict(compile=CompileResult("sm_90", False, 0.1, "Return code 5")),
])
def test_any_gpu_failure_exits_nonzero_but_cpu_chapters_run(changes):
    v = doctor.verdict(doctor.run_checks(good_facts(**changes)))
    assert v["exit_code"] != 0 and not v["gpu_chapters"] and v["cpu_chapters"]
    assert "CPU chapters (Derivation) can run" in v["summary"]


def test_missing_peers_do_not_block_gpu_chapters():
    v = doctor.verdict(doctor.run_checks(good_facts(tilegym=None, mamba_ssm_ssd=None)))
    assert v["exit_code"] == 0 and "tilegym" in v["summary"] and "mamba_ssm" in v["summary"]


def test_main_prints_table_and_json(monkeypatch):
    monkeypatch.setattr(doctor, "gather", lambda compile=True: good_facts())
    out = io.StringIO()
    assert doctor.main(out=out) == 0
    text = out.getvalue()
    for name in ("python", "numpy", "torch", "gpu", "driver", "cuda-tile", "toolchain",
                 "compile", "mamba_ssm", "tilegym"):
        assert f"  {name}" in text
    assert text.rstrip().splitlines()[-1].startswith("CPU chapters (Derivation) and GPU chapters")
    out = io.StringIO()
    assert doctor.main(as_json=True, out=out) == 0
    data = json.loads(out.getvalue())
    assert data["gpu_chapters"] is True and data["exit_code"] == 0
    assert {c["status"] for c in data["checks"]} <= {OK, WARN, FAIL}


# ----------------------------------------------------------------- locating the toolchain

def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def test_locate_system_toolchain_finds_mismatched_ptxas(tmp_path, monkeypatch):
    """tileiras on PATH with no ptxas beside it runs the first ptxas on PATH."""
    monkeypatch.setattr(doctor, "_dist_version", lambda name: None)  # no pip wheels
    ctk = tmp_path / "ctk-13.4"
    _exe(ctk / "bin" / "tileiras", "#!/bin/sh\necho 'Cuda compilation tools, release 13.4, V13.4.92'\n")
    (ctk / "lib").mkdir()
    (ctk / "lib" / "libnvvm.so.4").write_text("")
    (ctk / "version.json").write_text(json.dumps({"libnvvm": {"version": "13.4.92"}}))
    old = tmp_path / "cuda-13.0"
    _exe(old / "bin" / "ptxas", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    env = {"PATH": f"{ctk / 'bin'}{os.pathsep}{old / 'bin'}"}
    tc = doctor.locate_toolchain(env)
    assert tc.source == "PATH"
    assert (tc.tileiras.version, tc.ptxas.version, tc.libnvvm.version) == ("13.4.92", "13.0.88", "13.4.92")
    assert tc.ptxas.path == str(old / "bin" / "ptxas")
    check = doctor.check_toolchain(tc)
    assert check.status == FAIL and "ptxas 13.0.88" in check.detail.splitlines()[0]

    # CUDA_HOME, when set, is where tileiras loads libnvvm from
    env["CUDA_HOME"] = str(old)
    tc = doctor.locate_toolchain(env)
    assert tc.libnvvm.path is None and str(old / "lib" / "libnvvm.so.4") in tc.searched_libnvvm
    check = doctor.check_toolchain(tc)
    assert "libnvvm not found" in check.detail and "CUDA_HOME" in check.remedy


def test_locate_ignores_mismatched_pip_wheels(monkeypatch):
    versions = {"nvidia-cuda-tileiras": "13.4.92", "nvidia-cuda-nvcc": "13.0.88",
                "nvidia-nvvm": "13.4.92"}
    monkeypatch.setattr(doctor, "_dist_version", versions.get)
    tc = doctor.locate_toolchain({"PATH": ""})
    assert tc.source != "pip wheels"
    assert any("different releases" in n for n in tc.notes)


# ----------------------------------------------------------------- on this machine

def test_doctor_runs_here_and_says_what_can_run():
    """The real command, as a reader runs it. CI has no GPU, so the exit code is nonzero."""
    res = subprocess.run([sys.executable, "-m", "ssd", "doctor", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    data = json.loads(res.stdout)
    names = [c["name"] for c in data["checks"]]
    assert names[:3] == ["python", "numpy", "matplotlib"]
    assert data["cpu_chapters"] is True
    assert res.returncode == data["exit_code"] == (0 if data["gpu_chapters"] else 1)
    if not data["gpu_chapters"]:
        assert any(c["status"] == FAIL and c["part"] == "gpu" for c in data["checks"])
    table = subprocess.run([sys.executable, "-m", "ssd", "doctor", "--no-compile"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert table.returncode == res.returncode
    assert "CPU chapters (Derivation)" in table.stdout.strip().splitlines()[-1]


def test_doctor_without_torch(monkeypatch):
    """No torch, no GPU tools: still a report, not a crash."""
    real_find_spec = doctor.importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in ("torch", "tilegym", "mamba_ssm")
                        else real_find_spec(name, *a))
    monkeypatch.setattr(doctor.shutil, "which", lambda *a, **k: None)
    facts = doctor.gather(compile=False)
    assert facts.torch is None and facts.gpu_cc is None
    checks = {c.name: c for c in doctor.run_checks(facts)}
    assert checks["torch"].status == FAIL and checks["gpu"].status == FAIL
