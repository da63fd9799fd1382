"""Which GPU an op runs on, and what tilepy asks of it.

The contract every op keeps: it finds its inputs' device (:func:`tilepy.arrays.same_device`;
inputs on two devices are a ``ValueError`` before anything is launched), and everything it does
with the GPU — device queries (compute capability, SM count, name), allocations, tensor maps,
kernel compilation and loading, launches — happens inside :func:`use` of that device, never on
whichever device happens to be current. A launch plan cached for a later call (its arrays'
fingerprints carry the device) launches inside :func:`use` of the device it was built on, when
the process sees more than one device (:class:`tilepy.launch.LaunchPlan`); with one device
that costs nothing.

Device properties come from :func:`info` (cached per device; reading them makes no context),
the device an op is working on from :func:`current`. Everything here goes through a backend:
the CUDA driver through Numba (``numba.cuda.gpus[i]`` makes device ``i``'s primary context
current), the simulator (one device, compute capability (0, 0), :data:`SIM_SMS` SMs), or a
list of fake devices that a test installs with :func:`fake` — the simulator's kernels, with
each array placed on a device of the list, and a log of every query and launch with the device
it ran under, so that the per-device logic can be checked without a second GPU.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

from ._env import choose_target

SIMULATOR = choose_target()

#: The simulator's stand-in SM count (persistent grids): small, so that a test's few tiles
#: still give each block several of them.
SIM_SMS = 4


@dataclass(frozen=True)
class DeviceInfo:
    """What the ops ask of a device: its ordinal, name, compute capability (major, minor) and
    multiprocessor count."""
    id: int
    name: str
    cc: tuple
    sms: int


_tls = threading.local()


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def entered() -> int | None:
    """The device this thread's innermost :func:`use` entered, or None outside any."""
    s = _stack()
    return s[-1] if s else None


class _Driver:
    """The real GPUs, through Numba's device list and its primary contexts."""

    def count(self) -> int:
        from ._env import gpu_count

        return gpu_count()

    def current_id(self) -> int:
        from numba import cuda

        return int(cuda.get_current_device().id)

    def info(self, device: int) -> DeviceInfo:
        from numba import cuda

        dev = cuda.gpus[device]     # attributes only: no context is made
        name = dev.name
        name = name.decode() if isinstance(name, bytes) else str(name)
        return DeviceInfo(int(device), name, tuple(dev.compute_capability),
                          int(dev.MULTIPROCESSOR_COUNT))

    def activate(self, device: int):
        from numba import cuda

        return cuda.gpus[device]


class _Simulator(_Driver):
    """Numba's CUDA simulator: one device."""

    def count(self) -> int:
        return 1

    def current_id(self) -> int:
        return 0

    def info(self, device: int) -> DeviceInfo:
        return DeviceInfo(0, "simulator", (0, 0), SIM_SMS)

    def activate(self, device: int):
        return contextlib.nullcontext()


class FakeDevices(_Simulator):
    """A list of devices for tests (:func:`fake`): the simulator's kernels, arrays placed on a
    device by :meth:`place`, and :attr:`log`, a list of ``(what, device entered or None)`` for
    every device query (``"info"``, ``"current"``), every context switch (``"activate"``,
    with the device switched to), every allocation (``"alloc"``) and every launch
    (``"launch"``); :attr:`asked`, the devices whose properties were read."""

    def __init__(self, devices, current: int = 0):
        self.devices = {d.id: d for d in devices}
        self.current = int(current)
        self.log: list = []
        self.asked: list = []
        self._placed: dict = {}

    def count(self) -> int:
        return len(self.devices)

    def current_id(self) -> int:
        self.log.append(("current", entered()))
        return self.current

    def info(self, device: int) -> DeviceInfo:
        self.log.append(("info", entered()))
        self.asked.append(device)
        if device not in self.devices:
            raise ValueError(f"no device {device} (fake devices {sorted(self.devices)})")
        return self.devices[device]

    def activate(self, device: int):
        self.log.append(("activate", device))
        if device not in self.devices:
            raise ValueError(f"no device {device} (fake devices {sorted(self.devices)})")
        return contextlib.nullcontext()

    def note(self, what: str) -> None:
        self.log.append((what, entered()))

    def place(self, x, device: int):
        """``x`` (a NumPy array the simulator's kernels read) as if on ``device``; returns it."""
        self._placed[id(x)] = (x, int(device))   # holds x: its id stays its own
        return x

    def array_device(self, x):
        held = self._placed.get(id(x))
        return held[1] if held is not None and held[0] is x else None

    def events(self, what: str) -> list:
        """The devices entered at each logged ``what``."""
        return [d for w, d in self.log if w == what]


_backend = _Simulator() if SIMULATOR else _Driver()
_fake: FakeDevices | None = None
_info_cache: dict = {}   # the driver's devices (their properties do not change)
_count: list = []


@contextlib.contextmanager
def fake(devices, current: int = 0):
    """Run the ``with`` block against fake devices (:class:`FakeDevices` of the
    :class:`DeviceInfo` list ``devices``, device ``current`` current): simulator only."""
    global _backend, _fake
    if not SIMULATOR:
        raise RuntimeError("fake devices run the simulator's kernels: set NUMBA_ENABLE_CUDASIM=1")
    saved = _backend, _fake, list(_count)
    _backend = _fake = FakeDevices(devices, current)
    _count.clear()
    try:
        yield _fake
    finally:
        _backend, _fake = saved[0], saved[1]
        _count[:] = saved[2]


def count() -> int:
    """How many devices the process sees (read once)."""
    if not _count:
        _count.append(int(_backend.count()))
    return _count[0]


def several() -> bool:
    """Whether the process sees more than one device (cached plans then enter theirs)."""
    return count() > 1


def info(device: int | None = None) -> DeviceInfo:
    """Device ``device``'s properties (default: :func:`current`'s), cached per device."""
    if device is None:
        device = current_id()
    if SIMULATOR:   # the simulator's or the fake devices' (a test may patch SIM_SMS)
        return _backend.info(device)
    got = _info_cache.get(device)
    if got is None:
        got = _info_cache[device] = _backend.info(device)
    return got


def current_id() -> int:
    """The device an op is working on: the innermost :func:`use`'s, else the current one."""
    d = entered()
    if d is not None:
        if _fake is not None:
            _fake.note("current")
        return d
    return _backend.current_id()


def current() -> DeviceInfo:
    """:func:`info` of :func:`current_id`."""
    return info(current_id())


@contextlib.contextmanager
def use(device: int | None, *, lazy: bool = False):
    """Work on ``device`` for the ``with`` block: its context current, :func:`current` it.
    ``None`` (an op whose inputs name no device: NumPy arrays in the simulator) changes
    nothing. Nested entries of the device already entered switch no context (a list
    append); nor does a ``lazy`` entry in a process that sees one device (an allocation on
    the hot path: Numba makes that device's context current when it needs one)."""
    if device is None:
        yield
        return
    device = int(device)
    s = _stack()
    stay = (s and s[-1] == device) or (lazy and not several())
    with contextlib.nullcontext() if stay else _backend.activate(device):
        s.append(device)
        try:
            yield
        finally:
            s.pop()


def note(what: str) -> None:
    """Log ``what`` with the device entered (fake devices only; nothing otherwise)."""
    if _fake is not None:
        _fake.note(what)


def adopt(x, device):
    """``x``, a new array made for an operand on ``device``: placed there on fake devices
    (so that an op's result fed to the next op names its device); otherwise ``x`` as it is."""
    if _fake is not None and device is not None:
        _fake.place(x, device)
    return x


def array_device(x):
    """The fake device ``x`` was placed on, or None (always None outside :func:`fake`)."""
    if _fake is not None:
        return _fake.array_device(x)
    return None
