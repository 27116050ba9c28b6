"""The examples obey the library's no-batch-constants rule: the main job's programs (its
data program and its train step, both presets) hold no constant above 64 KB, lowered or
compiled (XLA folding a batch-sized constant costs compile time: 6.4 s for the Meta preset's
pooling means at 240 x 4,096 on a GPU). On CPU XLA folded none of them even before that fix
(its GPU pipeline folds more): the lowered check holds on every backend, the compiled one
where it runs; ``scripts/gpu_check.sh full`` runs this on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from examples import dlrm
from tests.test_collection_jagged import _largest_constant_bytes

LIMIT = 64 << 10


@pytest.mark.parametrize(
    "argv",
    [
        ["--batch-size", "4096", "--max-rows", "20000"],
        ["--preset", "meta", "--tables", "24", "--batch-size", "4096", "--max-rows", "20000"],
    ],
    ids=["criteo", "meta"],
)
def test_main_job_programs_hold_no_large_constant(argv):
    args = dlrm.parse_args([*argv, "--no-progress"])
    run = dlrm.build_run(args, dense_tables=False, log=lambda *a: None)
    data = run.batch.__self__  # the synthetic data set whose batch program runs each step
    stream, index = np.uint32(0), np.uint32(0)
    batch_program = data._batch.lower(stream, index, args.batch_size)
    d, s, y, _ = run.batch(0, args.batch_size, stream=0)
    step = run.train_step.lower(run.state, d, s, y)
    for what, lowered in (("data", batch_program), ("train step", step)):
        assert _largest_constant_bytes(lowered.as_text()) <= LIMIT, what
        assert _largest_constant_bytes(lowered.compile().as_text()) <= LIMIT, what
