"""MLX backend: mlx-lm models running through the heap."""

from .backend import MLXBackend
from .cache import HeapKVCache
from .heapcache import HeapPromptCache, make_heap_cache

__all__ = ["MLXBackend", "HeapKVCache", "HeapPromptCache", "make_heap_cache"]
