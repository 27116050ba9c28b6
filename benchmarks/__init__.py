"""flowtt_jax benchmarks: ``python -m benchmarks`` runs the suite, ``python -m
benchmarks.report`` turns its JSON into markdown, README blocks and plots.

Modules: ``workloads`` (seeded generators: the single-table sweep, Meta-like collections),
``impls`` (the implementations compared, one registry), ``timing`` (compile, device time,
memory), ``plots``, ``report``, ``memory_cpu`` (forward temporaries from XLA's memory
analysis, no run).
"""
