"""Shared-memory carve-out: named regions of a block's dynamic shared buffer, placed once on the
host, whose byte offsets are closure constants of the kernel.

A warp-specialised kernel holds several kinds of data in one dynamic buffer — stage buffers of
TMA boxes (1024-byte aligned: the 128-byte swizzle repeats every 1024 bytes and wgmma reads
the pattern from the address), epilogue staging, mbarriers (8 bytes each, 8-byte aligned),
scratch words. :class:`SmemLayout` places them in order, each at the next multiple of its
alignment, so a kernel asks for ``layout.offset("stages")`` instead of adding sizes by hand::

    layout = SmemLayout.of(
        ("stages", stages * stage_bytes, 1024),
        ("staging", epilogue_bytes, 1024),
        ("barriers", ring.nbytes, 8),
    )
    STAGES, BARS = layout.offset("stages"), layout.offset("barriers")   # closure constants
    ... launch with layout.nbytes of dynamic shared memory

A region of 0 bytes takes no space (its offset is where it would start). ``overlay=name``
puts a region at the start of an earlier one instead of after the last (a buffer reused once
the first one's contents are dead, e.g. an epilogue staged in the stage buffers); it must fit
inside that region. The dynamic buffer itself must be at least as aligned as the largest
alignment asked for: :func:`tilepy.tile.smem.dynamic_shared` gives 128 bytes; kernels with
1024-byte regions declare ``cuda.shared.array(0, uint16, alignment=1024)`` (see
:attr:`SmemLayout.align`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """One region: ``nbytes`` at byte ``offset`` of the dynamic buffer."""

    name: str
    offset: int
    nbytes: int
    align: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class SmemLayout:
    """Regions placed in order (see the module docstring); immutable, hashable (a generator
    config may hold one)."""

    regions: tuple

    @classmethod
    def of(cls, *specs) -> "SmemLayout":
        """``specs``: ``(name, nbytes)``, ``(name, nbytes, align)`` or ``(name, nbytes, align,
        overlay)`` tuples, placed in order."""
        placed: list[Region] = []
        end = 0
        for spec in specs:
            spec = tuple(spec)
            name, nbytes = spec[0], int(spec[1])
            align = int(spec[2]) if len(spec) > 2 else 16
            overlay = spec[3] if len(spec) > 3 else None
            if not name or any(r.name == name for r in placed):
                raise ValueError(f"SmemLayout: region name {name!r} is empty or already used")
            if nbytes < 0:
                raise ValueError(f"SmemLayout: region {name!r} of {nbytes} bytes")
            if align < 1 or align & (align - 1):
                raise ValueError(f"SmemLayout: region {name!r}: alignment {align} is not a "
                                 "power of two")
            if overlay is not None:
                host = next((r for r in placed if r.name == overlay), None)
                if host is None:
                    raise ValueError(f"SmemLayout: region {name!r} overlays {overlay!r}, which "
                                     "is not placed before it")
                if host.offset % align or nbytes > host.nbytes:
                    raise ValueError(f"SmemLayout: region {name!r} ({nbytes} B, {align}-byte "
                                     f"aligned) does not fit in {overlay!r} ({host.nbytes} B "
                                     f"at {host.offset})")
                placed.append(Region(name, host.offset, nbytes, align))
                continue
            offset = -(-end // align) * align
            placed.append(Region(name, offset, nbytes, align))
            if nbytes:
                end = max(end, offset + nbytes)
        return cls(tuple(placed))

    def __getitem__(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"SmemLayout has no region {name!r}; it has "
                       f"{', '.join(r.name for r in self.regions)}")

    def __contains__(self, name: str) -> bool:
        return any(r.name == name for r in self.regions)

    def offset(self, name: str) -> int:
        """Byte offset of region ``name`` in the dynamic buffer."""
        return self[name].offset

    @property
    def nbytes(self) -> int:
        """The dynamic shared memory the layout needs (the launch's byte count)."""
        return max((r.end for r in self.regions if r.nbytes), default=0)

    @property
    def align(self) -> int:
        """The alignment the dynamic buffer must have: the largest asked for."""
        return max((r.align for r in self.regions), default=1)

    def describe(self) -> str:
        return ", ".join(f"{r.name} {r.nbytes} B @ {r.offset}" for r in self.regions)
