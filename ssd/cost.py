"""Cost models: FLOPs and memory traffic of the SSD forward, and the time floor they imply.

Four models, all counts exact integers for given sizes:

* ``recurrence_flops`` / ``quadratic_flops`` -- one head of one sequence, for the
  O(l) versus O(l^2) comparison of the recurrence and the quadratic (dual) form;
* ``ssd_costs`` -- the chunked algorithm, stage by stage (FLOPs and bytes read and
  written), for a whole problem;
* ``floor_ms`` -- the time no kernel can beat on a machine with a given memory bandwidth
  and arithmetic rate: max(bytes / bandwidth, FLOPs / rate);
* ``rest_floor`` -- the same floor for the Mamba-2 mixer around the SSD: its projections'
  FLOPs at the matmul rate plus its conv's and norm's bytes at the copy bandwidth.

Counting conventions (shared by every function here)
-----------------------------------------------------
* A multiply-add is 2 FLOPs: a (m x k) @ (k x n) product costs 2 m k n.
* Elementwise transcendental and bookkeeping work is not counted: softplus, the clamp,
  ``exp`` of the decays, masks, the D skip and the z gate. It is O(elements), runs off
  the tensor cores, and is small next to the products (at most ~1/p of the diagonal
  block's work).
* Traffic is compulsory traffic: every tensor a stage touches is read (or written) once,
  as if caches absorbed every re-read. Real kernels re-read some tiles (chunk_scan reads
  B and C once per tile of p), so measured bytes can only be higher.
"""

from __future__ import annotations

import math
import operator

__all__ = ["STAGES", "DTYPE_BYTES", "recurrence_flops", "quadratic_flops", "ssd_costs", "floor_ms",
           "rest_floor"]

#: The stages of the chunked algorithm, in the order they run.
STAGES = ("chunk_cumsum", "chunk_state", "state_passing", "chunk_scan")


def _dims(dims):
    """(b, l, h, p, n, g) from a ``Dims``, a ``ProblemSpec`` or any 6-sequence of ints."""
    dims = getattr(dims, "dims", dims)  # a ProblemSpec carries its Dims
    b, l, h, p, n, g = (int(v) for v in dims)
    if min(b, l, h, p, n, g) < 1:
        raise ValueError(f"dims: every size must be >= 1, got {tuple(dims)}")
    if h % g:
        raise ValueError(f"dims: nheads h={h} is not divisible by ngroups g={g}")
    return b, l, h, p, n, g


def recurrence_flops(l, p, n):
    """FLOPs of the recurrence for one head over l steps: 5 l p n.

    Per step: the state update h_t = a_t h_{t-1} + (dt_t x_t) B_t^T is a scale, an
    outer product and an add of a (p, n) matrix, 3 p n; the read-out h_t C_t is a
    (p, n) @ (n,) product, 2 p n. (The O(p) work of dt_t x_t is not counted.)
    """
    return 5 * l * p * n


def quadratic_flops(l, p, n):
    """FLOPs of the quadratic form for one head: l^2 (2 n + 2 p + 1).

    C B^T is an (l, n) @ (n, l) product, 2 l^2 n; the mask L o (C B^T) is l^2
    multiplies; (L o C B^T) @ (dt x) is (l, l) @ (l, p), 2 l^2 p. Full l x l matrices
    are counted, as a dense implementation computes them; skipping the zero upper
    triangle would roughly halve the count and leave it O(l^2).
    """
    return l * l * (2 * n + 2 * p + 1)


def ssd_costs(dims, chunk_size, dtype_bytes=2, state_bytes=4, *,
              entering_state_bytes=None, has_z=False, cb_per_group=False):
    """FLOPs and compulsory memory traffic of each stage of the chunked SSD forward.

    Args:
        dims: (b, l, h, p, n, g): a ``Dims``, a ``ProblemSpec`` or a tuple.
        chunk_size: q; c = ceil(l / q) chunks.
        dtype_bytes: bytes per element of the inputs and the output: x, dt, B, C, z, y
            (2 for bf16/fp16).
        state_bytes: bytes per element of the fp32 intermediates: dt_out, dA_cumsum,
            states, final_states, and prev_states unless entering_state_bytes is
            given (4).
        entering_state_bytes: bytes per element of prev_states, the entering states
            that state_passing writes and chunk_scan reads; None: state_bytes. ``ssd``
            stores them in x's dtype by default (``StateConfig.state_dtype="input"``),
            as mamba_ssm does: pass dtype_bytes for that (2 with bf16 inputs), 4 for
            fp32 entering states.
        has_z: chunk_scan also reads the gate z (b, l, h, p).
        cb_per_group: count C B^T once per group (mamba_ssm computes it in a separate
            batched matmul shared by the h/g heads of a group) instead of once per head
            (it is recomputed inside chunk_scan for every head, as our kernel does).

    Returns:
        dict stage -> {"flops", "bytes_read", "bytes_written", "bytes"} for each stage
        in ``STAGES``, plus "total" (the sums). Values are ints.

    The model. Tensors indexed by position (x, dt, B, C, z, y) have l rows; the
    chunked intermediates have c chunks of q (the tail chunk is padded), so their
    size uses c q. FLOPs are counted over the padded length c q, the tiles a kernel
    computes. Parameters of size h or (h, p) (A, dt_bias, D) and the optional
    initial_states and seq_idx are not counted (a few KB).

    ==============  =======================================  ==========================
    stage           reads                                    writes
    ==============  =======================================  ==========================
    chunk_cumsum    dt (b,l,h)                               dt_out, dA_cumsum (b,h,c,q)
    chunk_state     x (b,l,h,p); B (b,l,g,n);                states (b,c,h,p,n)
                    dt_out, dA_cumsum (b,h,c,q)
    state_passing   states (b,c,h,p,n); dA_cumsum's last     prev_states (b,c,h,p,n);
                    column (b,h,c)                           final_states (b,h,p,n)
    chunk_scan      x (b,l,h,p); B, C (b,l,g,n);             y (b,l,h,p)
                    dt_out, dA_cumsum (b,h,c,q);
                    prev_states (b,c,h,p,n); z if has_z
    ==============  =======================================  ==========================

    FLOPs (L = c q, the padded length):

    * chunk_cumsum: dt' A and the running sum, 2 b h L.
    * chunk_state: the sum of (p, n) outer products over each chunk, a (p, q) @ (q, n)
      product per chunk and head: 2 b h L p n.
    * state_passing: one multiply-add per state element per chunk: 2 b c h p n.
    * chunk_scan:
        - C B^T, a (q, n) @ (n, q) product per chunk and head (or group, see
          cb_per_group): 2 b c q^2 n h (or g);
        - the diagonal block (L o C B^T) @ (dt x), a (q, q) @ (q, p) product per chunk
          and head: 2 b c h q^2 p. Both count the full q x q block, as a kernel that
          masks a dense tile computes it; a kernel that skips tiles above the diagonal
          does a little more than half of these two terms;
        - the off-diagonal term C @ prev_state^T, (q, n) @ (n, p) per chunk and head:
          2 b h L n p.
    """
    b, l, h, p, n, g = _dims(dims)
    try:
        q = operator.index(chunk_size)  # int or numpy integer, not a float
    except TypeError:
        q = None
    if q is None or isinstance(chunk_size, bool) or q < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    c = math.ceil(l / q)
    L = c * q  # padded length
    io, st = dtype_bytes, state_bytes
    est = state_bytes if entering_state_bytes is None else entering_state_bytes

    # sizes in elements
    x = b * l * h * p  # x, y and z
    bc = b * l * g * n  # B or C
    dt = b * l * h
    chunked = b * h * c * q  # dt_out or dA_cumsum
    states = b * c * h * p * n  # states or prev_states
    final = b * h * p * n
    cb_heads = g if cb_per_group else h

    costs = {
        "chunk_cumsum": dict(
            flops=2 * b * h * L,
            bytes_read=dt * io,
            bytes_written=2 * chunked * st,
        ),
        "chunk_state": dict(
            flops=2 * b * h * L * p * n,
            bytes_read=(x + bc) * io + 2 * chunked * st,
            bytes_written=states * st,
        ),
        "state_passing": dict(
            flops=2 * b * c * h * p * n,
            bytes_read=(states + b * h * c) * st,
            bytes_written=states * est + final * st,
        ),
        "chunk_scan": dict(
            flops=(2 * b * c * q * q * n * cb_heads  # C B^T
                   + 2 * b * c * h * q * q * p  # (L o C B^T) @ (dt x)
                   + 2 * b * h * L * n * p),  # C @ prev_state^T
            bytes_read=((x * (2 if has_z else 1) + 2 * bc) * io + 2 * chunked * st
                        + states * est),
            bytes_written=x * io,
        ),
    }
    for stage in costs.values():
        stage["bytes"] = stage["bytes_read"] + stage["bytes_written"]
    costs["total"] = {key: sum(costs[s][key] for s in STAGES)
                      for key in ("flops", "bytes_read", "bytes_written", "bytes")}
    return costs


def floor_ms(costs, bandwidth_bytes_per_s, flops_per_s):
    """The time floor in milliseconds: no kernel does this work faster on that machine.

    Args:
        costs: one stage's dict (with "flops" and "bytes"), or the whole dict from
            ``ssd_costs``.
        bandwidth_bytes_per_s: memory bandwidth, bytes/s.
        flops_per_s: arithmetic rate, FLOP/s.
    Returns:
        For one stage, max(bytes / bandwidth, flops / rate) in ms. For the dict of
        ``ssd_costs``, the sum of the stages' floors: the stages run as separate kernels
        one after another, and each is bound by its own resource.
    """
    if bandwidth_bytes_per_s <= 0 or flops_per_s <= 0:
        raise ValueError("floor_ms: bandwidth and rate must be positive")
    if "flops" in costs:
        return 1e3 * max(costs["bytes"] / bandwidth_bytes_per_s,
                         costs["flops"] / flops_per_s)
    return sum(floor_ms(costs[s], bandwidth_bytes_per_s, flops_per_s) for s in STAGES)


#: Bytes of one element of each model dtype the layer takes.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def rest_floor(config, batch, seqlen, ceilings) -> dict:
    """The floor of a Mamba-2 mixer without its SSD (ms): the projections at the matmul rate
    plus the conv's and the gated norm's compulsory bytes at the copy bandwidth.

    The two projections are matrix multiplications, bound by arithmetic: in_proj costs
    2 t d_model d_in_proj FLOPs and out_proj 2 t d_inner d_model over t = batch * seqlen tokens.
    The conv (with its SiLU) and the norm are elementwise passes, bound by memory: the conv
    reads xBC and writes it convolved, t conv_dim elements each way, plus its weights and bias
    (conv_dim (d_conv + 1)); the norm reads y and z and writes its output, t d_inner elements
    each, plus its weights (d_inner, fp32; fp64 in an fp64 model). Elements have the model
    dtype's size. Nothing is counted twice and nothing between the parts (the projections'
    inputs and outputs are the projections' own bytes, hidden under their FLOPs), so no layer
    with these four operations can be faster; the sum assumes the passes do not overlap.

    Args:
        config: an ``ssd.layer.Mamba2Config`` (d_model, d_inner, d_in_proj, conv_dim, d_conv,
            dtype are read).
        batch, seqlen: the input (batch, seqlen, d_model).
        ceilings: {"copy_bytes_per_s", "bf16_flops_per_s"}, measured on the GPU
            (``ssd.tools.bench.measure_ceilings``).
    Returns:
        dict with in_proj_flops, out_proj_flops, proj_flops, conv_bytes, norm_bytes,
        proj_ms = proj_flops / rate, bytes_ms = (conv_bytes + norm_bytes) / bandwidth, and
        floor_ms = proj_ms + bytes_ms.
    """
    c, t = config, int(batch) * int(seqlen)
    if t < 1:
        raise ValueError(f"batch, seqlen: expected positive sizes, got {batch}, {seqlen}")
    rate, bandwidth = ceilings["bf16_flops_per_s"], ceilings["copy_bytes_per_s"]
    if rate <= 0 or bandwidth <= 0:
        raise ValueError(f"ceilings: expected positive rates, got {dict(ceilings)}")
    e = DTYPE_BYTES[c.dtype]
    in_proj = 2 * t * c.d_model * c.d_in_proj
    out_proj = 2 * t * c.d_inner * c.d_model
    conv = e * (2 * t * c.conv_dim + c.conv_dim * (c.d_conv + 1))
    norm = e * 3 * t * c.d_inner + max(e, 4) * c.d_inner
    proj_ms = 1e3 * (in_proj + out_proj) / rate
    bytes_ms = 1e3 * (conv + norm) / bandwidth
    return dict(in_proj_flops=in_proj, out_proj_flops=out_proj, proj_flops=in_proj + out_proj,
                conv_bytes=conv, norm_bytes=norm, proj_ms=proj_ms, bytes_ms=bytes_ms,
                floor_ms=proj_ms + bytes_ms)
