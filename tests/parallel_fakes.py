"""Test-only fault injection for the parallel tests (never a product setting a workflow could reach)."""

from __future__ import annotations


def fail_inside_forward(monkeypatch, rank: int, call: int) -> list[int]:
    """The DiT's `JointBlock.forward` raises on global rank `rank` at its `call`-th run there (after
    earlier blocks met the other ranks in their collectives). Patched on the class in this process
    (`monkeypatch` undoes it); processes forked later inherit it as it is then. Returns the armed
    rank as a list: `.clear()` disarms it, `.append(r)` arms rank r (for processes forked later too)."""
    import torch.distributed as dist

    from lingbot_core.models.transformer import JointBlock

    armed, calls, original = [rank], [0], JointBlock.forward

    def forward(self, *args, **kwargs):
        if armed and dist.is_initialized() and dist.get_rank() == armed[0]:
            calls[0] += 1
            if calls[0] == call:
                raise RuntimeError(f"injected failure inside the forward on rank {armed[0]}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JointBlock, "forward", forward)
    return armed
