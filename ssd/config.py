"""Tile sizes and layout choices for the cuTile SSD forward, as small frozen config objects.

One :class:`SSDConfig` travels from the public API to every stage launcher. Defaults come
from :func:`default_config`, which picks per GPU architecture:

* ``sm_90`` (Hopper, H100/H200): tuned on an H200 and recorded on an H100 (see the Performance
  chapters, 09 and 10; the numbers behind each choice are in ``results/h100/``).
* ``sm_100`` / ``sm_120`` (Blackwell) and ``sm_80`` (Ampere): the same tiles, **not measured**;
  they compile (CI exports every kernel for sm_80/sm_90/sm_100) but were never timed.

All tile sizes must be powers of two (a cuTile requirement); chunk_size must be a power of two
too, because each chunk is one tile along the sequence axis.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

#: What the kernels take: chunk sizes (powers of two: a chunk is one tile) and the largest
#: state (a block holds a state slice of up to this many columns).
CHUNK_SIZES = (16, 32, 64, 128, 256)
MAX_DSTATE = 256


def _check_pow2(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}: expected a positive power of two, got {value!r}")


@dataclass(frozen=True)
class CumsumConfig:
    """Stage 1 (chunk_cumsum): one block per (batch, chunk, ``block_h`` heads)."""

    block_h: int = 8

    def __post_init__(self):
        _check_pow2("block_h", self.block_h)


STATE_DTYPES = ("input", "float32", "bfloat16", "float16")


def _check_hints(config) -> None:
    """The compiler hints: None leaves the choice to the compiler."""
    for name, ok, expected in (
            ("occupancy", lambda v: 1 <= v <= 32, "1..32"),
            ("latency", lambda v: 1 <= v <= 10, "1..10"),
            ("warps", lambda v: v in (4, 8), "4 or 8")):
        value = getattr(config, name, None)  # a config may lack a hint (FusedScanConfig)
        if value is not None and not (isinstance(value, int) and ok(value)):
            raise ValueError(f"{name}: expected None (compiler's choice) or {expected}, "
                             f"got {value!r}")


@dataclass(frozen=True)
class StateConfig:
    """Stage 2 (chunk_state + state_passing). A block owns a ``block_p`` x ``block_n`` slice
    of one head's state and reads its chunk ``block_k`` positions at a time (the K loop of
    x_cᵀ (w B_c)). Slicing the state dimension n as well as p multiplies the number of
    blocks, which is what the fused kernel's sequential walk over chunks needs to fill the GPU.

    fused: one kernel walks the chunks of a (batch, head, ``block_p`` slice) in order, computing
        each chunk's state on chip and carrying the running state in registers (the per-chunk
        states never reach memory). Split: chunk_state writes every chunk's state, then
        state_passing scans them; more parallel, one extra round trip of the states.
    state_dtype: dtype of the entering states that stage 3 reads: "input" (x's dtype, what
        mamba_ssm stores), "float32" or "bfloat16"; the running sum is always fp32.
    occupancy: compiler hint, expected resident blocks per SM (None: the compiler's choice).
    latency: compiler hint on the streamed loads of x and B, how heavy their DRAM traffic is
        (1 low ... 10 high; None: inferred by the compiler).
    warps: worker warps of a warp-specialised kernel (``num_worker_warps``: 4 or 8; None: the
        compiler's choice).
    transposed: the fused walk keeps its state slice transposed, [block_n, block_p], with the
        MMA (w B)ᵀ x (TileGym's tuned state kernel does); memory layouts unchanged.
    groups: the fused walk's chunks cut into this many runs of consecutive chunks, each walked
        by blocks of its own from a zero state (b x h x slices x groups blocks, each walking
        1/groups of the chunks); a small second kernel carries the state from group to group
        and chunk_scan adds each group's entering state, decayed to the chunk, to the state
        stage 2 stored. For few sequences, where the walk is one long chain per head.
    """

    block_p: int = 64
    block_n: int = 64
    block_k: int = 64
    fused: bool = True  # per-chunk states never reach memory [fig-fused-stage2]
    state_dtype: str = "input"
    occupancy: int | None = 4
    latency: int | None = None
    warps: int | None = None
    transposed: bool = True
    groups: int = 1

    def __post_init__(self):
        for name in ("block_p", "block_n", "block_k"):
            _check_pow2(name, getattr(self, name))
        _check_hints(self)
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups: expected a positive int, got {self.groups!r}")
        if self.groups > 1 and not self.fused:
            raise ValueError("groups: chunk groups need the fused stage 2 (fused=True)")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: expected one of {STATE_DTYPES}, got {self.state_dtype!r}")

    def slices(self, headdim: int, dstate: int) -> tuple[int, int, int]:
        """The stage-2 kernels' split of one head's (headdim x dstate) state: (block_n clamped
        to the state, n_tiles = cdiv(dstate, block_n), slices = cdiv(headdim, block_p) *
        n_tiles), slices being the blocks per (batch, head) of the fused walk (its grid is
        (b, h, slices)) and per (batch, chunk, head) of the split chunk_state."""
        block_n = min(self.block_n, next_pow2(dstate))
        n_tiles = -(-dstate // block_n)
        return block_n, n_tiles, -(-headdim // self.block_p) * n_tiles

    def storage_dtype(self, input_dtype) -> str:
        """The entering states' dtype name for inputs of dtype ``input_dtype`` (a name such as
        "bfloat16", or a torch dtype)."""
        if self.state_dtype != "input":
            return self.state_dtype
        return str(input_dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ScanConfig:
    """Stage 3 (chunk_scan): a block owns ``block_m`` output rows of one chunk and ``block_p``
    channels of ``block_h`` heads of one group (they share the C Bᵀ tile), and walks the
    chunk's causal prefix ``block_s`` columns at a time. The hints ``occupancy``, ``latency``
    (on the streamed loads of B and x) and ``warps`` as in StateConfig. ``persistent``: launch
    occupancy x SMs blocks that loop over the output tiles instead of one block per tile.
    ``whole_chunk`` (persistent only): a tile is every row block of one chunk, walked in a
    static loop, so that each row block's column walk has a constant trip count.
    ``shared`` (whole_chunk only): where every chunk is full, the tile's ``block_h`` heads are
    walked one after another and each of its tiles of C, B, x and the entering states is loaded
    once (C and B once for all its heads); otherwise the row blocks reload what they share and
    the heads sit side by side, as in the other tiles."""

    block_h: int = 2
    block_m: int = 64
    block_s: int = 64
    block_p: int = 64
    occupancy: int | None = 3
    latency: int | None = None
    warps: int | None = None
    persistent: bool = True
    whole_chunk: bool = False
    shared: bool = False

    def __post_init__(self):
        if self.whole_chunk and not self.persistent:
            raise ValueError("whole_chunk: needs the persistent grid (persistent=True)")
        if self.shared and not self.whole_chunk:
            raise ValueError("shared: needs whole-chunk tiles (whole_chunk=True)")
        for name in ("block_h", "block_m", "block_s", "block_p"):
            _check_pow2(name, getattr(self, name))
        _check_hints(self)
        if self.block_m % self.block_s:
            raise ValueError(f"block_s: must divide block_m={self.block_m}, got {self.block_s}")


# fp32 operands take twice the registers of 16-bit ones: at chunk 256 (p 64, n 128) on sm_90 the
# chunk_scan backward's rows kernel spills 13 KB a thread with 64-row tiles and compiles in 27 s
# (263 s at p 128, n 256); with 32-row tiles it spills 3 KB and compiles in 6 s (ssd.tools.aot,
# cuobjdump of the cubins).
SCAN_BACKWARD_FP32_TILE = 32


def _check_splits(config):
    if config.head_splits is not None and config.head_splits < 1:
        raise ValueError(f"head_splits: expected None or a positive int, got {config.head_splits}")


#: The blocks a SM that the backward's kernels summing over a group's heads aim for (two waves
#: of two resident blocks), so that the latency of a block's walk over its heads is hidden.
#: Untimed.
BACKWARD_BLOCKS_PER_SM = 4


def head_splits(blocks: int, heads_per_group: int, sms: int, requested: int | None = None) -> int:
    """The ``head_splits`` of ScanBackwardConfig and StateBackwardConfig a launch takes:
    ``requested`` (the config's) where given, else the fewest splits of a group's heads (a
    divisor of ``heads_per_group``) that give a grid of ``blocks`` blocks a split at least
    BACKWARD_BLOCKS_PER_SM blocks a SM on ``sms`` SMs, or one head a block. With one group and
    few chunks (2.7b: 256 blocks for 80 heads) one split would leave 132 SMs two blocks each,
    each walking 80 heads. Raises ValueError where ``requested`` does not divide
    ``heads_per_group``."""
    if requested is not None:
        if heads_per_group % requested:
            raise ValueError(f"head_splits={requested} must divide the heads per group "
                             f"({heads_per_group})")
        return requested
    for splits in range(1, heads_per_group + 1):
        if heads_per_group % splits == 0 and blocks * splits >= BACKWARD_BLOCKS_PER_SM * sms:
            return splits
    return heads_per_group


@dataclass(frozen=True)
class ScanBackwardConfig:
    """chunk_scan's backward (:mod:`ssd.kernels.chunk_scan_backward`). Its two diagonal-block
    kernels cut a chunk into square ``block_q`` x ``block_q`` tiles (rows t, columns s: the
    diagonal tile of row block i is column block i), and a block owns one row block or one column
    block of one chunk for ``heads_per_group / head_splits`` heads of one group. The entering
    states' gradient, a chunk_state of (dy, C), reads ``block_k`` positions a step and owns
    ``block_n`` state columns a block. ``occupancy`` and ``warps`` as in StateConfig and
    ScanConfig. ``head_splits`` (a divisor of the heads per group; None: :func:`head_splits`'
    rule) cuts each group's heads into that many blocks, whose partial dB and dC are summed
    after the kernels. ``rows_block_q`` (None: ``block_q``) gives the rows kernel tiles of its
    own: it completes the column part of ddA_cumsum position by position, so the two tilings
    need not match. Defaults: 64-wide tiles, 4 warps and two blocks a SM (the hint), the
    fastest point, or within 1 %, of ``python -m ssd.tools.backward_stages`` at chunk 64 on
    sm_90 over 4 and 8 warps and hints 2 and 4 on every models shape (1 to 4 on 2.7b, folded
    too): without the hint the compiler gives a block 255 registers and one block a SM, which
    leaves the SM idle while it waits on memory. There (bf16, p 64, n 128) both kernels compile
    to 128 registers without spilling; with chunk_state's backward folded in, columns spills 80
    bytes a thread and rows 8 (``ssd.tools.aot.resource_usage``). fp32 inputs take smaller
    tiles (:meth:`for_problem`). ``dprev_in_walk``: the entering states' gradient is not formed here
    but where state_passing's backward walk consumes it (``ssd.backward.EnteringGradient``), so
    that its (b, c, h, p, n) fp32 tensor never reaches memory, as the forward's fused stage 2
    keeps the per-chunk states out of memory; ``block_k`` and ``block_n`` then go unused."""

    block_q: int = 64
    block_k: int = 64
    block_n: int = 64
    occupancy: int | None = 2
    head_splits: int | None = None
    warps: int | None = 4
    rows_block_q: int | None = None
    dprev_in_walk: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_n"):
            _check_pow2(name, getattr(self, name))
        if self.rows_block_q is not None:
            _check_pow2("rows_block_q", self.rows_block_q)
        _check_hints(self)
        _check_splits(self)

    def for_problem(self, chunk_size: int, dstate: int, input_dtype=None) -> "ScanBackwardConfig":
        """The tiles clamped to the chunk (``block_q``, ``block_k``) and to the state padded to a
        power of two (``block_n``); for fp32 inputs (``input_dtype``: a name such as "float32",
        or a torch dtype) to SCAN_BACKWARD_FP32_TILE as well."""
        fp32 = str(input_dtype).removeprefix("torch.") == "float32"
        cap = lambda block: min(block, SCAN_BACKWARD_FP32_TILE) if fp32 else block  # noqa: E731
        return replace(self, block_q=cap(min(self.block_q, chunk_size)),
                       block_k=cap(min(self.block_k, chunk_size)),
                       block_n=cap(min(self.block_n, next_pow2(dstate))),
                       rows_block_q=cap(min(self.rows_block_q or self.block_q, chunk_size)))


@dataclass(frozen=True)
class FusedScanConfig:
    """Stages 2 and 3 in one kernel (:mod:`ssd.kernels.fused_scan`): where ``enabled``, one block per
    (batch, head, ``block_p`` channels) walks its sequence's chunks and writes their output rows
    from the entering state it holds, which is never stored; ``state`` and ``scan`` are then
    unused (except with seq_idx, which takes the three stages). ``occupancy`` as in
    StateConfig."""

    enabled: bool = False
    block_p: int = 64
    occupancy: int | None = 2

    def __post_init__(self):
        _check_pow2("block_p", self.block_p)
        _check_hints(self)


@dataclass(frozen=True)
class StateUpdateConfig:
    """The decode step (:mod:`ssd.kernels.state_update`): one block per (batch entry, head,
    ``block_p`` channels) holds that slice of the state with its whole width n, reads it once and
    writes it once. ``block_p`` None: :func:`state_update_config` picks it per problem.
    ``occupancy`` as in StateConfig; without it the compiler gives each block all of a SM's
    registers (255 a thread), one resident block of a kernel that needs many in flight."""

    block_p: int | None = None
    occupancy: int | None = 4

    def __post_init__(self):
        if self.block_p is not None:
            _check_pow2("block_p", self.block_p)
        _check_hints(self)


@dataclass(frozen=True)
class SSDConfig:
    cumsum: CumsumConfig = field(default_factory=CumsumConfig)
    state: StateConfig = field(default_factory=StateConfig)
    scan: ScanConfig = field(default_factory=ScanConfig)
    fused_scan: FusedScanConfig = field(default_factory=FusedScanConfig)

    @classmethod
    def from_dict(cls, record: dict) -> "SSDConfig":
        """The configuration a recording's ``config`` (``dataclasses.asdict`` of one) describes.
        A field the record lacks was added after it was made and takes its default: new knobs
        default to the behaviour that existed before them, so the record still means what it
        meant. An unknown field raises (TypeError)."""
        return cls(**{f.name: f.default_factory().__class__(**record.get(f.name, {}))
                      for f in fields(cls)})

    def for_problem(self, chunk_size: int, headdim: int, dstate: int, heads_per_group: int,
                    input_dtype=None) -> "SSDConfig":
        """Clamp tiles that would exceed the problem (a tile longer than the chunk, the head or
        the state), shrink chunk_scan's head block to a power of two dividing the heads per
        group (a block's heads must share one group; one head where the compiler cannot schedule
        more, see below), and, given the inputs' dtype (a name such as "bfloat16", or a torch
        dtype), resolve ``state_dtype="input"`` to it."""
        p = next_pow2(headdim)
        block_h = self.scan.block_h
        while heads_per_group % block_h:
            block_h //= 2
        block_m = min(self.scan.block_m, chunk_size)
        block_s = min(self.scan.block_s, chunk_size, self.scan.block_m)
        block_p = min(self.scan.block_p, p)
        if block_s == block_m < 64 and block_p > block_m:
            # tileiras 13.4 cannot schedule chunk_scan with two or more heads here (one diagonal
            # tile of fewer than 64 rows, narrower than the channel slice; 16-bit inputs on
            # sm_90 and sm_100, and on sm_80 with the persistent grid): "Invalid use-def chain in
            # schedule". Below 64 rows no MMA is a wgmma, so one head per block loses little.
            # tests/test_aot.py compiles the corner.
            block_h = 1
        scan = replace(self.scan, block_h=block_h, block_m=block_m, block_s=block_s,
                       block_p=block_p)
        state = replace(self.state, block_p=min(self.state.block_p, p),
                        block_n=min(self.state.block_n, next_pow2(dstate)))
        if input_dtype is not None:
            state = replace(state, state_dtype=state.storage_dtype(input_dtype))
        fused_scan = replace(self.fused_scan, block_p=min(self.fused_scan.block_p, p))
        return replace(self, scan=scan, state=state, fused_scan=fused_scan)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tile extents must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


# --- the layer's other kernels (ssd.layer_ops); untimed defaults, compile-checked on sm_90 ---


@dataclass(frozen=True)
class Conv1dConfig:
    """The layer's causal conv1d (:mod:`ssd.kernels.causal_conv1d`): one block per (``block_c``
    channels, ``block_l`` positions, batch row). A block gathers its rows once a tap (the repeats
    meant to hit the L1 cache) plus the width-1 rows before them, so longer blocks reread fewer
    rows. At 64 x 64 the width-4 kernel compiles for sm_90 to 128 registers a thread and no
    shared memory (64 x 128: 196 registers); neither is timed yet. The backward's blocks
    (``backward_block_l`` x ``backward_block_c``) recompute w preactivations a position, w taps
    each: at 64 x 64 that kernel spilled 0.9-2.1 KB of stack a thread on sm_90 (2.1 with seq_idx
    and an initial state), at 32 x 32 none."""

    block_l: int = 64
    block_c: int = 64
    backward_block_l: int = 32
    backward_block_c: int = 32

    def __post_init__(self):
        for name in ("block_l", "block_c", "backward_block_l", "backward_block_c"):
            _check_pow2(name, getattr(self, name))


@dataclass(frozen=True)
class ConvStepConfig:
    """The conv's decode step (:mod:`ssd.kernels.conv_step`): one block per (``block_c``
    channels, batch entry), each of the w window columns a [block_c] tile. A step moves a few
    bytes a channel: 256 channels a block spread a batch of one over 21 blocks at the 2.7b
    layer's 5376 channels, and keep the grid at 5376 blocks at batch 256. The width-4 kernel
    compiles for sm_90 to 38 registers a thread and no shared memory. Untimed."""

    block_c: int = 256

    def __post_init__(self):
        _check_pow2("block_c", self.block_c)


@dataclass(frozen=True)
class GatedNormConfig:
    """The layer's gated RMSNorm (:mod:`ssd.kernels.gated_rmsnorm`): a block holds whole groups
    (the group padded to a power of two) of as many rows as make about ``block_elems`` values,
    at least one row: a group's sum of squares never leaves the block, so y and z are read
    once. Untimed."""

    block_elems: int = 4096

    def __post_init__(self):
        _check_pow2("block_elems", self.block_elems)

    def block_rows(self, rows: int, group_size: int) -> int:
        """Rows a block takes for ``rows`` rows of groups of ``group_size`` channels."""
        return max(1, min(self.block_elems // next_pow2(group_size), next_pow2(rows)))


# --- the backward's stage kernels (ssd.kernels.<stage>_backward); untimed defaults ---


@dataclass(frozen=True)
class CumsumBackwardConfig:
    """chunk_cumsum's backward (:mod:`ssd.kernels.chunk_cumsum_backward`): one block per
    (batch, chunk, ``block_h`` heads), as the forward; the second pass sums the per-chunk parts
    of dA and ddt_bias ``block_rows`` chunks at a time."""

    block_h: int = 8
    block_rows: int = 64

    def __post_init__(self):
        _check_pow2("block_h", self.block_h)
        _check_pow2("block_rows", self.block_rows)


@dataclass(frozen=True)
class StateBackwardConfig:
    """chunk_state's backward (:mod:`ssd.kernels.chunk_state_backward`): a block walks one
    chunk ``block_s`` positions at a time, its products over ``block_p`` channels and
    ``block_n`` state entries a tile (both clamped to the problem); dB's blocks walk one of
    ``head_splits`` runs of a group's heads (as in ScanBackwardConfig). These kernels run only
    where chunk_state's backward is not folded into chunk_scan's (``cutile_backwards(fold=False)``).
    ``occupancy``: both kernels' hint, as in StateConfig (None: the compiler's choice, which on
    sm_90 takes 255 registers and one block a SM for these many small blocks). Defaults: 32 x 32
    state tiles at four blocks a SM, within a few per cent of the fastest tiling at chunk 64 on
    sm_90 (``python -m ssd.tools.backward_stages --dprev walk --state-tiles``); at the hint's 64
    registers the dx kernel spills under 128 bytes a thread (bf16, p 64, n 128, chunk 256).
    fp32 inputs, whose MMAs run on CUDA cores, spill 2.7 KB a thread in the dx kernel even
    without the hint."""

    block_s: int = 64
    block_p: int = 32
    block_n: int = 32
    head_splits: int | None = None
    occupancy: int | None = 4

    def __post_init__(self):
        for name in ("block_s", "block_p", "block_n"):
            _check_pow2(name, getattr(self, name))
        _check_splits(self)
        _check_hints(self)


@dataclass(frozen=True)
class PassingBackwardConfig:
    """state_passing's backward (:mod:`ssd.kernels.state_passing_backward`): a block owns a
    ``block_p`` x ``block_n`` slice of one head's state gradient (clamped to the problem) and
    walks the chunks from last to first, as the forward's walk does from first to last.
    ``occupancy``: the walk's hint, as in StateConfig (None: the compiler's choice, which on
    sm_90 takes 255 registers and one or two blocks a SM). Default: 64 x 64 slices at two
    blocks a SM, the fastest point of ``python -m ssd.tools.backward_stages --passing-tiles`` on
    four of the five models shapes on sm_90 (130m: 32 x 64, 10 % faster)."""

    block_p: int = 64
    block_n: int = 64
    occupancy: int | None = 2

    def __post_init__(self):
        _check_pow2("block_p", self.block_p)
        _check_pow2("block_n", self.block_n)
        _check_hints(self)


# Per-architecture defaults, keyed by compute-capability major. Only 9 (Hopper) is measured.
_DEFAULTS = {
    9: SSDConfig(),
}
MEASURED_ARCHS = (9,)


# The default rules. Each one names the figure of chapter 9 (notebooks/09_layout_tiling) that
# measures it, or says where else it is shown; tests/test_config.py pins each rule's bounds and
# tests/test_aot.py the compile resources (registers, shared memory, no spill on sm_90) that make
# its occupancy hint hold.

# Stage 2's fused walk fills the GPU with its (b, h, state slices) blocks; below this many blocks
# a SM, narrower untransposed slices double the blocks. [fig-state-slicing]
MIN_STAGE2_BLOCKS_PER_SM = 2
NARROW_STATE = dict(block_n=32, transposed=False)

# At chunk 64, a stage-2 grid that needs a second wave of resident blocks but fits in one with
# whole states (up to 128 wide, 32 positions a K step, three a SM) takes those. [fig-state-slicing]
ONE_WAVE_STATE = dict(block_n=128, block_k=32, occupancy=3, transposed=True)
ONE_WAVE_CHUNK = 64

# chunk_scan at chunk 64: whole-chunk tiles of one head, each tile loaded once, two blocks a SM;
# one head keeps a never-seen shape's first compile in seconds. [fig-scan-tiles, fig-occupancy]
CHUNK64_SCAN = dict(block_h=1, occupancy=2, whole_chunk=True, shared=True)
CHUNK64 = 64

# States of at most SMALL_STATE: whole-chunk chunk_scan tiles of one head, loaded once; at chunk
# 128 two blocks a SM, at 256 back to 64-row tiles (the whole chunk spills there). [chapter 10:
# small-state's chunk sizes; no study shape has so small a state]
SMALL_STATE = 64
SMALL_STATE_SCAN = dict(block_h=1, whole_chunk=True, shared=True)
SMALL_STATE_AT = {128: dict(occupancy=2), 256: dict(whole_chunk=False, shared=False)}

# Few long sequences at chunk 64 (too few stage-2 blocks): whole states walked in GROUPED_WALK
# runs of chunks at once, where those fit in one wave and the sequence spans at least
# GROUPED_MIN_CHUNKS chunks; shorter walks lose to the group kernel's extra work. [chapter 6
# derives it; chapter 10 times long-16k, the models shape that takes it, against the peers]
GROUPED_WALK = 4
GROUPED_MIN_CHUNKS = 128

# Stages 2 and 3 as one kernel at chunk 64 where its b x h blocks (two a SM) fill at least
# FUSED_SCAN_MIN_FILL of the resident slots of at most FUSED_SCAN_MAX_WAVES waves: each block
# walks a whole sequence, so a part-empty wave costs a whole walk. [fig-one-kernel]
FUSED_SCAN_CHUNK = 64
FUSED_SCAN_MAX_STATE = 128
FUSED_SCAN_MIN_FILL = 2 / 3
FUSED_SCAN_MAX_WAVES = 2


def default_config(capability: tuple[int, int] | None = None,
                   problem: tuple[int, int, int, int] | None = None,
                   sms: int | None = None, chunk_size: int | None = None,
                   seqlen: int | None = None, stores_states: bool = False) -> SSDConfig:
    """Default config for a GPU of compute capability ``capability`` (None: the current GPU,
    or the sm_90 default when there is none). Given the ``problem``'s (batch, heads, headdim,
    dstate) and the GPU's ``sms``, a problem whose fused stage 2 would have fewer than
    ``MIN_STAGE2_BLOCKS_PER_SM`` blocks per SM (few sequences, few heads) gets, on sm_90 at
    ``chunk_size`` ``ONE_WAVE_CHUNK`` for a state wider than ``SMALL_STATE``, whole states walked
    in ``GROUPED_WALK`` groups of chunks where those fit in one wave and the ``seqlen`` spans
    ``GROUPED_MIN_CHUNKS`` chunks or more, else narrower state slices;
    on sm_90 at ``chunk_size`` ``ONE_WAVE_CHUNK``, one whose stage-2 grid would need more
    than one wave of resident blocks and fits in one with ``ONE_WAVE_STATE`` gets those; and given
    the ``problem``, a state of at most ``SMALL_STATE`` gets whole-chunk chunk_scan tiles of
    one head, each tile loaded once (on sm_90 at chunk 128 with the hint of 2, at 256 64-row tiles
    instead: ``SMALL_STATE_AT``); on sm_90 at ``chunk_size`` ``CHUNK64``, the other problems'
    chunk_scan gets the whole-chunk tiles (loaded once) and occupancy hint of ``CHUNK64_SCAN``;
    and on sm_90 at ``FUSED_SCAN_CHUNK``, a problem whose one-kernel stages 2 and 3 fill the
    GPU (:func:`fused_scan_fills`) gets those (the three stages stay configured for seq_idx):
    the Performance chapters measure them on the model shapes. ``stores_states`` (a forward whose
    backward reads every chunk's entering state: ``ssd.autograd``) takes neither the grouped walk
    nor the one-kernel stages 2 and 3, which keep those states out of memory: the backward would
    rebuild them in PyTorch, at several times what their kernels save the forward."""
    if capability is None:
        try:
            import torch

            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
        except ImportError:
            capability = (9, 0)
    config = _DEFAULTS.get(capability[0], _DEFAULTS[9])
    if problem is not None:
        b, h, p, n = problem
        blocks = b * h * config.state.slices(p, n)[2]
        one_wave = replace(config.state, **ONE_WAVE_STATE)
        # whole states in groups: measured for 128-wide states only (long-16k)
        grouped = (not stores_states and sms and chunk_size == ONE_WAVE_CHUNK
                   and capability[0] in MEASURED_ARCHS and seqlen is not None
                   and -(-seqlen // chunk_size) >= GROUPED_MIN_CHUNKS
                   and config.state.occupancy and SMALL_STATE < n <= one_wave.block_n
                   and b * h * one_wave.slices(p, n)[2] * GROUPED_WALK <= one_wave.occupancy * sms)
        if sms and blocks < MIN_STAGE2_BLOCKS_PER_SM * sms and grouped:
            config = replace(config, state=replace(one_wave, groups=GROUPED_WALK))
        elif sms and blocks < MIN_STAGE2_BLOCKS_PER_SM * sms:
            config = replace(config, state=replace(config.state, **NARROW_STATE))
        elif (sms and chunk_size == ONE_WAVE_CHUNK and capability[0] in MEASURED_ARCHS
              and config.state.occupancy and blocks > config.state.occupancy * sms):
            if n <= one_wave.block_n and b * h * one_wave.slices(p, n)[2] <= one_wave.occupancy * sms:
                config = replace(config, state=one_wave)
        if n <= SMALL_STATE:
            at = SMALL_STATE_AT.get(chunk_size, {}) if capability[0] in MEASURED_ARCHS else {}
            config = replace(config, scan=replace(config.scan, **{**SMALL_STATE_SCAN, **at}))
    if (chunk_size == CHUNK64 and capability[0] in MEASURED_ARCHS and config.scan.occupancy
            and not config.scan.whole_chunk):
        config = replace(config, scan=replace(config.scan, **CHUNK64_SCAN))
    if problem is not None and sms and not stores_states and fused_scan_fills(
            config.fused_scan, problem, sms) and (
            chunk_size == FUSED_SCAN_CHUNK and capability[0] in MEASURED_ARCHS):
        config = replace(config, fused_scan=replace(config.fused_scan, enabled=True))
    return config


def fused_scan_fills(fused_scan: FusedScanConfig, problem: tuple[int, int, int, int],
                     sms: int) -> bool:
    """Whether the one-kernel stages 2 and 3 suit the (batch, heads, headdim, dstate)
    ``problem`` on ``sms`` SMs: a state of at most FUSED_SCAN_MAX_STATE, one channel block a
    head, and a grid that fills FUSED_SCAN_MIN_FILL of the resident slots of its waves (at most
    FUSED_SCAN_MAX_WAVES), the hint's blocks a SM."""
    b, h, p, n = problem
    if not fused_scan.occupancy or n > FUSED_SCAN_MAX_STATE or p > fused_scan.block_p:
        return False
    slots = fused_scan.occupancy * sms
    waves = -(-b * h // slots)
    return waves <= FUSED_SCAN_MAX_WAVES and b * h >= FUSED_SCAN_MIN_FILL * waves * slots


# The decode step moves each state once each way and does little else, so its time is the state
# traffic over the bandwidth it reaches; that needs bytes in flight on every SM. A block's state
# slice is STATE_UPDATE_TILE_BYTES (block_p channels of the whole width n), narrowed down to
# STATE_UPDATE_MIN_BLOCK_P channels while the grid has fewer blocks than the occupancy hint's
# resident slots. At the hint of 4 (64 registers a thread, 256 threads a block) the sm_90 builds
# spill nothing and four blocks' staging fits a SM's shared memory (tests/test_aot.py).
# [not yet timed: python -m ssd.tools.decode_bench --block-p 4,8,16,32,64 times the alternatives]
STATE_UPDATE_TILE_BYTES = 8192
STATE_UPDATE_MIN_BLOCK_P = 4


def state_update_config(config: StateUpdateConfig, problem: tuple[int, int, int, int],
                        state_bytes: int, sms: int | None = None) -> StateUpdateConfig:
    """``config`` with ``block_p`` resolved for the decode step's (batch, heads, headdim, dstate)
    ``problem`` and a state of ``state_bytes`` bytes an element: a given ``block_p`` clamped to
    the head dim; None: the widest power of two whose slice fits STATE_UPDATE_TILE_BYTES, then,
    given the GPU's ``sms``, halved while the grid (batch x heads x channel blocks) has fewer blocks
    than ``occupancy`` a SM (4 without a hint) and the slice is wider than
    STATE_UPDATE_MIN_BLOCK_P."""
    b, h, p, n = problem
    if config.block_p is not None:
        return replace(config, block_p=min(config.block_p, next_pow2(p)))
    fits = STATE_UPDATE_TILE_BYTES // (next_pow2(n) * state_bytes)
    widest = 1 << (max(fits, 1).bit_length() - 1)  # the largest power of two <= fits
    block_p = min(next_pow2(p), max(STATE_UPDATE_MIN_BLOCK_P, widest))
    slots = (config.occupancy or 4) * (sms or 0)
    while block_p > STATE_UPDATE_MIN_BLOCK_P and b * h * -(-p // block_p) < slots:
        block_p //= 2
    return replace(config, block_p=block_p)
