"""Checks that compile real programs to verify predictions (top-level package: may import everything).

`mistjax.validate.gpu_aot`: compile a plan's train step for the target GPU cluster with XLA:GPU
deviceless AOT and read its per-device memory, collectives and cost (docs/cost_model.md).
"""
