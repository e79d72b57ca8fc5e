"""Backends: the tensor side of the heap (mlx for Apple Silicon, torch for CUDA/CPU)."""
