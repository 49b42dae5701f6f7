"""What PyTorch's CUDA caching allocator reserves for the tensors a plan holds: its rounding and fragmentation.

The rules, from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x, default settings: no
expandable_segments, no max_split_size_mb, no garbage-collection threshold):

- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests up to 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB (kSmallBuffer);
- larger requests come from the large pool: below 10 MiB (kMinLargeAlloc) a new segment is 20 MiB
  (kLargeBuffer), from 10 MiB up it is the request rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest cached free block of its pool that holds it (best fit); the block is split
  when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool), else the request
  takes it whole;
- a freed block merges with free neighbours of its own segment and stays cached: segments are returned to
  the driver only by empty_cache() or when an allocation would otherwise fail.

So the reserved bytes exceed the allocated ones by rounding (persistent tensors: weights, gradients,
optimizer state, known by shape) and by fragmentation (transient tensors freed and requested again at
other sizes leave cached blocks too small for the next request). `CachingAllocator` replays a sequence of
allocations and frees under these rules (benchmarks/allocator_replay.py feeds it a traced training step);
`reserved_for` is the closed form the memory model uses for tensors that live through the whole step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

MIB = 1024**2
BLOCK = 512  # kMinBlockSize
SMALL_REQUEST = 1 * MIB  # kSmallSize
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge


def round_request(nbytes: float) -> int:
    """A request as the allocator sizes it: a multiple of 512 bytes, at least 512."""
    return max(BLOCK, BLOCK * math.ceil(nbytes / BLOCK))


def segment_size(request: int) -> int:
    """The segment the allocator asks the driver for when no cached block holds `request` (rounded) bytes."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * math.ceil(request / ROUND_LARGE)


def reserved_for(tensors: Iterable[tuple[float, float]]) -> float:
    """Bytes reserved for tensors allocated one after another and all kept: (size in bytes, how many).

    Large tensors (10 MiB and up) each get a segment of their size rounded up to 2 MiB. Smaller ones are
    packed into 2 MiB (up to 1 MiB) or 20 MiB segments, as many whole ones as fit in each (a large-pool
    block is split only when more than 1 MiB remains; a block of 1 to 10 MiB in a 20 MiB segment).
    """
    small = mid = 0.0
    total = 0.0
    for size, count in tensors:
        if count <= 0 or size <= 0:
            continue
        r = round_request(size)
        if r >= MIN_LARGE_ALLOC:
            total += count * segment_size(r)
        elif r <= SMALL_REQUEST:
            small += count * r
        else:
            per = max(LARGE_SEGMENT // r, 1)
            mid += math.ceil(count / per) * LARGE_SEGMENT
    return total + mid + SMALL_SEGMENT * math.ceil(small / SMALL_SEGMENT)


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class CachingAllocator:
    """A replay of the caching allocator's bookkeeping (no memory): malloc/free by handle, reserved and peaks."""

    reserved: int = 0
    allocated: int = 0  # requested bytes (unrounded) in use
    peak_reserved: int = 0
    peak_allocated: int = 0
    _segments: list[list[_Block]] = field(default_factory=list)
    _free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})  # small?
    _live: dict[object, tuple[_Block, int]] = field(default_factory=dict)

    def malloc(self, handle: object, nbytes: int) -> None:
        r = round_request(nbytes)
        small = r <= SMALL_REQUEST
        pool = self._free[small]
        i = bisect.bisect_left(pool, (r, -1, -1))
        if i < len(pool):
            _, seg, off = pool.pop(i)
            block = next(b for b in self._segments[seg] if b.offset == off)
        else:
            size = segment_size(r)
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = _Block(len(self._segments), 0, size)
            self._segments.append([block])
        rest = block.size - r
        if (rest >= BLOCK) if small else (rest > SMALL_REQUEST):
            tail = _Block(block.segment, block.offset + r, rest)
            blocks = self._segments[block.segment]
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(pool, (tail.size, tail.segment, tail.offset))
            block.size = r
        block.free = False
        self._live[handle] = (block, nbytes)
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, handle: object) -> None:
        found = self._live.pop(handle, None)
        if found is None:
            return
        block, nbytes = found
        self.allocated -= nbytes
        seg = self._segments[block.segment]
        small = self._pool_of(seg)
        pool = self._free[small]
        block.free = True
        i = seg.index(block)
        # Merge with free neighbours of the same segment.
        for j in (i + 1, i - 1):
            if 0 <= j < len(seg) and seg[j].free:
                other = seg[j]
                pool.remove((other.size, other.segment, other.offset))
                first, second = (block, other) if j > i else (other, block)
                first.size += second.size
                seg.remove(second)
                block = first
                i = seg.index(block)
        bisect.insort(pool, (block.size, block.segment, block.offset))

    @staticmethod
    def _pool_of(seg: list[_Block]) -> bool:
        return sum(b.size for b in seg) == SMALL_SEGMENT
