"""Fused kernels (Triton for CUDA, Metal for MLX), each beside a reference implementation.

Installed as `localheap.kernels`, so it never shadows another package named `kernels`.
"""
