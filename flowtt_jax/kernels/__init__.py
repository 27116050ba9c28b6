"""The compiled kernels from Python: loading and calling the FFI targets (``ffi``), the plan
types and their ``jax.numpy`` twins (``plan``), a shape group's packed layout and plan
(``group_plan``)."""
