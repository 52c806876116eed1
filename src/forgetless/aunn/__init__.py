"""Absolute Unit NN (docs/DESIGN.md §2.5): an MLP from an absolute index to the datum stored there.

Source: Absolute Unit NNs: Regression-Based MLPs for Everything.
"""
