"""Absolute Unit NN (DESIGN.md §2.5): an MLP from an absolute index to the datum stored there."""
