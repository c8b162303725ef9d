"""One layer's cold neurons in RAM: LLM in a Flash's sliding window, with LRU replacement inside a fixed
capacity (the memory plan's)."""

from __future__ import annotations

import numpy as np

NEVER = -(1 << 40)
PINNED = 1 << 62  # a pinned neuron's last use: never stale, never the least recent


class NeuronCache:
    """Preallocated row stores (one per row of a bundle kept, made by the kernel backend) and a slot table. A
    neuron stays while one of the last `window` tokens used it (None: until its slot is needed), and the least
    recently used make room when the cache is full; freed slots are reused in place. Pinned neurons (a flock,
runtime/flock.py) stay until the next pin releases them."""

    def __init__(self, n_neurons: int, capacity: int, n_rows: int, window: int | None, kernels,
                 prefault: bool = False):
        self.kernels = kernels
        self.rows = [kernels.empty(capacity, prefault) for _ in range(n_rows)]  # n_rows stores of (capacity, row)
        self.slot_of = np.full(n_neurons, -1, dtype=np.int64)         # (n_neurons,) its slot, or -1
        self.neuron_of = np.full(capacity, -1, dtype=np.int64)        # (capacity,) its neuron, or -1
        self.last_used = np.full(capacity, NEVER, dtype=np.int64)     # (capacity,) the token that last used it
        self.window = window
        self.clock = 0

    def lookup(self, needed: np.ndarray) -> np.ndarray:
        """A new token needs these neurons: the stale ones leave, the held ones are kept for this token, and
        the ones to read are returned."""
        self.clock += 1
        if self.window is not None:
            stale = (self.neuron_of >= 0) & (self.last_used <= self.clock - self.window)
            self.slot_of[self.neuron_of[stale]] = -1
            self.neuron_of[stale] = -1
        slots = self.slot_of[needed]
        held = slots[slots >= 0]
        self.last_used[held] = np.maximum(self.last_used[held], self.clock)  # this token's are not evicted
        return needed[slots < 0]

    def insert(self, neurons: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Place neurons' rows (n, rows kept, row) in free slots, then in those of the least recently used,
        never in this token's. Returns which were placed: a token needing more than the cache holds keeps the
        rest for itself."""
        free = np.flatnonzero(self.neuron_of < 0)
        if len(free) < len(neurons):
            used = np.flatnonzero((self.neuron_of >= 0) & (self.last_used < self.clock))
            victims = used[np.argsort(self.last_used[used])][: len(neurons) - len(free)]
            self.slot_of[self.neuron_of[victims]] = -1
            self.neuron_of[victims] = -1
            free = np.flatnonzero(self.neuron_of < 0)
        n = min(len(free), len(neurons))
        slots = free[:n]
        for k, store in enumerate(self.rows):
            self.kernels.put(store, slots, rows[:n, k])
        self.slot_of[neurons[:n]] = slots
        self.neuron_of[slots] = neurons[:n]
        self.last_used[slots] = self.clock
        return np.arange(len(neurons)) < n

    def held(self, needed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the needed neurons the cache holds now, their slots)."""
        slots = self.slot_of[needed]
        return needed[slots >= 0], slots[slots >= 0]

    def pin(self, neurons: np.ndarray, rows: np.ndarray) -> int:
        """Keep these neurons (rows: (n, rows kept, row), theirs) whatever the window and the LRU say, in place of
        the neurons pinned before. Returns how many are pinned: as many as the cache holds."""
        self.last_used[self.last_used == PINNED] = self.clock - 1  # released: evictable from now
        slots = self.slot_of[neurons]
        self.last_used[slots[slots >= 0]] = PINNED
        new = slots < 0
        placed = self.insert(neurons[new], rows[new])
        self.last_used[self.slot_of[neurons[new][placed]]] = PINNED
        return int((~new).sum() + placed.sum())
