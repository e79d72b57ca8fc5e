"""Torch backend: Hugging Face transformers models running through the heap."""

from .backend import TorchBackend
from .cache import HeapCache, make_heap_cache
from .layer import HeapLayer

__all__ = ["TorchBackend", "HeapCache", "HeapLayer", "make_heap_cache"]
