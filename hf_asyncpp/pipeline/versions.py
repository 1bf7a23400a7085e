"""Weight versions of one stage: where "two weight buffers" (2BW) and weight stashing (PipeDream) live.

The optimizer owns the stage's ``nn.Parameter``s, whose storage always holds the newest version. Forward passes
never use those Parameters directly: each version gets its own leaf tensors sharing storage with a version buffer,
and the executor runs the stage on them with ``functional_call``, so an update never touches a tensor that an
in-flight microbatch saved for its backward. A buffer is reused as soon as its version has no microbatch in
flight and no future forward needs it (``lag`` = the schedule record's ``lag``): 1 buffer for GPipe/1F1B (updates
in place), 2 for 2BW (the version in use and the one the next STEP writes), up to p at stage 0 for PipeDream.

The in-flight counts are only changed through a :class:`Hold`: a microbatch's forward takes one (``hold(v)``),
it travels with the microbatch's saved state, and its backward releases it exactly once. A second release raises
(it would free a buffer an in-flight backward still reads), and :meth:`Versions.check_released` at a drain point
names a hold never released (its buffer would never be freed).
"""
from __future__ import annotations

import torch


class Hold:
    """One microbatch's use of one weight version, from its forward to its backward; released exactly once."""

    __slots__ = ("_versions", "version", "_released")

    def __init__(self, versions: "Versions", version: int):
        self._versions, self.version, self._released = versions, version, False

    def release(self) -> None:
        if self._released:
            raise RuntimeError(f"weight version {self.version}: a microbatch's hold was released twice (its buffer "
                               "could be overwritten while another backward still uses it)")
        self._released = True
        self._versions.inflight[self.version] -= 1


class Versions:
    """Weight versions of one stage: version -> buffer; in-flight counts decide which buffers are free."""

    def __init__(self, params: dict[str, torch.nn.Parameter], lag: int):
        self.params, self.lag = params, lag
        self.buffers: dict[int, dict[str, torch.Tensor]] = {0: {n: p.data for n, p in params.items()}}
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.inflight: dict[int, int] = {0: 0}
        self.latest = 0
        self.peak = 1

    def hold(self, v: int) -> Hold:
        """Version ``v`` is in use by one more microbatch until the returned hold is released (at its backward)."""
        self.inflight[v] = self.inflight.get(v, 0) + 1
        return Hold(self, v)

    def check_released(self) -> None:
        """At a drain point every hold must be released: raise naming the versions still held."""
        held = {v: n for v, n in self.inflight.items() if n}
        if held:
            raise RuntimeError(f"weight versions still held by microbatches at a drain point (version: count): {held}; "
                               "a forward's hold was never released by its backward")

    def leaves_for(self, v: int) -> dict[str, torch.Tensor]:
        if v not in self.buffers:
            raise RuntimeError(f"weight version {v} is not held (held: {sorted(self.buffers)}, latest {self.latest})")
        if v not in self.leaves:
            self.leaves[v] = {n: b.detach().requires_grad_() for n, b in self.buffers[v].items()}
        return self.leaves[v]

    def _needed(self, v: int, latest: int) -> bool:
        return self.inflight.get(v, 0) > 0 or v >= latest - self.lag

    def prepare_update(self) -> None:
        """Point the optimizer's Parameters at a buffer holding the newest weights that it may overwrite."""
        new = self.latest + 1
        src = self.buffers[self.latest]
        free = [v for v in self.buffers if not self._needed(v, new)]
        if self.latest in free:
            dst = src  # nothing in flight uses it and no future forward will: update in place
        elif free:
            dst = self.buffers[free[0]]
            for n, b in dst.items():
                b.copy_(src[n])
        else:
            dst = {n: b.clone() for n, b in src.items()}
        for v in free:
            self.buffers.pop(v)
            self.leaves.pop(v, None)
            self.inflight.pop(v, None)
        for n, p in self.params.items():
            p.data = dst[n]
        self.latest = new
        self.buffers[new] = dst
        self.inflight[new] = 0
        self.peak = max(self.peak, len(self.buffers))

    def state(self) -> dict[str, torch.Tensor]:
        """Held versions other than the newest (which is the module's state dict)."""
        return {f"v{v}/{n}": b for v, buf in self.buffers.items() if v != self.latest for n, b in buf.items()}

    def load(self, latest: int, older: dict[str, torch.Tensor]) -> None:
        self.buffers = {latest: {n: p.data for n, p in self.params.items()}}
        for key, t in older.items():
            v, n = key[1:].split("/", 1)
            self.buffers.setdefault(int(v), {})[n] = t.clone()
        self.latest, self.leaves = latest, {}
        self.inflight = {v: 0 for v in self.buffers}
