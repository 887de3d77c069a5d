"""ssd.nbutil.same_kernels: the commits it lets a steady-state recording outlive must leave every
kernel as it was (SAME_KERNELS), or every kernel of the shapes it lets pass (SHAPE_KERNELS). For
each such commit the forward's kernels are built at the revision before it and at it, from the same
folder (the TileIR records source locations), and their TileIR bytecode compared per shape
(tests/kernel_bytecode.py; cuTile's front end only, no tileiras)."""
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("cuda.tile")

from ssd.env import ROOT  # noqa: E402
from ssd.nbutil import SAME_KERNELS, SHAPE_KERNELS, known_revision, same_kernels  # noqa: E402

SCRIPT = Path(__file__).with_name("kernel_bytecode.py")


def needs_history(*revs):
    """Skip where this checkout's git lacks the revisions (a shallow clone, a copy without .git):
    what these tests compare is in the history."""
    if not all(known_revision(r) for r in revs):
        pytest.skip("no git history here for " + ", ".join(revs))


def kernel_bytecode(rev: str, tree: Path) -> dict:
    """{shape's dims as JSON: {kernel: bytecode digest}} of the ``ssd`` package at git revision
    ``rev``, unpacked in ``tree`` (emptied first)."""
    if tree.exists():
        subprocess.run(["rm", "-rf", str(tree)], check=True)
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev, "ssd"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(tree, filter="data")
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("commit", sorted(SAME_KERNELS))
def test_a_same_kernels_commit_changes_no_kernel(commit, tmp_path):
    needs_history(f"{commit}^", commit)
    before = flat(kernel_bytecode(f"{commit}^", tmp_path / "tree"))
    after = flat(kernel_bytecode(commit, tmp_path / "tree"))
    assert len(before) > 100 and before.keys() == after.keys()
    assert [k for k in before if before[k] != after[k]] == []


def flat(by_shape: dict) -> dict:
    """{kernel: digest} over every shape of :func:`kernel_bytecode` (a kernel's digest is one)."""
    return {k: v for kernels in by_shape.values() for k, v in kernels.items()}


@pytest.mark.parametrize("commit", sorted(SHAPE_KERNELS))
def test_a_shape_kernels_commit_changes_only_its_shapes(commit, tmp_path):
    needs_history(f"{commit}^", commit)
    _, names, changes = SHAPE_KERNELS[commit]
    before = kernel_bytecode(f"{commit}^", tmp_path / "tree")
    after = kernel_bytecode(commit, tmp_path / "tree")
    assert before.keys() == after.keys()
    # a shape moved where a kernel it ran is gone or changed (kernels a commit adds to the small
    # shapes' union of configurations, such as a new study point, change none that ran there)
    moved = {tuple(json.loads(dims)) for dims in before
             if any(after[dims].get(k) != v for k, v in before[dims].items())}
    assert [d for d in moved if not changes(d)] == []   # the shapes it lets pass are as they were
    assert {tuple(d) for d in names} <= moved           # and those it names did change


def test_same_kernels_is_false_across_a_kernel_change():
    """292cece changed chunk_scan's tile code (its grouped completion by MMA); e0ccb07, the
    revision of the current recordings, has its kernels."""
    needs_history("292cece^", "e0ccb07")
    assert same_kernels("292cece^", "292cece") is False
    assert same_kernels("292cece", "e0ccb07") is True


def test_same_kernels_passes_a_listed_commit_only():
    """Across the quick first call's landing the kernel code differs, the kernels do not."""
    from ssd.nbutil import KERNEL_CODE, same_code

    needs_history("292cece^", "9faf4d9", "e81deae")
    assert same_code("9faf4d9", "e81deae", paths=KERNEL_CODE) is False
    assert same_kernels("9faf4d9", "e81deae") is True
    assert same_kernels("292cece^", "e81deae") is False   # and not across an earlier change


def test_kernels_digest_answers_same_kernels_without_git(tmp_path, monkeypatch):
    """On a machine without git (the GPU's) same_kernels reads results/code_digests.json: one
    digest per line of kernels, equal exactly where git finds the kernels the same."""
    import json

    from ssd import nbutil

    revs = ["292cece^", "292cece", "e0ccb07", "9faf4d9", "e81deae", "fa1cf03"]
    needs_history(*revs)
    digest = {r: nbutil.kernels_digest(r) for r in revs}
    for a in revs:
        for b in revs:
            assert (digest[a] == digest[b]) is same_kernels(a, b), (a, b)
    table = tmp_path / "code_digests.json"
    table.write_text(json.dumps({"digests": {"kernel": {}, "kernels": digest}}))
    monkeypatch.setattr(nbutil, "CODE_DIGESTS", table)
    nowhere = tmp_path / "no-git-here"
    assert same_kernels("e0ccb07", "fa1cf03", root=nowhere) is True
    assert same_kernels("292cece^", "fa1cf03", root=nowhere) is False
    assert same_kernels("e0ccb07", "a1ae9ed", root=nowhere) is None   # not in the table


def committer(git, path: Path):
    """``commit(text, name)`` for the repository ``git`` runs in (the git fixture, at
    ``path``): writes ssd/<name>, commits it and returns the short hash."""
    (path / "ssd").mkdir()

    def commit(text, name="config.py"):
        (path / "ssd" / name).write_text(text)
        git("add", "-A")
        git("commit", "-qm", text)
        return git("rev-parse", "--short=12", "HEAD")

    return commit


def test_same_kernels_passes_a_shape_commit_for_other_shapes_only(tmp_path, monkeypatch, git):
    """A SHAPE_KERNELS commit stales the recordings of the shapes it changed, with git and from
    the digests' table without it; without dims every shape counts as changed."""
    from ssd import nbutil

    commit = committer(git, tmp_path)
    a = commit("SMALL = None\n")
    b = commit("SMALL = 'a rule for states of at most 64'\n")
    c = commit("SMALL = 'the same rule'\nBIG = 'a change to every shape'\n")
    small, big = (16, 1024, 32, 64, 64, 1), (4, 4096, 80, 64, 128, 1)
    monkeypatch.setattr(nbutil, "SHAPE_KERNELS",
                        {b: ("small states", [small], lambda d: d[4] <= 64)})
    same = lambda *revs, **kw: same_kernels(*revs, root=tmp_path, **kw)  # noqa: E731
    assert same(a, b, dims=[big]) is True and same(a, b, dims=[big, small]) is False
    assert same(a, b) is False                     # without dims, every shape counts as changed
    assert same(b, c, dims=[big]) is False and same(a, c, dims=[big]) is False
    assert nbutil.shape_commits(a, tmp_path) == [] and nbutil.shape_commits(c, tmp_path) == [b]
    table = tmp_path / "code_digests.json"
    revs = (a, b, c)
    table.write_text(json.dumps({
        "digests": {"kernel": {}, "kernels": {r: nbutil.kernels_digest(r, tmp_path) for r in revs}},
        nbutil.SHAPE_COMMITS_KEY: {r: nbutil.shape_commits(r, tmp_path) for r in revs}}))
    monkeypatch.setattr(nbutil, "CODE_DIGESTS", table)
    nowhere = tmp_path / "no-git-here"
    for revs, dims in (((a, b), [big]), ((a, b), [big, small]), ((a, b), None), ((b, c), [big]),
                       ((a, c), [big])):
        assert same_kernels(*revs, root=nowhere, dims=dims) is same(*revs, dims=dims), (revs, dims)


def test_a_merge_is_judged_by_the_commits_it_brings(tmp_path, monkeypatch, git):
    """Merging main into a branch brings main's commits, which the log lists themselves; the merge
    itself, against its first parent, would look like a kernel change (stop 40: 9e1bb6e, main's
    SAME_KERNELS commit merged into the small-state rule's branch, staled every recording)."""
    from ssd import nbutil

    commit = committer(git, tmp_path)
    a = commit("SMALL = None\n")
    git("checkout", "-q", "-b", "branch")
    b = commit("SMALL = 'a rule for states of at most 64'\n")
    git("checkout", "-q", "main")
    m = commit("LAUNCH = 'launch code only'\n", name="_launch.py")
    git("checkout", "-q", "branch")
    git("merge", "-q", "--no-edit", "main")
    merged = git("rev-parse", "--short=12", "HEAD")
    big = (4, 4096, 80, 64, 128, 1)
    monkeypatch.setattr(nbutil, "SHAPE_KERNELS", {b: ("small states", [], lambda d: d[4] <= 64)})
    monkeypatch.setattr(nbutil, "SAME_KERNELS", {m: "launch code only"})
    assert same_kernels(a, merged, root=tmp_path, dims=[big]) is True
    assert nbutil.kernels_digest(a, tmp_path) == nbutil.kernels_digest(merged, tmp_path)
    commit("BIG = 'a change to every shape'\n", name="_launch.py")
    assert same_kernels(a, "HEAD", root=tmp_path, dims=[big]) is False
