"""Checks of predictions against compiled programs and measured runs (the top layer: may import everything).

`check` compares the cost model with the compiled XLA:CPU program, `published` with published
training runs.
"""
