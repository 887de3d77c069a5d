"""GPU tests of the fused-walk prototype (ssd.fused_walk, branch next/fused): y and the final
states against the float64 reference of ssd.problem, on fresh random inputs, y poisoned with NaN
before the launch, at the tolerances of ssd.validate (``pytest -m gpu``)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import chunk_cumsum  # noqa: E402
from ssd.fused_walk import fused_walk  # noqa: E402
from ssd.problem import ProblemSpec  # noqa: E402
from ssd.validate import DTYPES, TOL, device_inputs, reference_of, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
SPECS = [ProblemSpec(2, 256, 8, 64, 128, 1, chunk_size=64, D="h", dt_bias=True, dt_softplus=True,
                     name="q64-n128-D-h"),
         ProblemSpec(2, 512, 16, 64, 128, 4, chunk_size=64, D="hp", dt_bias=True, dt_softplus=True,
                     name="q64-groups4-D-hp"),
         ProblemSpec(3, 256, 4, 32, 64, 1, chunk_size=32, name="q32-n64-noD"),
         ProblemSpec(1, 512, 4, 64, 64, 2, chunk_size=128, D="h", dt_softplus=True, name="q128-n64")]


@pytest.mark.parametrize("block_p,occupancy", [(64, 2), (32, 3), (16, 4)])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_fused_walk_matches_the_reference(spec, dtype, block_p, occupancy, gpu_record):
    if spec.headdim % block_p:
        pytest.skip("block_p must divide the head dim")
    inputs = device_inputs(spec, SEED, dtype)
    ref = reference_of(spec, inputs)
    dt_out, dA = chunk_cumsum.chunk_cumsum(inputs["dt"], inputs["A"], spec.chunk_size,
                                           dt_bias=inputs.get("dt_bias"),
                                           dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
    y = torch.full_like(inputs["x"], float("nan"))
    y, final = fused_walk(inputs["B"], inputs["C"], inputs["x"], dt_out, dA, D=inputs.get("D"),
                          block_p=block_p, occupancy=occupancy, out=y)
    torch.cuda.synchronize()
    errs = {"y": rel_err(y, ref["y"]), "final_states": rel_err(final, ref["final_states"])}
    for key, err in errs.items():
        gpu_record.append(dict(test="fused_walk", shape=spec.name, dims=list(spec.dims),
                               chunk_size=spec.chunk_size, dtype=dtype, stage=key, rel_err=err,
                               tol=TOL[dtype], seed=SEED))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{spec.name} [{dtype}, seed {SEED}]: {errs}"
