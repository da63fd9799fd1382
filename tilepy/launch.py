"""Launch plans: a compiled kernel with its grid, block, shared memory and a prebuilt parameter
buffer, launched with only the data pointers and scalars rewritten per call.

Numba's dispatcher costs more host time per launch (typing every argument, building ctypes
values, going through ``cuda.core``) than a GEMM of 512³ takes on the GPU
(shared/numba-cuda-notes.md: launch cost; bench/NOTES.md: launch plans). An op that has
seen a call with the same shapes, strides, dtypes and flags before needs none of that work: it
keeps a :class:`LaunchPlan` for the call's signature and launches through the driver's
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

Grid limits: CUDA launches at most :data:`MAX_GRID_X` blocks along x and :data:`MAX_GRID_YZ`
along y and z. A plan whose grid y or z is larger launches in chunks along that dimension, each
at most :data:`MAX_GRID_YZ` blocks, when the kernel's plan states which array arguments those
blocks index (:class:`GridSplit`): per chunk the data pointers of those arrays are advanced to
the chunk's first element and their shapes cut to the chunk's extent, so the kernel, reading
its batch or head from ``blockIdx``, sees a smaller problem of the same kind (in the
simulator the rebuilt arrays cover exactly the chunk's memory). Arrays of extent 1 along such
an axis (broadcast: the kernels read ``min(i, extent - 1)``) stay as they are. A grid past a
limit along a dimension without a split is refused when the plan is built (``ValueError``),
before anything is launched. Kernels that take coordinates from tensor maps (TMA) cannot be
split by pointers: their ops pick a kernel with a one-dimensional grid instead.

This module knows Numba and the CUDA driver bindings, not CuPy or PyTorch: pointers and stream
handles arrive as integers.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import numpy as np

from . import devices
from ._env import choose_target

SIMULATOR = choose_target()

#: CUDA's largest grid along y and z (a launch past it fails with CUDA_ERROR_INVALID_VALUE): a
#: plan launches a larger grid along y or z in chunks of at most this many blocks
#: (:class:`GridSplit`). Read when a plan is built, so tests may lower it (monkeypatch).
MAX_GRID_YZ = 65535
#: CUDA's largest grid along x; a plan past it is refused when built.
MAX_GRID_X = 2**31 - 1

#: The simulator's stand-in SM count (:data:`tilepy.devices.SIM_SMS`; patch it there).
SIM_SMS = devices.SIM_SMS


def sm_count(default: int, device: int | None = None) -> int:
    """The multiprocessor count of ``device`` (default: the one an op works on,
    :func:`tilepy.devices.current`; persistent grids); ``default`` where the device does not
    say."""
    try:
        return int(devices.info(device).sms)
    except Exception:  # noqa: BLE001 - no device attribute: the caller's default
        if SIMULATOR:
            raise
        return default


def compute_capability(device: int | None = None) -> tuple[int, int]:
    """The compute capability (major, minor) of ``device`` (default: the one an op works on,
    :func:`tilepy.devices.current`); (0, 0) in the simulator."""
    return tuple(devices.info(device).cc)


def is_hopper(device: int | None = None) -> bool:
    """Whether ``device`` (default: the one an op works on) is compute capability 9.0 (the
    sm_90a kernels' target) and ``TILEPY_HOPPER=0`` does not turn them off."""
    import os

    return os.environ.get("TILEPY_HOPPER", "1") != "0" and compute_capability(device) == (9, 0)


@dataclass(frozen=True)
class GridSplit:
    """How a kernel's blocks along grid dimension ``dim`` (1: y, 2: z) index array argument
    ``arg`` (its position among the kernel's arguments): block ``i`` reads elements
    ``i · per_block // group …`` of axis ``axis`` — ``per_block`` elements per block (e.g. a
    block per 16 rows), or ``group`` blocks per element (grouped-query attention: ``group``
    query heads share one key/value head, which the kernel finds as ``h // (heads_q //
    heads_kv)`` from the shapes it is given).

    A plan whose grid along ``dim`` exceeds :data:`MAX_GRID_YZ` launches chunks of block
    indices ``[s, s + c)``: each chunk starts at a multiple of ``group`` and spans whole groups
    (or, for a group larger than the limit, lies inside one group, and the array's chunk is
    that one element), and the array's chunk is its elements ``s · per_block // group …
    ⌈(s + c) · per_block / group⌉ - 1`` (cut at the array's extent). An array of extent 1
    along ``axis`` is broadcast and stays as it is."""

    dim: int
    arg: int
    axis: int
    per_block: int = 1
    group: int = 1

    def __post_init__(self):
        if self.dim not in (1, 2):
            raise ValueError(f"GridSplit.dim must be 1 (y) or 2 (z), got {self.dim}")
        for name in ("per_block", "group"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GridSplit.{name} must be >= 1, got {getattr(self, name)}")


def grid_chunks(blocks: int, limit: int, align: int = 1):
    """``[(start, count)]`` covering block indices ``0 … blocks - 1`` in order, each ``count``
    at most ``limit``; with ``align`` > 1 no chunk crosses a multiple of ``align`` unless it
    starts at one and spans whole multiples of it (``align`` ≤ ``limit``: chunks of
    ``limit - limit % align``; else pieces of ``limit`` inside each run of ``align``)."""
    if blocks <= limit:
        return [(0, blocks)]
    if align <= limit:
        size = limit - limit % align
        return [(s, min(size, blocks - s)) for s in range(0, blocks, size)]
    out = []
    for g0 in range(0, blocks, align):
        end = min(g0 + align, blocks)
        out += [(s, min(limit, end - s)) for s in range(g0, end, limit)]
    return out


def array_layout(shape, strides, itemsize: int) -> str:
    """"C" or "F" for an array of this shape and byte strides that is contiguous in that
    order (axes of extent 1 ignored, as NumPy and Numba do; "C" first), else "A"."""
    if 0 in shape:
        return "C"

    def contiguous(pairs):
        step = itemsize
        for n, s in pairs:
            if n != 1:
                if s != step:
                    return False
                step *= n
        return True

    pairs = list(zip(shape, strides))
    if contiguous(reversed(pairs)):
        return "C"
    return "F" if contiguous(pairs) else "A"


def pointer(view) -> int:
    """Device address of a Numba device array (host address of the simulator's stand-in)."""
    if SIMULATOR:
        return view._ary.ctypes.data if hasattr(view, "_ary") else view.ctypes.data
    ptr = view.device_ctypes_pointer.value
    return int(ptr or 0)


def launch_bound(dispatcher) -> int | None:
    """The most threads a block of ``dispatcher``'s kernel may have, from its
    ``launch_bounds`` (None: unbounded, or the simulator, which keeps none)."""
    lb = getattr(dispatcher, "targetoptions", {}).get("launch_bounds")
    if lb is None:
        return None
    return int(lb[0] if isinstance(lb, tuple) else lb)


class NoContextError(RuntimeError):
    """A launch the driver refused for want of a current context
    (``CUDA_ERROR_INVALID_CONTEXT``)."""


class LaunchPlan:
    """``dispatcher`` compiled for ``args`` (Numba device arrays and NumPy scalars), launched
    on ``grid`` × ``block`` with ``smem`` bytes of dynamic shared memory; ``cluster`` > 1:
    in thread-block clusters of that many blocks along x (``cuLaunchKernelEx``; in the
    simulator the blocks of a cluster run at the same time, see :mod:`tilepy.ptx.cluster`).

    ``plan.launch(stream, args)`` launches with a full argument list (of the same types,
    shapes and strides); a :meth:`bind`-ed plan launches from operand pointers and scalars.

    ``split``: :class:`GridSplit` entries saying which array arguments the blocks along grid y
    and z index; a grid past :data:`MAX_GRID_YZ` along y or z then launches in chunks (the
    module docstring), and without an entry for that dimension the plan is refused
    (``ValueError``), as is a grid x past :data:`MAX_GRID_X`. ``chunks`` is None for a single
    launch, else the launches: ``(grid, [(array index, byte offset, shape), …])``.

    ``dependent``: launched with programmatic stream serialisation (``cuLaunchKernelEx``,
    sm_90): the kernel may begin while the kernel ahead of it in the stream finishes, and
    must call :func:`tilepy.ptx.griddep.griddepcontrol_wait` before it reads that kernel's
    results (the simulator runs kernels one after the other).
    """

    def __init__(self, dispatcher, args, grid, block, smem: int = 0, cluster: int = 1,
                 split=(), dependent: bool = False):
        self.grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        self.grid += (1,) * (3 - len(self.grid))
        self.cluster = int(cluster)
        self.dependent = bool(dependent)
        if self.cluster < 1 or self.grid[0] % self.cluster:
            raise ValueError(f"a cluster of {self.cluster} blocks must divide the grid's x "
                             f"dimension ({self.grid[0]})")
        self.block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
        self.block += (1,) * (3 - len(self.block))
        bound = launch_bound(dispatcher)
        if bound is not None and self.block[0] * self.block[1] * self.block[2] > bound:
            raise ValueError(f"a block of {self.block} threads exceeds the kernel's launch "
                             f"bound of {bound} threads (the GPU refuses such a launch)")
        self.smem = int(smem)
        self.dispatcher = dispatcher
        self._arrays = []   # per array argument: (position, shape, strides, dtype, ptr at build)
        self._scalars = []  # per scalar argument: (position, NumPy type)
        for pos, a in _leaves(args):
            if isinstance(a, np.generic):
                self._scalars.append((pos, type(a)))
            elif hasattr(a, "shape") and hasattr(a, "strides"):
                self._arrays.append((pos, tuple(a.shape), tuple(a.strides), np.dtype(a.dtype),
                                     pointer(a)))
            else:
                raise TypeError(f"argument {pos}: a launch plan takes device arrays, NumPy "
                                f"scalars and tuples of them, got {type(a).__name__}")
        self.split = tuple(split)
        self.chunks = self._plan_chunks()
        self._lock = threading.Lock()
        # the device whose context the kernel was loaded into (the op's, tilepy.devices.use);
        # where the process sees several, a launch from outside it enters it first
        self.device = devices.entered() if SIMULATOR else devices.current_id()
        self._switch = self.device is not None and devices.several()
        if SIMULATOR:
            self._templates = list(args)
        else:
            self._build_driver_params(dispatcher, args)

    def ptx(self):
        """The PTX Numba generated for the plan's kernel (for the current device), or None
        where there is none to read: in the simulator, or for a kernel loaded from tilepy's
        disk cache without its PTX."""
        kernel = getattr(self, "_kernel", None)
        if kernel is None:
            return None
        try:
            return kernel.inspect_asm(None)
        except Exception:  # noqa: BLE001  (a library without the PTX text)
            return None

    def _plan_chunks(self):
        """None when the grid fits in one launch, else the chunked launches (see the class
        docstring); ValueError for a grid past a limit that the plan cannot split."""
        if self.grid[0] > MAX_GRID_X:
            raise ValueError(f"grid x of {self.grid[0]} blocks exceeds CUDA's limit of "
                             f"{MAX_GRID_X}")
        over = [d for d in (1, 2) if self.grid[d] > MAX_GRID_YZ]
        if not over:
            return None
        positions = [i for i, *_ in self._arrays]
        per_dim = {}
        for d in over:
            if not any(sp.dim == d for sp in self.split):
                raise ValueError(f"grid {'yz'[d - 1]} of {self.grid[d]} blocks exceeds CUDA's "
                                 f"limit of {MAX_GRID_YZ} and the plan states no GridSplit for "
                                 f"it (grid {self.grid})")
            specs = []   # (array index, split) of the arrays that move with the chunks
            for sp in self.split:
                if sp.dim != d:
                    continue
                if sp.arg not in positions:
                    raise ValueError(f"GridSplit: argument {sp.arg} is not an array argument")
                j = positions.index(sp.arg)
                shape = self._arrays[j][1]
                if not 0 <= sp.axis < len(shape):
                    raise ValueError(f"GridSplit: argument {sp.arg} has no axis {sp.axis} "
                                     f"(shape {shape})")
                if shape[sp.axis] != 1:    # extent 1: broadcast, stays put
                    specs.append((j, sp))
            align = math.lcm(1, *(sp.group for _, sp in specs))
            per_dim[d] = (grid_chunks(self.grid[d], MAX_GRID_YZ, align), specs)
        ys, y_specs = per_dim.get(1, ([(0, self.grid[1])], []))
        zs, z_specs = per_dim.get(2, ([(0, self.grid[2])], []))
        chunks = []
        for z0, zc in zs:
            for y0, yc in ys:
                patch = {}   # array index -> [byte offset, shape]
                for (j, sp), (s, c) in ([(e, (y0, yc)) for e in y_specs]
                                        + [(e, (z0, zc)) for e in z_specs]):
                    _, shape, strides, _, _ = self._arrays[j]
                    entry = patch.setdefault(j, [0, list(shape)])
                    lo = s * sp.per_block // sp.group
                    hi = min(shape[sp.axis], -(-(s + c) * sp.per_block // sp.group))
                    entry[0] += lo * strides[sp.axis]
                    entry[1][sp.axis] = hi - lo
                chunks.append(((self.grid[0], yc, zc),
                               [(j, off, tuple(shape)) for j, (off, shape) in patch.items()]))
        return chunks

    def chunk_layouts(self) -> dict:
        """Per array argument that the chunks cut (its index among the array arguments), the
        layouts ("C", "F" or "A", as Numba types arrays) of its chunks; empty without
        chunks."""
        out = {}
        for _, patch in self.chunks or ():
            for j, _, shape in patch:
                _, _, strides, dtype, _ = self._arrays[j]
                out.setdefault(j, set()).add(array_layout(shape, strides, dtype.itemsize))
        return out

    # ---- the real GPU: a parameter buffer in Numba's layout ------------------------------

    def _build_driver_params(self, dispatcher, args):
        from cuda.bindings import driver
        from numba import types

        sig = [dispatcher.typeof_pyval(a) for a in args]
        # a chunk of a contiguous array cut along an inner axis is not contiguous: a kernel
        # compiled for layout "C" would index it from its shape, so it takes layout "A"
        # (the same parameter fields, indexed by the strides)
        restrided = False
        for j, layouts in self.chunk_layouts().items():
            i = self._arrays[j][0]
            if sig[i].layout != "A" and layouts != {sig[i].layout}:
                sig[i] = sig[i].copy(layout="A")
                restrided = True
        sig = tuple(sig)
        kernel = dispatcher.overloads.get(sig) or dispatcher.compile(sig)
        if getattr(kernel, "debug", False):
            raise NotImplementedError("launch plans do not support kernels compiled with "
                                      "debug=True (their error codes are read back per launch)")
        handle = kernel._codelibrary.get_cufunc().handle
        self._kernel = kernel
        if restrided and self.smem > 48 * 1024:   # the op allowed it for the other overload
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = driver.cuKernelSetAttribute(attr, self.smem, handle,
                                                 devices.current_id())
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"could not allow {self.smem} B of dynamic shared memory: "
                                   f"{err!r}")
        err, func = driver.cuKernelGetFunction(handle)
        if err != driver.CUresult.CUDA_SUCCESS:   # an older Numba: already a CUfunction
            func = handle
        self._func = func
        self._launch_fn = driver.cuLaunchKernel
        self._success = driver.CUresult.CUDA_SUCCESS
        self._no_context = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        self._ex_cfg = None
        if self.cluster > 1 or self.dependent:
            self._build_ex_config(driver)
        slots = []
        self._ptr_slots = []     # per array argument, the ctypes slot holding its data pointer
        self._array_slots = []   # per array argument, all its slots (nitems, shape: chunks)
        self._scalar_slots = []  # per scalar argument, its ctypes slot
        for ty, a in _typed_leaves(sig, args):
            if isinstance(ty, types.Array):
                fields = [0, 0, int(a.size), int(a.dtype.itemsize), pointer(a),
                          *map(int, a.shape), *map(int, a.strides)]
                cs = [ctypes.c_int64(v) for v in fields]
                self._ptr_slots.append(cs[4])
                self._array_slots.append(cs)
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
        # One buffer laid out as the kernel's parameters (each at a multiple of its size),
        # passed whole (CU_LAUNCH_PARAM_BUFFER_POINTER): the driver copies it in one piece
        # instead of one copy per field, which costs less host time per launch
        # (bench/overhead.py --breakdown; bench/NOTES.md: host cost per repeated call). The
        # slots are views into it.
        offsets, size = [], 0
        for slot in slots:
            width = ctypes.sizeof(slot)
            size = -(-size // width) * width
            offsets.append(size)
            size += width
        self._param_buf = (ctypes.c_char * max(size, 8))()
        moved = {}
        for slot, off in zip(slots, offsets):
            view = type(slot).from_buffer(self._param_buf, off)
            view.value = slot.value
            moved[id(slot)] = view
        self._ptr_slots = [moved[id(x)] for x in self._ptr_slots]
        self._array_slots = [[moved[id(x)] for x in cs] for cs in self._array_slots]
        self._scalar_slots = [moved[id(x)] for x in self._scalar_slots]
        self._slots = [moved[id(x)] for x in slots]
        self._param_size = ctypes.c_size_t(size)
        self._extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(self._param_buf), 2,
                                            ctypes.addressof(self._param_size), 0)
        self._extra_addr = ctypes.addressof(self._extra)
        self._params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(x)
                                                        for x in self._slots])
        self._params_addr = ctypes.addressof(self._params)
        self._dims = (*self.grid, *self.block, self.smem)

    def _build_ex_config(self, driver):
        """A ``cuLaunchKernelEx`` configuration: with ``cluster > 1`` the cluster-dimension
        attribute (blocks ``cluster·i … cluster·i + cluster − 1`` of the grid's x dimension
        form cluster i), with ``dependent`` programmatic stream serialisation (the kernel may
        start before the one ahead of it in the stream has finished: it must call
        :func:`tilepy.ptx.griddep.griddepcontrol_wait` before reading that kernel's
        results)."""
        attrs = []
        if self.cluster > 1:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = \
                self.cluster, 1, 1
            attrs.append(attr)
        if self.dependent:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.\
                CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        self._ex_cfg = cfg
        self._driver = driver

    def max_active_clusters(self) -> int:
        """How many clusters of this plan the device can run at once (``cuOccupancyMaxActive
        Clusters``; a persistent grid of more would run its last clusters after the others).
        ``cluster > 1`` only; in the simulator :data:`SIM_SMS` // cluster."""
        if self.cluster < 2:
            raise ValueError("max_active_clusters: this plan launches no clusters")
        if SIMULATOR:
            return max(1, devices.current().sms // self.cluster)
        driver = self._driver
        err, n = driver.cuOccupancyMaxActiveClusters(self._func, self._ex_cfg)
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
            if self.chunks is None:
                if self._ex_cfg is None:   # the common case, in line
                    (err,) = self._launch_fn(self._func, *self._dims, stream, 0,
                                             self._extra_addr)
                    if err != self._success:
                        self._launch_failed(err, self.grid)
                else:
                    self._launch_grid(stream, self.grid)
                return
            try:
                for grid, patch in self.chunks:
                    for j, offset, shape in patch:
                        cs = self._array_slots[j]
                        cs[4].value = ptrs[j] + offset
                        cs[2].value = math.prod(shape)
                        for d, n in enumerate(shape):
                            cs[5 + d].value = n
                    self._launch_grid(stream, grid)
            finally:   # the shapes as built (parameter_values), the pointers of this call
                self._restore_patched(ptrs)

    def _restore_patched(self, ptrs):
        for j in sorted({j for _, patch in self.chunks for j, _, _ in patch}):
            shape = self._arrays[j][1]
            cs = self._array_slots[j]
            cs[4].value = ptrs[j]
            cs[2].value = math.prod(shape)
            for d, n in enumerate(shape):
                cs[5 + d].value = n

    def _launch_grid(self, stream: int, grid):
        """One launch of the parameter buffer as it stands on ``grid`` (the lock held).

        A ``dependent`` plan without clusters whose programmatic launch the driver refuses
        (one that cannot make or capture such a launch) launches in plain stream order
        instead, this time and from then on: correct for its kernel, whose
        ``griddepcontrol.wait`` returns at once when the kernel ahead has finished."""
        if self._ex_cfg is not None:
            cfg = self._ex_cfg
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.hStream = stream
            (err,) = self._driver.cuLaunchKernelEx(cfg, self._func, self._params_addr, 0)
            if err != self._success and self.dependent and self.cluster == 1 and \
                    err != self._no_context:
                self.dependent, self._ex_cfg = False, None
                self._launch_grid(stream, grid)
                return
        else:
            gx, gy, gz = grid
            bx, by, bz = self.block
            (err,) = self._launch_fn(self._func, gx, gy, gz, bx, by, bz, self.smem, stream,
                                     0, self._extra_addr)
        if err != self._success:
            self._launch_failed(err, grid)

    def _launch_failed(self, err, grid):
        call = "cuLaunchKernelEx" if self._ex_cfg is not None else "cuLaunchKernel"
        kind = NoContextError if err == getattr(self, "_no_context", None) else RuntimeError
        raise kind(f"{call} failed: {err!r} (grid {grid}"
                   + (f", a chunk of {self.grid}" if grid != self.grid else "")
                   + f", block {self.block}, {self.smem} B of dynamic shared memory"
                   + (f", clusters of {self.cluster}" if self.cluster > 1 else "")
                   + ")")

    # ---- the simulator: rebuild the arrays from pointers -----------------------------------

    def _launch_sim(self, ptrs, scalars):
        args = list(self._templates)
        for (i, t), v in zip(self._scalars, scalars):
            _put(args, i, t(v))
        if self.chunks is None:
            self._sim_arrays(args, ptrs, ())
            self._sim_run(self.grid, args)
            return
        for grid, patch in self.chunks:
            self._sim_arrays(args, ptrs, patch)
            self._sim_run(grid, args)

    def _sim_arrays(self, args, ptrs, patch):
        """The array arguments rebuilt from pointers into ``args``: as built, or with a
        chunk's ``patch`` (byte offsets and shapes), covering exactly their memory."""
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        changed = {j: (offset, shape) for j, offset, shape in patch}
        for j, ((i, shape, strides, dtype, _), p) in enumerate(zip(self._arrays, ptrs)):
            if j in changed:
                offset, shape = changed[j]
                p += offset
            lo = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0 and n > 0)
            hi = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0 and n > 0)
            buf = (ctypes.c_char * (hi - lo + dtype.itemsize)).from_address(p + lo)
            _put(args, i, FakeCUDAArray(np.ndarray(shape, dtype, buffer=buf, offset=-lo,
                                                   strides=strides)))

    def _sim_run(self, grid, args):
        # the simulator's kernel[...] configures the kernel object itself (it returns it):
        # configure and run under one lock, or another plan of the same kernel (or another
        # chunk) could change the grid in between
        with _SIM_LAUNCH:
            configured = self.dispatcher[grid, self.block, 0, self.smem]
            if self.cluster > 1:   # the blocks of a cluster at the same time (ptx.cluster)
                from .ptx._simcluster import clusters

                with clusters(self.cluster, grid, self.block):
                    configured(*args)
            else:
                configured(*args)

    # ---- public ---------------------------------------------------------------------------

    def array_positions(self) -> list:
        """The positions of the array arguments among the kernel's arguments, in the order
        of the pointer lists of bound plans (:meth:`bind`): an int, or for an array inside a
        tuple argument the path ``(i, j, …)`` (:func:`arg_at` reads either)."""
        return [i for i, *_ in self._arrays]

    def array_index(self, position: int) -> int:
        """Where argument ``position`` (an array) sits among the array arguments: its index
        in the pointer lists of :meth:`_go` and of bound plans."""
        return [i for i, *_ in self._arrays].index(position)

    def launch(self, stream, args):
        """Launch with a full argument list shaped like the one the plan was built from."""
        ptrs = [pointer(arg_at(args, i)) for i, *_ in self._arrays]
        scalars = [arg_at(args, i) for i, _ in self._scalars]
        self._go_on_device(stream, ptrs, scalars)

    def _go_on_device(self, stream, ptrs, scalars):
        """:meth:`_go` (a subclass's too: its tensor maps, counters) inside the device the
        plan was built on, entered first where the process sees several and a caller is
        elsewhere."""
        if self._switch and devices.entered() != self.device:
            with devices.use(self.device):
                self._go(stream, ptrs, scalars)
        else:
            self._go(stream, ptrs, scalars)

    def _go(self, stream, ptrs, scalars):
        if SIMULATOR:
            devices.note("launch")
            self._launch_sim(ptrs, scalars)
            return
        handle = _stream_handle(stream)
        try:
            self._launch_driver(handle, ptrs, scalars)
        except NoContextError:
            # no context current on this thread (one that has made no CUDA call yet, calling
            # a cached plan, which enters no device on a one-GPU process): once more with
            # the plan's device's context current
            if self.device is None or devices.entered() == self.device:
                raise
            with devices.use(self.device):
                self._launch_driver(handle, ptrs, scalars)

    def bind(self, sources):
        """A :class:`BoundPlan`: ``sources[j]`` for the j-th array argument is ``(operand
        index, operand pointer at build time)`` or ``None`` (the argument is constant)."""
        if len(sources) != len(self._arrays):
            raise ValueError(f"{len(self._arrays)} array arguments, {len(sources)} sources")
        return BoundPlan(self, sources)


def _leaves(args, path=()):
    """``(position, value)`` of every argument that is not a tuple, depth first: a top-level
    argument's position is its index, one inside a tuple argument its path of indices
    (Numba passes a tuple argument as its members' parameters in order; an empty tuple
    passes none)."""
    for i, a in enumerate(args):
        here = path + (i,)
        if isinstance(a, tuple):
            yield from _leaves(a, here)
        else:
            yield (here if len(here) > 1 else i), a


def _typed_leaves(sig, args):
    """``(Numba type, value)`` pairs of :func:`_leaves`' order."""
    from numba import types

    for ty, a in zip(sig, args):
        if isinstance(ty, types.BaseTuple):
            yield from _typed_leaves(tuple(ty), a)
        else:
            yield ty, a


def arg_at(args, position):
    """The argument at ``position`` (:meth:`LaunchPlan.array_positions`: an index, or a path
    into tuple arguments)."""
    if isinstance(position, tuple):
        for i in position:
            args = args[i]
        return args
    return args[position]


def _put(args: list, position, value) -> None:
    """``args`` (a list) with the leaf at ``position`` replaced (tuples rebuilt)."""
    if not isinstance(position, tuple):
        args[position] = value
        return

    def rebuilt(t, path):
        i = path[0]
        return t[:i] + ((value if len(path) == 1 else rebuilt(t[i], path[1:])),) + t[i + 1:]

    args[position[0]] = rebuilt(args[position[0]], position[1:])


#: Simulator launches: configuring a simulated kernel and running it is one step.
_SIM_LAUNCH = threading.RLock()


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
        self.plan._go_on_device(stream, arg_ptrs, scalars)


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


class CallPlan:
    """The launches of one call of an op, for later calls with the same signature (an op that
    launches more than one kernel, or launches into arrays it makes per call).

    Operands are numbered by the op: ``ptrs[k]`` is operand ``k``'s data pointer in this call
    (0 for an absent one). ``allocs`` maps an operand index to an allocator
    (:func:`tilepy.arrays.allocator`): that operand is made anew by each call (a result, a
    temporary) and its pointer fills slot ``k``. ``steps`` are ``(BoundPlan, scalars)``
    pairs launched in order on the caller's stream (``scalars`` as :meth:`LaunchPlan.launch`
    takes them; ``()`` keeps the values the plan was built with).

    ``plan(stream, ptrs)`` launches every step and returns ``{index: array}`` of the arrays it
    made (kept alive by the caller as long as the launches need them: the arrays' allocators
    order their reuse on the stream)."""

    def __init__(self, steps, allocs=None):
        self.steps = list(steps)
        self.allocs = dict(allocs or {})

    def __call__(self, stream, ptrs):
        ptrs = list(ptrs)
        made = {}
        for k, alloc in self.allocs.items():
            made[k], ptrs[k] = alloc()
        for bound, scalars in self.steps:
            bound(stream, ptrs, scalars)
        return made
