"""localheap: a local inference server that keeps each session's KV cache as a managed heap."""

try:   # tqdm's monitor thread (started by the first progress bar, e.g. transformers' loading bars)
    # would outlive everything as a daemon thread killed inside the runtime at exit; no bar here needs it
    import tqdm as _tqdm

    _tqdm.tqdm.monitor_interval = 0
except ImportError:   # pragma: no cover - tqdm comes with transformers and mlx-lm
    pass
