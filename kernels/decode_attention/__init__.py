"""Single-query decode attention over a heap buffer that also returns each key's attention mass
(summed over the query heads of a GQA group), so H2O scoring needs no second pass.

torch_ops: Triton kernel (CUDA) + torch reference + self-checking dispatcher.
mlx_ops: Metal kernel (mx.fast.metal_kernel) + mlx reference + the same dispatcher.
Import the submodule you need: this package imports neither torch nor mlx.
"""
