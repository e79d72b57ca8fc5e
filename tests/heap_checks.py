"""Invariants every backend's heap keeps after a stream longer than its capacity."""

import numpy as np


def assert_stream_invariants(heap_layers, cfg, min_evictions: int = 1) -> None:
    """Bounded, sinks kept, order preserved, counts add up; streaming keeps exactly sinks + newest."""
    for layer in heap_layers:
        h = layer.heap
        assert h.resident <= cfg.sinks + cfg.budget + cfg.slack
        pos = h.view_positions()
        assert (pos[:, :cfg.sinks] == np.arange(cfg.sinks)).all(), "sinks never evicted"
        assert (np.diff(pos, axis=1) > 0).all(), "order preserved"
        assert h.evicted + h.resident == h.seen
        assert h.evictions >= min_evictions
        if cfg.policy == "streaming":
            newest = np.arange(h.seen - (h.resident - cfg.sinks), h.seen)
            assert (pos == np.concatenate([np.arange(cfg.sinks), newest])).all()
