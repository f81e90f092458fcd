"""CUDA graphs of short sequential steps (OVQ's chunk-by-chunk assignments), cached per shape. Imports torch only."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(run: Callable[[], object], device) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run`` once on a side stream (compiles kernels, sets up library handles outside the capture), then
    captured; returns the graph and what the captured call returned (tensors the replays overwrite)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class GraphCache:
    """Objects that capture a graph when built, one per key (the ``size`` most recent kept). A key whose build
    raised a RuntimeError (something this build cannot capture) is remembered and gets None: run eagerly."""

    def __init__(self, size: int = 8):
        self.size = size
        self._built: dict = {}
        self._broken: set = set()

    def get(self, key, build: Callable[[], object]):
        if key in self._broken:
            return None
        if key not in self._built:
            try:
                if len(self._built) >= self.size:
                    self._built.pop(next(iter(self._built)))
                self._built[key] = build()
            except RuntimeError:
                self._broken.add(key)
                return None
        return self._built[key]
