"""Examples: ``python examples/dlrm.py`` (the main job); importable as ``examples.dlrm`` and
``examples.criteo_synth`` from the repository root (the tests do).
"""
