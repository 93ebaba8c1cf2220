"""Numba kernels of the tensor codec: pure functions over integer and float arrays."""
