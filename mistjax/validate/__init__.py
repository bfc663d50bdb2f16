"""Checks of predictions against compiled programs (XLA:CPU here, XLA:GPU deviceless) and measured runs.

The top of the house: it may import every other mistjax package and the model zoo.
"""
