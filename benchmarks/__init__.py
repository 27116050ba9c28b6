"""flowtt_jax benchmarks: ``python -m benchmarks`` runs the suite (``--stage scaling``: weak
scaling over the GPUs of one host), ``python -m benchmarks.report`` turns its JSON into
markdown, the measurements page's blocks and plots.

Modules: ``workloads`` (seeded generators: the single-table sweep, Meta-like collections,
DLRM batches), ``impls`` (the implementations compared, one registry), ``timing`` (compile,
device time, memory), ``scaling`` (the scaling stage), ``records`` (the results JSON: run
header, writing, reading back), ``plots``, ``report`` and ``scaling_report`` (the blocks of
``docs/measurements.md``), ``memory_cpu`` (forward temporaries from XLA's memory analysis, no run).
"""
