"""A fake CUDA device for CPU tests of the memory counting: torch.cuda's memory counters, the device's
name and `mem_get_info`, as a test sets them (nothing is allocated anywhere)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FakeCuda:
    free: int = 0
    total: int = 24 << 30
    reserved: int = 0
    allocated: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    name: str = "NVIDIA Fake 24GB"
    resets: int = 0

    def install(self, monkeypatch) -> FakeCuda:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        return self

    def _reset(self, device=None) -> None:
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
