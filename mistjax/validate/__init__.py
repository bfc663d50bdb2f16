"""Checks of predictions against compiled programs and measured runs (the top layer: may import everything).

`check` compares the cost model with the compiled XLA:CPU program, `gpu_aot` compiles a plan for the
target GPU cluster deviceless (XLA:GPU's own per-device memory and collectives), `gpu_aot_pipeline`
does it per stage for pipelined plans (every MPMD program), `published` predicts
published training runs.
"""
