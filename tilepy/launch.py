"""Launch plans: a compiled kernel with its grid, block, shared memory and a prebuilt parameter
buffer, launched with only the data pointers and scalars rewritten per call.

Numba's dispatcher costs 30–90 µs of host time per launch (typing every argument, building
ctypes values, going through ``cuda.core``); a GEMM of 512³ runs in less than that. An op that
has seen a call with the same shapes, strides, dtypes and flags before needs none of that work:
it keeps a :class:`LaunchPlan` for the call's signature and launches through the driver's
``cuLaunchKernel`` with a parameter buffer laid out as Numba lays out the kernel's arguments
(per array: meminfo, parent, nitems, itemsize, data, shape…, strides…; scalars as their C
types). Per call only the data pointers (the caller's arrays may be new allocations) and the
scalars change.

:meth:`LaunchPlan.bind` says where each array argument's pointer comes from: the index of one
of the op's operands (plus the byte offset the first call showed, for views that start inside
an operand), or nowhere (a constant array, e.g. a placeholder). Which operand feeds which
argument is stated by the op, never guessed from pointer values (two operands may share
memory).

In the CUDA simulator there are no kernel parameters; :class:`LaunchPlan` there rebuilds each
array argument from its pointer (a host address in the simulator), shape and strides, and
launches through the simulator's dispatcher — so the ops' plan caches, pointer bookkeeping
included, are exercised by the CPU test suite too.

This module knows Numba and the CUDA driver bindings, not CuPy or PyTorch: pointers and stream
handles arrive as integers.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ._env import choose_target

SIMULATOR = choose_target()

#: The simulator's stand-in SM count for persistent grids: small, so that a test's few tiles
#: still give each block several of them.
SIM_SMS = 4


def sm_count(default: int) -> int:
    """The current device's multiprocessor count (persistent grids); :data:`SIM_SMS` in the
    simulator, ``default`` where the device does not say."""
    if SIMULATOR:
        return SIM_SMS
    from numba import cuda

    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001 - no device attribute: the caller's default
        return default


def pointer(view) -> int:
    """Device address of a Numba device array (host address of the simulator's stand-in)."""
    if SIMULATOR:
        return view._ary.ctypes.data if hasattr(view, "_ary") else view.ctypes.data
    ptr = view.device_ctypes_pointer.value
    return int(ptr or 0)


class LaunchPlan:
    """``dispatcher`` compiled for ``args`` (Numba device arrays and NumPy scalars), launched
    on ``grid`` × ``block`` with ``smem`` bytes of dynamic shared memory; ``cluster`` > 1:
    in thread-block clusters of that many blocks along x (``cuLaunchKernelEx``; in the
    simulator the blocks of a cluster run at the same time, see :mod:`tilepy.ptx.cluster`).

    ``plan.launch(stream, args)`` launches with a full argument list (of the same types,
    shapes and strides); a :meth:`bind`-ed plan launches from operand pointers and scalars.
    """

    def __init__(self, dispatcher, args, grid, block, smem: int = 0, cluster: int = 1):
        self.grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        self.grid += (1,) * (3 - len(self.grid))
        self.cluster = int(cluster)
        if self.cluster < 1 or self.grid[0] % self.cluster:
            raise ValueError(f"a cluster of {self.cluster} blocks must divide the grid's x "
                             f"dimension ({self.grid[0]})")
        self.block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
        self.block += (1,) * (3 - len(self.block))
        self.smem = int(smem)
        self.dispatcher = dispatcher
        self._arrays = []   # per array argument: (position, shape, strides, dtype, ptr at build)
        self._scalars = []  # per scalar argument: (position, NumPy type)
        for i, a in enumerate(args):
            if isinstance(a, np.generic):
                self._scalars.append((i, type(a)))
            elif hasattr(a, "shape") and hasattr(a, "strides"):
                self._arrays.append((i, tuple(a.shape), tuple(a.strides), np.dtype(a.dtype),
                                     pointer(a)))
            else:
                raise TypeError(f"argument {i}: a launch plan takes device arrays and NumPy "
                                f"scalars, got {type(a).__name__}")
        self._lock = threading.Lock()
        if SIMULATOR:
            self._configured = dispatcher[self.grid, self.block, 0, self.smem]
            self._templates = list(args)
        else:
            self._build_driver_params(dispatcher, args)

    # ---- the real GPU: a parameter buffer in Numba's layout ------------------------------

    def _build_driver_params(self, dispatcher, args):
        from cuda.bindings import driver
        from numba import types

        sig = tuple(dispatcher.typeof_pyval(a) for a in args)
        kernel = dispatcher.overloads.get(sig) or dispatcher.compile(sig)
        if getattr(kernel, "debug", False):
            raise NotImplementedError("launch plans do not support kernels compiled with "
                                      "debug=True (their error codes are read back per launch)")
        handle = kernel._codelibrary.get_cufunc().handle
        err, func = driver.cuKernelGetFunction(handle)
        if err != driver.CUresult.CUDA_SUCCESS:   # an older Numba: already a CUfunction
            func = handle
        self._func = func
        self._launch_fn = driver.cuLaunchKernel
        self._success = driver.CUresult.CUDA_SUCCESS
        if self.cluster > 1:
            self._build_cluster_config(driver)
        slots = []
        self._ptr_slots = []     # per array argument, the ctypes slot holding its data pointer
        self._scalar_slots = []  # per scalar argument, its ctypes slot
        for ty, a in zip(sig, args):
            if isinstance(ty, types.Array):
                fields = [0, 0, int(a.size), int(a.dtype.itemsize), pointer(a),
                          *map(int, a.shape), *map(int, a.strides)]
                cs = [ctypes.c_int64(v) for v in fields]
                self._ptr_slots.append(cs[4])
                slots += cs
            elif ty == types.float32:
                slots.append(ctypes.c_float(float(a)))
                self._scalar_slots.append(slots[-1])
            elif ty == types.float64:
                slots.append(ctypes.c_double(float(a)))
                self._scalar_slots.append(slots[-1])
            elif isinstance(ty, types.Integer):
                slots.append(getattr(ctypes, f"c_{ty}")(int(a)))
                self._scalar_slots.append(slots[-1])
            else:
                raise NotImplementedError(f"launch plans do not take arguments of type {ty}")
        self._slots = slots
        self._params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self._params_addr = ctypes.addressof(self._params)

    def _build_cluster_config(self, driver):
        """A ``cuLaunchKernelEx`` configuration with the cluster-dimension attribute (blocks
        ``cluster·i … cluster·i + cluster − 1`` of the grid's x dimension form cluster i)."""
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = \
            self.cluster, 1, 1
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self._cluster_cfg = cfg
        self._driver = driver

    def max_active_clusters(self) -> int:
        """How many clusters of this plan the device can run at once (``cuOccupancyMaxActive
        Clusters``; a persistent grid of more would run its last clusters after the others).
        ``cluster > 1`` only; in the simulator :data:`SIM_SMS` // cluster."""
        if self.cluster < 2:
            raise ValueError("max_active_clusters: this plan launches no clusters")
        if SIMULATOR:
            return max(1, SIM_SMS // self.cluster)
        driver = self._driver
        err, n = driver.cuOccupancyMaxActiveClusters(self._func, self._cluster_cfg)
        if err != self._success:
            raise RuntimeError(f"cuOccupancyMaxActiveClusters failed: {err!r}")
        return int(n)

    def parameter_values(self) -> list:
        """The values in the parameter buffer, in order (for checking against Numba's own
        argument packing)."""
        return [s.value for s in self._slots]

    def _launch_driver(self, stream: int, ptrs, scalars):
        with self._lock:
            for slot, p in zip(self._ptr_slots, ptrs):
                slot.value = p
            for slot, v in zip(self._scalar_slots, scalars):
                slot.value = v
            if self.cluster > 1:
                self._cluster_cfg.hStream = stream
                (err,) = self._driver.cuLaunchKernelEx(self._cluster_cfg, self._func,
                                                       self._params_addr, 0)
            else:
                gx, gy, gz = self.grid
                bx, by, bz = self.block
                (err,) = self._launch_fn(self._func, gx, gy, gz, bx, by, bz, self.smem, stream,
                                         self._params_addr, 0)
        if err != self._success:
            call = "cuLaunchKernelEx" if self.cluster > 1 else "cuLaunchKernel"
            raise RuntimeError(f"{call} failed: {err!r} (grid {self.grid}, block "
                               f"{self.block}, {self.smem} B of dynamic shared memory"
                               + (f", clusters of {self.cluster}" if self.cluster > 1 else "")
                               + ")")

    # ---- the simulator: rebuild the arrays from pointers -----------------------------------

    def _launch_sim(self, ptrs, scalars):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        args = list(self._templates)
        for (i, shape, strides, dtype, _), p in zip(self._arrays, ptrs):
            lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0 and n > 0)
            hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0 and n > 0)
            buf = (ctypes.c_char * (hi - lo + dtype.itemsize)).from_address(p + lo)
            args[i] = FakeCUDAArray(np.ndarray(shape, dtype, buffer=buf, offset=-lo,
                                               strides=strides))
        for (i, t), v in zip(self._scalars, scalars):
            args[i] = t(v)
        if self.cluster > 1:   # the blocks of a cluster at the same time (tilepy.ptx.cluster)
            from .ptx._simcluster import clusters

            with clusters(self.cluster, self.grid, self.block):
                self._configured(*args)
        else:
            self._configured(*args)

    # ---- public ---------------------------------------------------------------------------

    def array_index(self, position: int) -> int:
        """Where argument ``position`` (an array) sits among the array arguments: its index
        in the pointer lists of :meth:`_go` and of bound plans."""
        return [i for i, *_ in self._arrays].index(position)

    def launch(self, stream, args):
        """Launch with a full argument list shaped like the one the plan was built from."""
        ptrs = [pointer(args[i]) for i, *_ in self._arrays]
        scalars = [args[i] for i, _ in self._scalars]
        self._go(stream, ptrs, scalars)

    def _go(self, stream, ptrs, scalars):
        if SIMULATOR:
            self._launch_sim(ptrs, scalars)
        else:
            self._launch_driver(_stream_handle(stream), ptrs, scalars)

    def bind(self, sources):
        """A :class:`BoundPlan`: ``sources[j]`` for the j-th array argument is ``(operand
        index, operand pointer at build time)`` or ``None`` (the argument is constant)."""
        if len(sources) != len(self._arrays):
            raise ValueError(f"{len(self._arrays)} array arguments, {len(sources)} sources")
        return BoundPlan(self, sources)


class BoundPlan:
    """A plan whose array arguments come from the op's operands: ``bound(stream, ptrs,
    scalars)`` with ``ptrs[k]`` the data pointer of operand ``k`` in this call."""

    def __init__(self, plan: LaunchPlan, sources):
        self.plan = plan
        self._map = []
        for (_, _, _, _, built), src in zip(plan._arrays, sources):
            if src is None:
                self._map.append((None, built))
            else:
                index, operand_ptr = src
                self._map.append((index, built - operand_ptr))

    def __call__(self, stream, ptrs, scalars=()):
        arg_ptrs = [off if k is None else ptrs[k] + off for k, off in self._map]
        self.plan._go(stream, arg_ptrs, scalars)


def _stream_handle(stream) -> int:
    """A Numba stream, a raw handle (int) or 0 for the legacy default stream, as an int."""
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "handle", None)
    if handle is None:
        return 0
    value = getattr(handle, "value", handle)
    return int(value or 0)


class PlanCache:
    """An op's launch plans by call signature, at most ``limit`` of them (a process that
    sees endless new shapes must not grow without bound: the cache starts over when full).

    ``lookup(key)`` returns ``(entry, key)``: the entry or None, and the key to store a new
    entry under — None when the key is unhashable (an argument the op's checks will reject),
    in which case :meth:`put` stores nothing."""

    def __init__(self, limit: int = 512):
        self.limit = limit
        self._entries: dict = {}

    def lookup(self, key):
        try:
            return self._entries.get(key), key
        except TypeError:
            return None, None

    def put(self, key, entry) -> None:
        if key is None:
            return
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[key] = entry

    def clear(self) -> None:
        self._entries.clear()

    def values(self):
        return self._entries.values()

    def __len__(self) -> int:
        return len(self._entries)
