"""SSD in cuTile: Mamba-2's state-space-duality forward pass.

* ``ssd.reference``  NumPy ladder (recurrence, quadratic form, chunked stages); CPU only.
* ``ssd.problem``    named problem shapes with seeded inputs and per-stage references.
* ``ssd.mamba_chunk_scan_combined``  the cuTile forward (needs an NVIDIA GPU, torch and
  cuda-tile), differentiable (``ssd.autograd``, the backward of ``ssd.backward``: cuTile stage
  kernels where one exists, PyTorch for the others);
  imported lazily so that the CPU chapters need neither.
* ``ssd.selective_state_update``  the decode step (one token advances each state in place),
  mamba_ssm's signature; also lazy.
* ``ssd.wait_tuned``  wait for tuned kernels still compiling in the background (a first call
  runs a quick build of chunk_scan meanwhile; see ``ssd.launch``).
* stage kernels: ``ssd.kernels.chunk_cumsum``, ``ssd.kernels.chunk_state``, ``ssd.kernels.state_passing``,
  ``ssd.kernels.chunk_scan``, and the decode step's ``ssd.kernels.state_update``; tile sizes in
  ``ssd.config``.
* ``ssd.layer``  a Mamba-2 layer around the SSD; ``ssd.layer_ops`` its conv and gated norm in
  cuTile, ``ssd.layer_reference`` their float64 references.
"""
__version__ = "0.1.0"

_LAZY = {
    "mamba_chunk_scan_combined": "ssd.api",
    "forward_stages": "ssd.api",
    "selective_state_update": "ssd.decode",
    "SSDConfig": "ssd.config",
    "default_config": "ssd.config",
    "wait_tuned": "ssd.launch",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ssd' has no attribute {name!r}")
