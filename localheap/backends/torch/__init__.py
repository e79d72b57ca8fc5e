"""Torch backend: Hugging Face transformers models running through the heap."""

from ...heap import pages, scoring
from . import slab_cpu
from .backend import TorchBackend
from .cache import HeapCache, make_heap_cache
from .layer import HeapLayer

scoring.use_native(slab_cpu.bounds_pages, slab_cpu.bounds_ready)   # page scores of a recall in the CPU module where it is built
pages.use_summaries(slab_cpu.summarize_pages, slab_cpu.bounds_ready)   # and a page-out's page summaries

__all__ = ["TorchBackend", "HeapCache", "HeapLayer", "make_heap_cache"]
