"""Chapter 12's tables and figures: which command writes each recording, what each holds, the
environment each names, and how much a timing moves from one repetition, process or machine
to the next.

The recordings are the JSON files the book reads: ``results/<gpu>/*.json`` (the GPU's folder,
``ssd.tools.env.BOOK_GPU`` for the book's own), ``results/compile/*.json`` and any
``results/*.json``.
:func:`load_recordings` loads them all; the other functions take what it returns, the
``Makefile``'s text, or single recordings, and return :class:`ssd.book.tables.Table`
objects or matplotlib figures.
"""
from __future__ import annotations

import datetime
import json
import re
import shlex
from pathlib import Path

from ..tools.env import ROOT, gpu_slug, recording_name
from .recordings import DEFAULT_GPU, RESULTS, gpu_available, load_recorded
from .tables import Table

#: What each recording holds, in a line (a recording not named here shows "-").
HOLDS = {
    "gpu_tests": "GPU test outcomes; each kernel output's error against the float64 reference",
    "gpu_mixer_tests": "the Mamba-2 mixer with each SSD backend against its PyTorch one",
    "gpu_decode_tests": "the decode step's outputs and states against the float64 reference",
    "first-call": "first calls on never-seen shapes: compile seconds per kernel",
    "models": "five model shapes: ours, mamba_ssm, TileGym at three chunk sizes, graph and "
              "eager, L2 flushed and warm; stage times; ceilings",
    "serving": "the models suite's record for short prompts",
    "serving_scenario": "a packed prefill of many prompts, then decoding, per SSD backend: "
                        "time to first token, tokens/s, the SSD's share",
    "robust": "shapes drawn from published Mamba-2 layers, packed or not: ours at chunk 64 "
              "against mamba_ssm's best chunk size, graph and eager, against the suite's goals",
    "backward": "forward + backward, ours and mamba_ssm's at three chunk sizes, TileGym "
                "untuned at 64, graph and eager; extra peak memory",
    "backward_tilegym_tuned": "forward + backward, ours and TileGym's with its autotuner "
                              "searching; its configurations",
    "training": "the recall task trained with each SSD backend: loss and accuracy curves, "
                "step times",
    "training_step": "a training step of the stack per models shape and backend; the SSD's "
                     "share; Amdahl",
    "decode": "the decode step, ours and mamba_ssm's: times, state bandwidth against a copy's",
    "host_profile": "an eager forward's host time by phase (one 512-token prompt), its eager "
                    "and graph times",
    "study": "the layout study: the default and each factor varied around it",
    "endtoend": "a Mamba-2 mixer per model shape, plain and fast layer, and mamba_ssm's "
                "Mamba2 (the SSD's share, the rest's floor, ceilings); prefill stacks",
    "tilegym_replayed": "TileGym's tuned configurations replayed beside ours",
    "primer": "the primer's kernels: compile and launch times",
    "stage1_chunk_cumsum": "stage 1 against the reference; its time",
    "stage2_chunk_state": "stage 2, fused and split, against the reference; its times",
    "stage3_chunk_scan": "stage 3 against the reference; its tile profile",
    "sm_90_resources": "registers, spills, shared memory, compile seconds of the study's "
                       "kernels for sm_90 (no GPU needed)",
    "tilegym_tuned": "the configurations TileGym's tuning chose (what the replay reads)",
}
#: Recordings that no rule of the Makefile writes, and the command that does.
OTHER_WRITERS = {"compile/sm_90_resources.json": "python -m ssd.tools.aot --resources"}
#: The recording each of these tools writes by default (the others' depends on their options).
TOOL_RECORDINGS = {"ssd.tools.decode_bench": "decode", "ssd.tools.serving": "serving_scenario",
                   "ssd.tools.backward_bench": "backward", "ssd.tools.host_profile": "host_profile"}
#: The versions (and driver) an environment record names, as ``ssd.tools.env`` keys them.
VERSIONS = ("driver", "tileiras", "cuda_tile", "torch", "triton", "mamba_ssm", "tilegym",
            "python")
#: cuTile's architectures (compute capability major) with a GPU of each, for the folder name.
ARCHS = {8: ("Ampere", "NVIDIA A100-SXM4-80GB"), 9: ("Hopper", "NVIDIA H100 80GB HBM3"),
         10: ("Blackwell", "NVIDIA B200"), 12: ("Blackwell (GeForce)", "NVIDIA GeForce RTX 5090")}


# ----------------------------------------------------------------------------- the recordings


def book_folder() -> str:
    """The ``results/`` folder the chapters read: this machine's GPU's when it has a GPU
    and a folder of recordings, else the book's (``DEFAULT_GPU``), as ``load_recorded`` does."""
    if gpu_available():
        import torch

        slug = gpu_slug({"gpu": torch.cuda.get_device_name()})
        if (RESULTS / slug).is_dir():
            return slug
    return DEFAULT_GPU


def load_recordings(gpu: str | None = None) -> dict:
    """{path under results/: payload} for every recording the book reads."""
    gpu = gpu or book_folder()
    out = {}
    for path in sorted([*(RESULTS / gpu).glob("*.json"), *(RESULTS / gpu).glob("*.json.gz")]):
        out[f"{gpu}/{path.name}"] = load_recorded(recording_name(path), gpu)
    for pattern in ("compile/*.json", "*.json"):
        for path in sorted(RESULTS.glob(pattern)):
            out[str(path.relative_to(RESULTS))] = json.loads(path.read_text())
    return out


def _stem(name: str) -> str:
    return recording_name(Path(name))


def _entries(payload) -> int:
    """How many records (rows) a recording holds."""
    for key in ("records", "rows"):
        value = payload.get(key)
        if isinstance(value, list):
            return sum(len(t["values"]) if isinstance(t, dict) and "values" in t else 1
                       for t in value)
        if isinstance(value, dict):  # endtoend: parts with rows
            return sum(len(part.get("rows", [])) for part in value.values())
    parts = [v for v in payload.values() if isinstance(v, dict) and "rows" in v]
    if parts:
        return sum(len(p["rows"]) for p in parts)
    return sum(len(v) for v in payload.values() if isinstance(v, dict))


def _env(payload) -> dict:
    return payload.get("environment") or {}


def common_versions(recs) -> dict:
    """{field: the value most recordings name} over :data:`VERSIONS`."""
    from collections import Counter

    envs = [_env(p) for p in recs.values() if _env(p)]
    return {k: Counter(e.get(k) for e in envs).most_common(1)[0][0] for k in VERSIONS}


def environment_table(recs) -> Table:
    """One row per recording that carries an environment record (``ssd.tools.env``): its
    date, git revision and GPU, and the versions in which it differs from
    :func:`common_versions` ("common" where it names them all)."""
    common = common_versions(recs)
    rows = []
    for name, payload in recs.items():
        env = _env(payload)
        if not env:
            continue
        gpu = (env.get("gpu") or "").replace("NVIDIA ", "")
        differ = [f"{k} {env.get(k) or '-'}" for k in VERSIONS if env.get(k) != common[k]]
        rows.append(dict(file=name.removesuffix(".gz").removesuffix(".json"),
                         date=(env.get("date") or "")[:16].replace("T", " ") or None,
                         revision=env.get("git_revision"),
                         gpu=f"{gpu} ({env.get('compute_capability')})" if gpu else None,
                         versions=", ".join(differ) or "common"))
    return Table(rows, dict(file="recording", date="date (UTC)", revision="revision",
                            gpu="GPU (cc)", versions="versions"))


def revisions(recs) -> dict:
    """{git revision: [recordings that name it]} (None: recorded without one)."""
    out = {}
    for name, payload in recs.items():
        if _env(payload):
            out.setdefault(_env(payload).get("git_revision"), []).append(name)
    return out


def span_minutes(recs) -> float:
    """Minutes from the first recording's date to the last one's."""
    dates = [datetime.datetime.fromisoformat(_env(p)["date"]) for p in recs.values()
             if _env(p).get("date")]
    return (max(dates) - min(dates)).total_seconds() / 60 if dates else 0.0


def environment_line(env) -> str:
    """One line saying where a recording was measured."""
    keys = ("gpu", "driver", "tileiras", "cuda_tile", "torch", "triton", "mamba_ssm")
    parts = [f"{k} {env[k]}" for k in keys if env.get(k)]
    return (f"{', '.join(parts)}; revision {env.get('git_revision')}, "
            f"{(env.get('date') or '')[:16].replace('T', ' ')} UTC")


# ----------------------------------------------------------------------------- make gpu


def make_targets(text: str) -> dict:
    """{target: (prerequisites, commands)} of a Makefile's rules (continuation lines
    joined, ``$$`` read as ``$``, simple variables such as ``$(GPU_PYTHON)`` expanded)."""
    text = text.replace("\\\n", " ")
    variables = {m[1]: " ".join(m[2].split()) for m in re.finditer(
        r"^([A-Za-z_][A-Za-z0-9_]*)\s*[?:]?=(?!=)([^$\n]*)$", text, re.MULTILINE)}
    expand = lambda c: re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",  # noqa: E731
                              lambda m: variables.get(m[1], m[0]), c)
    targets, current = {}, None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            targets[current][1].append(expand(" ".join(line.split()).replace("$$", "$")))
            continue
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)(.*)$", line)
        current = None
        if m and not line.startswith("."):
            current = m.group(1)
            targets[current] = (m.group(2).split(), [])
    return targets


def live_recordings(notebooks=None) -> dict:
    """{notebook name: [recordings it measures live]}: the names its code cells pass to
    ``live_or_recorded`` (those it writes when executed on a GPU)."""
    out = {}
    for path in sorted(Path(notebooks or ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        src = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        names = re.findall(r"live_or_recorded\(\s*[\"']([^\"']+)[\"']", src)
        if names:
            out[path.name] = list(dict.fromkeys(names))
    return out


def _results_path(path: str) -> str:
    """An output path of the Makefile as a path under results/, the GPU's folder (a shell
    expression there) as ``<gpu>``; a path outside results/ stays as written."""
    m = re.match(r"results/(.+)/([^/]+)$", path)
    if m:
        return f"<gpu>/{m[2]}" if "$" in m[1] else f"{m[1]}/{m[2]}"
    return path.removeprefix("results/")


def writes(command: str, notebooks=None) -> list:
    """The recordings (paths under results/, ``<gpu>`` for the GPU's folder) a command of
    the Makefile writes."""
    if re.search(r"pytest\b.*\s-m\s+gpu\b", command):
        return ["<gpu>/gpu_tests.json.gz", "<gpu>/gpu_mixer_tests.json.gz",
                "<gpu>/gpu_decode_tests.json.gz", "<gpu>/gpu_backward_tests.json.gz"]
    if m := re.search(r"--out\s+(.*?\.json)", command):
        return [_results_path(m[1])]
    if "--tilegym-table" in command:
        return ["tilegym_tuned.json"]
    argv = command.split()
    opt = lambda name: argv[argv.index(name) + 1] if name in argv[:-1] else None  # noqa: E731
    if "ssd.tools.bench" in argv:
        return [f"<gpu>/{opt('--suite') or 'models'}.json"]
    if "ssd.tools.endtoend" in argv:
        return ["<gpu>/endtoend.json" + (f" ({opt('--only')})" if opt("--only") else "")]
    if "ssd.tools.train" in argv:
        part = argv[argv.index("ssd.tools.train") + 1:][:1]
        return ["<gpu>/training_step.json" if part == ["step"] else "<gpu>/training.json"]
    for tool, name in TOOL_RECORDINGS.items():
        if tool in argv:
            return [f"<gpu>/{name}.json"]
    if "ssd.tools.aot" in argv and "--resources" in argv:
        return ["compile/sm_90_resources.json"]
    if "ssd.book.run" in argv:
        try:
            argv = shlex.split(command)
        except ValueError:
            pass
        live = live_recordings(notebooks)
        pats = [a for a in argv[argv.index("ssd.book.run") + 1:] if not a.startswith("-")]
        hit = [nb for nb in live if any(Path(nb).match(p) for p in pats or ["*.ipynb"])]
        return [f"<gpu>/{n}.json" for nb in hit for n in live[nb]]
    return []


def shown(command: str) -> str:
    """A Makefile command as a reader types it: the interpreter as ``python``, a shell
    expression for the GPU's folder as ``<gpu>``."""
    command = re.sub(r"^python3? ", "python ", command)
    return re.sub(r"\$\([^()]*\)/", "<gpu>/", command)


def gpu_plan(text: str, root_target="gpu", notebooks=None) -> Table:
    """The commands ``make <root_target>`` runs, in order, with the part (sub-target) each
    belongs to and the recordings each writes."""
    targets = make_targets(text)
    rows, done = [], set()

    def walk(name):  # as make does: prerequisites first, each target once
        if name in done:
            return
        done.add(name)
        deps, commands = targets.get(name, ([], []))
        for dep in deps:
            if dep in targets:
                walk(dep)
        for cmd in commands:
            rows.append(dict(part=name, command=cmd, writes=writes(cmd, notebooks)))

    walk(root_target)
    return Table(rows, dict(part="part", command="command", writes="writes"),
                 dict(command=lambda c: f"`{shown(c)}`",
                      writes=lambda w: ", ".join(f"`{x}`" for x in w) or "nothing"))


def writers(text: str, notebooks=None) -> dict:
    """{recording path (``<gpu>/...``): (make target, command)} over every rule of the Makefile."""
    out = {}
    for target, (_, commands) in make_targets(text).items():
        for cmd in commands:
            for w in writes(cmd, notebooks):
                out.setdefault(w.split(" (")[0], (target, cmd))
    return out


def holds_table(recs, makefile_text: str, notebooks=None) -> Table:
    """One row per recording: what it holds, how many records, its size, and what writes it
    (a ``make`` target, or a command of its own: ``OTHER_WRITERS``)."""
    by = writers(makefile_text, notebooks)
    rows = []
    for name, payload in recs.items():
        folder, _, base = name.rpartition("/")
        key = f"<gpu>/{base}" if folder not in ("", "compile") else name
        target = by.get(key, (None,))[0]
        kb = (RESULTS / name).stat().st_size / 1024 if (RESULTS / name).is_file() else None
        rows.append(dict(file=name, holds=HOLDS.get(_stem(name), "-"), entries=_entries(payload),
                         kb=kb, writer=f"make {target}" if target else OTHER_WRITERS.get(name)))
    return Table(rows, dict(file="recording", writer="written by", entries="records", kb="KB",
                            holds="what it holds"), dict(kb="{:.0f}"))


# ----------------------------------------------------------------------------- variation


def _timings(payload, mode="graph", l2="flushed") -> dict:
    """{(shape, chunk): record} of ours' timings in a suite recording (records) or a study
    (its rows at the default point)."""
    out = {}
    if "records" in payload:
        for r in payload["records"]:
            if r["impl"] == "ssd" and r["mode"] == mode and r["l2"] == l2:
                out[(r["shape"], r["chunk_size"])] = r
    else:
        for r in payload.get("rows", []):
            if r.get("factor") == "default":
                out[(r["shape"], r["chunk_size"])] = r
    return out


def _pct2(v) -> str:
    return f"{100 * v:.2f}\u00a0%"


def spread_table(models, mode="graph") -> Table:
    """Within one recording: the spread of the repetitions of each timing, the 20-80 %
    quantile band over the median, per implementation and L2 condition."""
    groups = {}
    for r in models["records"]:
        if r["mode"] == mode:
            groups.setdefault((r["impl"], r["l2"]), []).append(
                (r["q80_ms"] - r["q20_ms"]) / r["median_ms"])
    rows = []
    for (impl, l2), bands in sorted(groups.items()):
        bands.sort()
        rows.append(dict(impl=impl, l2=l2, n=len(bands), median=bands[len(bands) // 2],
                         worst=bands[-1]))
    return Table(rows, dict(impl="implementation", l2="L2", n="timings",
                            median="median band", worst="widest band"),
                 dict(median=_pct2, worst=_pct2))


def rerun_table(reference, others: dict) -> Table:
    """Across processes: ours' median time of each (shape, chunk) in other recordings over the
    reference's (the same code, timed again in another process), with the reference's own
    20-80 % band for scale."""
    ref = _timings(reference)
    rows = []
    for name, payload in others.items():
        for key, r in sorted(_timings(payload).items()):
            if key in ref:
                base = ref[key]
                rows.append(dict(recording=name, shape=key[0], chunk=key[1],
                                 ref_ms=base["median_ms"], ms=r["median_ms"],
                                 ratio=r["median_ms"] / base["median_ms"],
                                 band=(base["q80_ms"] - base["q20_ms"]) / base["median_ms"]))
    return Table(rows, dict(recording="recording", shape="shape", chunk="chunk",
                            ref_ms="reference ms", ms="ms", ratio="ratio", band="reference band"),
                 dict(ref_ms="{:.4f}", ms="{:.4f}", ratio="{:.4f}",
                      band=_pct2))


def plot_reruns(table: Table):
    """Each re-timing's ratio to the reference, in %, per shape and chunk size, over the
    reference's 20-80 % band (grey)."""
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["shape"], r["chunk"]) for r in table))
    x = {k: i for i, k in enumerate(keys)}
    band = {(r["shape"], r["chunk"]): r["band"] for r in table}
    fig, ax = plt.subplots(figsize=(7, 2.8), dpi=90)
    for k in keys:
        h = 100 * band[k] / 2
        ax.fill_between([x[k] - 0.35, x[k] + 0.35], -h, h, color="0.85", lw=0)
    for i, name in enumerate(dict.fromkeys(table.column("recording"))):
        pts = [r for r in table if r["recording"] == name]
        ax.scatter([x[(r["shape"], r["chunk"])] for r in pts],
                   [100 * (r["ratio"] - 1) for r in pts], color=f"C{i}", s=18, zorder=3,
                   label=name)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(keys)), [f"{s} q{q}" for s, q in keys], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("re-timed / reference - 1 (%)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Ours timed again in another process (grey: the reference's 20-80 % band)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def compare_recordings(a, b, impl="ssd", over="mamba_ssm", mode="graph", l2="flushed") -> Table:
    """Two suite recordings side by side (yours and the book's, say): per shape, ``impl``'s
    time at its fastest chunk size in each, their ratio, and ``impl``'s speedup over ``over``
    in each where both hold ``over`` (ratios within one file travel between machines; raw
    milliseconds do not)."""
    from ..tools.bench import best_records

    rows = []
    ba, bb = best_records(a["records"], impl, mode, l2), best_records(b["records"], impl, mode, l2)
    oa, ob = best_records(a["records"], over, mode, l2), best_records(b["records"], over, mode, l2)
    for shape in ba:
        if shape not in bb:
            continue
        ra, rb = ba[shape], bb[shape]
        over_a, over_b = oa.get(shape), ob.get(shape)
        rows.append(dict(shape=shape, a_ms=ra["median_ms"], b_ms=rb["median_ms"],
                         ratio=rb["median_ms"] / ra["median_ms"],
                         a_speedup=over_a and over_a["median_ms"] / ra["median_ms"],
                         b_speedup=over_b and over_b["median_ms"] / rb["median_ms"]))
    return Table(rows, dict(shape="shape", a_ms="a ms", b_ms="b ms", ratio="b / a",
                            a_speedup=f"a: x {over}", b_speedup=f"b: x {over}"),
                 dict(a_ms="{:.4f}", b_ms="{:.4f}", ratio="{:.3f}", a_speedup="{:.2f}x",
                      b_speedup="{:.2f}x"))


# ----------------------------------------------------------------------------- your GPU


def gpu_support() -> Table:
    """Per architecture cuTile compiles for: the oldest tileiras that targets it (what the
    doctor checks), whether the defaults' tuned rules apply (``ssd.config.MEASURED_ARCHS``),
    and the results folder an example GPU's recordings go to (``ssd.tools.env.gpu_slug``)."""
    from ..config import MEASURED_ARCHS
    from ..tools.doctor import MIN_TILEIRAS

    rows = []
    for major, (arch, example) in ARCHS.items():
        mm = MIN_TILEIRAS.get(major)
        rows.append(dict(cc=f"{major}.x", arch=arch, tileiras=mm and "%d.%d" % mm,
                         tuned="tuned rules, timed" if major in MEASURED_ARCHS
                         else "base default, not timed",
                         example=example, folder=f"results/{gpu_slug({'gpu': example})}/"))
    return Table(rows, dict(cc="compute capability", arch="architecture",
                            tileiras="tileiras at least", tuned="defaults",
                            example="e.g.", folder="recordings go to"))


__all__ = ["HOLDS", "book_folder", "load_recordings", "common_versions", "environment_table",
           "revisions", "span_minutes", "environment_line", "make_targets", "live_recordings",
           "writes", "shown", "gpu_plan", "writers", "holds_table", "spread_table", "rerun_table",
           "plot_reruns", "compare_recordings", "gpu_support"]
