"""Benchmark support: real training trajectories and timing helpers.

Kept out of the core package so that compressing checkpoints never needs
scikit-learn or tqdm; install them with ``pip install 'lcckpt[bench]'``.
"""
