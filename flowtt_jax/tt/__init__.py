"""The TT format: shapes (``spec``), cores (``cores``: init, dense conversion, TT-SVD) and
the pure ``jax.numpy`` contraction every kernel is tested against (``reference``)."""
