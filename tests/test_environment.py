"""environment.yml (conda, for a cloud GPU) agrees with pyproject.toml.

Every dependency of pyproject (base and the test, book and gpu extras) must be in
environment.yml with the same extras and a spec that admits only versions pyproject allows;
every entry of environment.yml (but python and pip) must be a dependency of pyproject;
environment.yml's python must satisfy requires-python.
"""

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("test", "book", "gpu")
CONDA_ONLY = {"python", "pip"}


def pyproject_requirements(pyproject: dict) -> list[Requirement]:
    project = pyproject["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    extras = project.get("optional-dependencies", {})
    for extra in EXTRAS:
        reqs += [Requirement(r) for r in extras.get(extra, [])]
    return reqs


def conda_requirement(spec: str) -> Requirement:
    """A conda match spec as a PEP 508 requirement: `python=3.12` means 3.12.*."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*", spec)
    if not m:
        raise ValueError(f"cannot read conda spec {spec!r}")
    name, rest = m.groups()
    if rest.startswith("=") and not rest.startswith("=="):
        rest = "==" + rest[1:] + ("" if rest.endswith("*") else ".*")
    elif rest and rest[0].isdigit():
        rest = "==" + rest
    return Requirement(name + rest)


def environment_requirements(env: dict) -> tuple[list[Requirement], list[Requirement], list[str]]:
    """(conda entries, pip entries, local paths installed with pip -e / pip install PATH)."""
    conda, pip, local = [], [], []
    for dep in env.get("dependencies", []):
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                line = line.strip()
                if line.startswith("-e ") or line.startswith("."):
                    local.append(line.removeprefix("-e ").strip())
                elif not line.startswith("-"):
                    pip.append(Requirement(line))
        else:
            conda.append(conda_requirement(str(dep)))
    return conda, pip, local


def _candidates(*specsets: SpecifierSet) -> list[Version]:
    """Versions on and around every bound the specifiers mention."""
    out = {Version("0"), Version("9999")}
    for ss in specsets:
        for spec in ss:
            release = list(Version(spec.version.removesuffix(".*")).release)
            for i in range(len(release)):
                for step in (-1, 0, 1):
                    head = release[:i] + [max(release[i] + step, 0)]
                    for tail in ([], [0], [99], [0, 0], [99, 99]):
                        out.add(Version(".".join(map(str, head + tail))))
    return sorted(out)


def implies(narrow: SpecifierSet, wide: SpecifierSet) -> bool:
    """Every version `narrow` admits is admitted by `wide`, and `narrow` admits some."""
    admitted = [v for v in _candidates(narrow, wide) if narrow.contains(v)]
    return bool(admitted) and all(wide.contains(v) for v in admitted)


def disagreements(pyproject: dict, env: dict) -> list[str]:
    problems = []
    wanted = {}
    for req in pyproject_requirements(pyproject):
        key = canonicalize_name(req.name)
        if key in wanted:  # the same package in two extras: both specs apply
            prev = wanted[key]
            extras = ",".join(sorted(prev.extras | req.extras))
            req = Requirement(f"{req.name}{f'[{extras}]' if extras else ''}"
                              f"{prev.specifier & req.specifier}")
        wanted[key] = req
    conda, pip, local = environment_requirements(env)
    have = {}
    for req in conda + pip:
        key = canonicalize_name(req.name)
        if key in have:
            problems.append(f"environment.yml lists {req.name} twice")
        have[key] = req

    requires_python = SpecifierSet(pyproject["project"].get("requires-python", ""))
    if "python" not in have:
        problems.append("environment.yml does not pin python")
    elif not implies(have["python"].specifier, requires_python):
        problems.append(f"environment.yml's python {have['python'].specifier} does not satisfy "
                        f"requires-python {requires_python}")

    for key, req in wanted.items():
        got = have.get(key)
        if got is None:
            problems.append(f"{req} (pyproject) is missing from environment.yml")
            continue
        if not req.extras <= got.extras:
            problems.append(f"{got} (environment.yml) lacks extras "
                            f"{sorted(req.extras - got.extras)} of {req} (pyproject)")
        if not implies(got.specifier, req.specifier):
            problems.append(f"{got} (environment.yml) admits versions that {req} (pyproject) "
                            "does not")
    for key, got in have.items():
        if key not in wanted and key not in CONDA_ONLY:
            problems.append(f"{got} (environment.yml) is not a dependency in pyproject")

    extras = set(pyproject["project"].get("optional-dependencies", {}))
    for path in local:
        m = re.fullmatch(r"\.(?:\[(.*)\])?", path)
        if not m:
            problems.append(f"environment.yml installs {path!r}: only this project (.) is expected")
        elif m.group(1):
            unknown = {e.strip() for e in m.group(1).split(",")} - extras
            if unknown:
                problems.append(f"environment.yml asks for unknown extras {sorted(unknown)}")
    return problems


def load(pyproject_text: str, env_text: str) -> tuple[dict, dict]:
    return tomllib.loads(pyproject_text), yaml.safe_load(env_text)


def test_environment_yml_agrees_with_pyproject():
    pyproject, env = load((ROOT / "pyproject.toml").read_text(),
                          (ROOT / "environment.yml").read_text())
    problems = disagreements(pyproject, env)
    assert not problems, "\n".join(problems)


def test_environment_yml_installs_this_package():
    _, _, local = environment_requirements(yaml.safe_load((ROOT / "environment.yml").read_text()))
    assert local, "environment.yml should install this repository (-e .)"


# ------------------------------------------------------------------ the checker itself

PYPROJECT = """
[project]
name = "demo"
requires-python = ">=3.10"
dependencies = ["numpy", "matplotlib"]
[project.optional-dependencies]
test = ["pytest", "cuda-tile[tileiras]>=1.7"]
book = ["jupyter-book>=1.0.4,<2"]
gpu = ["torch"]
"""

GOOD_ENV = """
dependencies:
  - python=3.12
  - numpy
  - matplotlib
  - pip
  - pip:
      - pytest
      - cuda-tile[tileiras]>=1.7
      - jupyter-book>=1.0.4,<2
      - torch>=2.4
      - -e .[gpu]
"""


def test_checker_accepts_a_consistent_pair():
    assert disagreements(*load(PYPROJECT, GOOD_ENV)) == []


@pytest.mark.parametrize("old, new, complaint", [
    ("      - torch>=2.4\n", "", "torch (pyproject) is missing"),
    ("  - numpy\n", "", "numpy (pyproject) is missing"),
    ("      - jupyter-book>=1.0.4,<2", "      - jupyter-book", "admits versions"),
    ("      - jupyter-book>=1.0.4,<2", "      - jupyter-book>=2", "admits versions"),
    ("      - cuda-tile[tileiras]>=1.7", "      - cuda-tile>=1.7", "lacks extras"),
    ("      - cuda-tile[tileiras]>=1.7", "      - cuda-tile[tileiras]>=1.5", "admits versions"),
    ("      - pytest\n", "      - pytest\n      - scipy\n", "scipy (environment.yml) is not a dependency"),
    ("  - python=3.12", "  - python=3.9", "does not satisfy requires-python"),
    ("  - python=3.12\n", "", "does not pin python"),
    ("      - -e .[gpu]", "      - -e .[cuda]", "unknown extras"),
    ("      - torch>=2.4", "      - torch>=2.4,<2.4", "admits versions"),  # unsatisfiable
])
def test_checker_catches_disagreement(old, new, complaint):
    assert old in GOOD_ENV
    problems = disagreements(*load(PYPROJECT, GOOD_ENV.replace(old, new)))
    assert any(complaint in p for p in problems), problems


def test_conda_specs():
    assert str(conda_requirement("python=3.12").specifier) == "==3.12.*"
    assert conda_requirement("python=3.12").specifier.contains("3.12.7")
    assert not conda_requirement("python=3.12").specifier.contains("3.13.0")
    assert str(conda_requirement("numpy>=1.26").specifier) == ">=1.26"
    assert conda_requirement("numpy").specifier == SpecifierSet()
