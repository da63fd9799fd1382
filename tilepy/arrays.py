"""Arrays in, same kind of arrays out: CuPy, PyTorch, Numba device arrays (and, in the CUDA
simulator, NumPy). All validation of user arrays lives here and in the op wrappers, before any
launch; nothing below ``tilepy.ops`` knows about CuPy or PyTorch.

In the CUDA simulator, PyTorch CPU tensors stand for CUDA tensors (as NumPy arrays stand for
device arrays): kernels work on their memory in place, results are CPU tensors.

An :class:`Operand` records what a user passed: its family, logical dtype (``float16``,
``bfloat16`` or ``float32``), shape, element strides and device. :func:`kernel_view` turns it
into what kernels take — a Numba device array (a NumPy array in the simulator) of ``uint16``
bits for 16-bit types, ``float32`` otherwise — without copying.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from . import devices
from ._env import choose_target

SIMULATOR = choose_target()

DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Operand:
    name: str
    family: str  # "torch" | "cupy" | "numba" | "numpy"
    dtype: str
    shape: tuple
    strides: tuple  # in elements
    device: int | None
    raw: object

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def byte_pointer(self) -> int:
        return _pointer(self)


def _family(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__") or (SIMULATOR and type(x).__name__ == "FakeCUDAArray"):
        return "numba"  # a Numba device array (in the simulator: its stand-in)
    return ""


#: The element types a kernel may read as they are (no 16-bit bit view), besides
#: :data:`DTYPES`: a score hook's run-time arguments (``describe(..., dtypes=HOOK_DTYPES)``).
HOOK_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
               "uint16", "uint32", "uint64", "bool")


def _dtype_name(family, x, allowed=DTYPES) -> str | None:
    if family == "torch":
        name = str(x.dtype).replace("torch.", "")
    else:
        name = str(np.dtype(x.dtype)) if family != "numba" else str(x.dtype)
    return name if name in allowed else None


def dtype_name(dtype) -> str:
    """A dtype given as a string, NumPy / CuPy / ml_dtypes dtype or PyTorch dtype, by name."""
    if isinstance(dtype, str):
        return dtype
    if type(dtype).__module__.split(".")[0] == "torch":
        return str(dtype).replace("torch.", "")
    return str(np.dtype(dtype))


def describe(x, name: str, *, allow_float32: bool = True, dtypes=None) -> Operand:
    """Check that ``x`` is an array tilepy can take; raise TypeError naming ``name`` if not.
    ``dtypes``: the element types allowed (default :data:`DTYPES`, without float32 when not
    ``allow_float32``); an operand of :data:`HOOK_DTYPES` other than bfloat16 is viewed as
    its own type by :func:`raw_view`, bfloat16 and float16 of :data:`DTYPES` as uint16 bits
    (``hook=True`` there keeps float16)."""
    fam = _family(x)
    if not fam:
        raise TypeError(f"{name}: expected a CuPy array, a PyTorch tensor or a Numba device "
                        f"array, got {type(x).__name__}")
    if fam == "numpy" and not SIMULATOR:
        raise TypeError(f"{name}: a NumPy array lives on the host; move it to the GPU first, "
                        "e.g. cupy.asarray(x), torch.as_tensor(x, device='cuda') or "
                        "numba.cuda.to_device(x)")
    allowed = tuple(dtypes) if dtypes is not None else (
        DTYPES if allow_float32 else DTYPES[:2])
    dt = _dtype_name(fam, x, allowed)
    if dt not in allowed:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported; expected one of "
                        f"{', '.join(allowed)}")
    if fam == "torch":
        if not x.is_cuda and not SIMULATOR:
            raise TypeError(f"{name}: a CPU tensor; move it to the GPU with .cuda()")
        strides = tuple(x.stride())
        device = x.device.index
    elif fam == "cupy":
        strides = tuple(s // x.itemsize for s in x.strides)
        device = x.device.id
    elif fam == "numba":
        strides = tuple(s // x.dtype.itemsize for s in x.strides)
        device = devices.array_device(x) if SIMULATOR else _numba_device(x)
    else:
        strides = tuple(s // x.itemsize for s in x.strides)
        device = devices.array_device(x)   # None but on tilepy.devices.fake's devices
    return Operand(name, fam, dt, tuple(x.shape), strides, device, x)


def overlaps_itself(op: Operand) -> bool:
    """True when two elements of the operand ``op`` may share memory (zero or interleaved
    strides, e.g. a broadcast view)."""
    dims = sorted((abs(st), s) for s, st in zip(op.shape, op.strides) if s > 1)
    extent = 1
    for st, s in dims:
        if st < extent:
            return True
        extent += (s - 1) * st
    return False


def check_distinct(op: Operand | None) -> None:
    """A ``ValueError`` naming ``op`` (an output the caller passed) when its elements may
    share memory: writes to them would land on one another."""
    if op is not None and op.shape and min(op.shape) > 0 and overlaps_itself(op):
        raise ValueError(f"{op.name} has overlapping elements (strides {op.strides}); pass an "
                         "array whose elements are distinct")


def _memory_device(x):
    """The device a Numba device array's memory belongs to (its context's), or None."""
    ctx = getattr(getattr(x, "gpu_data", None), "context", None)
    return getattr(getattr(ctx, "device", None), "id", None)


def _numba_device(x):
    """The device a Numba device array's memory belongs to, else the current one."""
    dev = _memory_device(x)
    if dev is not None:
        return int(dev)
    try:
        return devices.current_id()
    except Exception:  # noqa: BLE001
        return None


def _pointer(op: Operand) -> int:
    x = op.raw
    if op.family == "torch":
        return x.data_ptr()
    if op.family == "cupy":
        return x.data.ptr
    if op.family == "numba":
        if SIMULATOR:
            return x._ary.ctypes.data
        return x.__cuda_array_interface__["data"][0]
    return x.ctypes.data


def same_device(*ops: Operand) -> int | None:
    devices = {op.device for op in ops if op is not None and op.device is not None}
    families = {op.family for op in ops if op is not None}
    if len(devices) > 1:
        raise ValueError("inputs are on different devices: " + ", ".join(
            f"{op.name} on cuda:{op.device}" for op in ops if op is not None))
    if len(families) > 1:
        raise TypeError("inputs mix array kinds: " + ", ".join(
            f"{op.name} is {op.family}" for op in ops if op is not None))
    return devices.pop() if devices else None


def kernel_view(op: Operand, ndim: int | None = None, swap_last: bool = False):
    """The operand as a kernel argument (no copy): uint16 bits for 16-bit types.

    With ``ndim`` larger than the operand's, leading axes of length 1 are added (stride 0);
    ``swap_last`` swaps the last two axes (a transposed view). In the simulator the NumPy view
    is wrapped as a simulator device array, so the kernel works on the caller's memory itself
    (the simulator would otherwise copy, and refuse non-contiguous views).
    """
    view = raw_view(op)
    while ndim is not None and len(view.shape) < ndim:
        view = restride(view, (1,) + tuple(view.shape), (0,) + tuple(view.strides))
    if swap_last:
        shape, strides = list(view.shape), list(view.strides)
        shape[-1], shape[-2] = shape[-2], shape[-1]
        strides[-1], strides[-2] = strides[-2], strides[-1]
        view = restride(view, tuple(shape), tuple(strides))
    return device_view(view)


def device_view(view):
    """A kernel argument of a raw view: in the simulator a NumPy view wrapped as the
    simulator's device array (so the kernel works on that memory itself), else the (Numba
    device) view itself."""
    if isinstance(view, np.ndarray):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(view)
    return view


def restride(view, shape, strides):
    """``view`` (NumPy or Numba device array) with a new shape and byte strides, no copy."""
    if isinstance(view, np.ndarray):
        return np.lib.stride_tricks.as_strided(view, shape, strides)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape=shape, strides=strides, dtype=view.dtype, stream=view.stream,
                         gpu_data=view.gpu_data)


def word_view(view):
    """A uint8 kernel view (NumPy, the simulator's or a Numba device array) read as uint32
    words — the last axis a quarter as long, the other strides kept — or None where it cannot
    be: the last axis not contiguous or not a multiple of 4 long, another stride or the data
    pointer not a multiple of 4 bytes."""
    ary = getattr(view, "_ary", view)       # (the simulator's device array wraps NumPy)
    shape, strides = tuple(ary.shape), tuple(ary.strides)
    if not shape or (shape[-1] > 1 and strides[-1] != 1) or shape[-1] % 4 or \
            any(st % 4 for st in strides[:-1]):
        return None
    words = shape[:-1] + (shape[-1] // 4,)
    wstrides = strides[:-1] + (4,)
    if isinstance(ary, np.ndarray):
        if ary.ctypes.data % 4:
            return None
        out = ary.view(np.uint32)     # (NumPy: only the last axis need be contiguous)
        return device_view(out) if ary is not view else out
    if int(ary.device_ctypes_pointer.value or 0) % 4:
        return None
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape=words, strides=wstrides, dtype=np.dtype(np.uint32),
                         stream=ary.stream, gpu_data=ary.gpu_data)


def raw_view(op: Operand, *, hook: bool = False):
    """The operand's data as a NumPy (simulator) or Numba device array, 16-bit float types as
    uint16 bits (with ``hook``, float16 as float16: a score hook's argument), 8-bit floats as
    uint8 codes, not wrapped for
    the simulator and not reshaped (see :func:`kernel_view`)."""
    x = op.raw
    if SIMULATOR and op.family == "numba":
        x = x._ary  # the simulator's device array is a NumPy array inside
    bits = op.dtype == "bfloat16" or (op.dtype == "float16" and not hook)
    if op.dtype.startswith("float8"):   # 8-bit floats as their uint8 codes
        if op.family == "torch":
            import torch

            x = x.detach().view(torch.uint8)
            return x.numpy() if SIMULATOR else import_device_array(x)
        return x.view(np.uint8) if isinstance(x, np.ndarray) else x
    if op.family == "numpy" or isinstance(x, np.ndarray):
        return x.view(np.uint16) if bits else x
    if op.family == "torch":
        import torch

        x = x.detach()   # the array interface refuses tensors that require grad
        if bits:
            x = x.view(torch.int16)
        if SIMULATOR:   # a CPU tensor: the simulator's kernels work on its memory directly
            x = x.numpy()
            return x.view(np.uint16) if bits else x
        return import_device_array(x).view(np.uint16) if bits else import_device_array(x)
    if op.family == "cupy":
        return import_device_array(x.view(np.uint16) if bits else x)
    return x.view(np.uint16) if bits else x


def to_host(op: Operand) -> np.ndarray:
    """A NumPy copy of ``op``'s data (a small array the host must read: cumulative lengths),
    taken on the caller's current stream and waited for — a synchronisation, which callers
    avoid on hot paths and while a CUDA graph is being captured."""
    view = raw_view(op, hook=True)
    if isinstance(view, np.ndarray):
        return np.array(view)
    stream = stream_of(op)
    host = view.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return host


def import_device_array(x):
    """A Numba device array over ``x``'s memory (CUDA array interface), without synchronising.

    Numba's default (``sync=True``) waits for the stream the producer names in the interface —
    for PyTorch and CuPy the caller's current stream, which is where tilepy enqueues its own
    work, so stream order already covers it. Waiting cost every call that imports an array
    (a per-call float32 copy of a float16 bias, say) the whole of the work queued before it,
    and left the GPU idle while the host built the next call (bench/NOTES.md: fused bias +
    GELU, a float16 bias)."""
    from numba import cuda

    return cuda.as_cuda_array(x, sync=False)


def empty(like: Operand, shape, dtype: str):
    """A new array of ``like``'s family and device."""
    fam = like.family
    if fam == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.raw.device)
    if fam == "cupy":
        import cupy

        with cupy.cuda.Device(like.device):
            return cupy.empty(shape, dtype=_np_dtype(dtype))
    if fam == "numba" and dtype == "bfloat16":
        raise TypeError("Numba device arrays have no bfloat16 dtype; pass out_dtype="
                        "'float32' or use CuPy / PyTorch arrays")
    if fam == "numba":
        from numba import cuda

        return _allocated(like, lambda: cuda.device_array(shape, dtype=_np_dtype(dtype)))
    return _allocated(like, lambda: np.empty(shape, dtype=_np_dtype(dtype)))


def _allocated(like: Operand, make):
    """``make()``, a Numba (or simulator) allocation like ``like``, run on its device (Numba
    allocates on the current one); on :func:`tilepy.devices.fake`'s devices logged, and the
    new array placed on that device."""
    with devices.use(like.device, lazy=True):
        devices.note("alloc")
        x = make()
    return devices.adopt(x, like.device)


def zeros(like: Operand, shape, dtype: str):
    """A new zero-filled array of ``like``'s family and device (on the caller's current
    stream for PyTorch and CuPy)."""
    fam = like.family
    if fam == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.raw.device)
    if fam == "cupy":
        import cupy

        with cupy.cuda.Device(like.device):
            return cupy.zeros(shape, dtype=_np_dtype(dtype))
    if fam == "numba" and not SIMULATOR:
        from numba import cuda

        out = empty(like, shape, dtype)
        if out.size:
            cuda.driver.device_memset(out, 0, out.size * out.dtype.itemsize,
                                      stream=stream_of(like) or 0)
        return out
    if fam == "numba":
        from numba import cuda

        return _allocated(like, lambda: cuda.to_device(np.zeros(shape, dtype=_np_dtype(dtype))))
    return _allocated(like, lambda: np.zeros(shape, dtype=_np_dtype(dtype)))


def ones(like: Operand, shape, dtype: str = "float32"):
    """A new array of ones of ``like``'s family and device (filled on the caller's current
    stream for PyTorch and CuPy)."""
    if like.family == "numba":
        from numba import cuda

        return _allocated(like, lambda: cuda.to_device(np.ones(shape, dtype=_np_dtype(dtype))))
    x = empty(like, shape, dtype)
    if like.family == "torch":
        x.fill_(1)
    else:
        x.fill(1)
    return x


def fill(op: Operand, value: float):
    """Set every element of ``op``'s array to ``value`` (on the caller's current stream for
    PyTorch and CuPy); returns the array."""
    x = op.raw
    if op.family == "torch":
        x.fill_(value)
    elif op.family == "numba":
        x.copy_to_device(np.full(x.shape, value, x.dtype))
    else:
        x.fill(value)
    return x


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def copy_aligned(op: Operand, min_rows_align: int = 8):
    """A copy of ``op`` whose matrices are row-major with row strides a multiple of 8
    elements (16 bytes) — the slow path for layouts and alignments the kernels cannot read.
    Returns the new raw array (a view of a padded buffer with the same logical shape)."""
    x = op.raw
    *batch, rows, cols = op.shape
    padded = -(-max(cols, 1) // min_rows_align) * min_rows_align
    buf_shape = (*batch, rows, padded)
    if op.family == "torch":
        import torch

        buf = torch.zeros(buf_shape, dtype=x.dtype, device=x.device)
    elif op.family == "cupy":
        import cupy

        with cupy.cuda.Device(op.device):
            buf = cupy.zeros(buf_shape, dtype=x.dtype)
    elif op.family == "numba":
        from numba import cuda

        host = np.zeros(buf_shape, dtype=x.dtype)
        host[..., :cols] = x.copy_to_host()
        buf = _allocated(op, lambda: cuda.to_device(host))
        return buf[tuple([slice(None)] * (op.ndim - 1) + [slice(0, cols)])]
    else:
        buf = _allocated(op, lambda: np.zeros(buf_shape, dtype=x.dtype))
    buf[..., :cols] = x
    return devices.adopt(buf[..., :cols], op.device)


def zeros_like_matrix(op: Operand, rows: int, cols: int):
    """A zero array of ``op``'s family, dtype, device and batch, with matrices rows × cols."""
    shape = (*op.shape[:-2], rows, cols)
    x = op.raw
    if op.family == "torch":
        import torch

        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    if op.family == "cupy":
        import cupy

        with cupy.cuda.Device(op.device):
            return cupy.zeros(shape, dtype=x.dtype)
    if op.family == "numba":
        from numba import cuda

        return _allocated(op, lambda: cuda.to_device(np.zeros(shape, dtype=x.dtype)))
    return _allocated(op, lambda: np.zeros(shape, dtype=x.dtype))


def on_device(device):
    """Context in which an op works on ``device`` (its inputs' GPU): :func:`tilepy.devices.use`;
    nothing changes for ``None`` (inputs that name no device)."""
    return devices.use(device)


_PLACEHOLDERS: dict = {}


def placeholder(ndim: int, dtype: str = "float32"):
    """An array of ``ndim`` ones-sized axes (``dtype``: float32 or int32) for a kernel argument
    the kernel never touches (no bias, no LSE, no split-K scratch): made once per device, not
    per call (an allocation per call costs a cuMemAlloc on the host path); in the simulator a
    fresh simulator array."""
    shape = (1,) * ndim
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.zeros(shape, dtype))
    from numba import cuda

    key = (devices.current_id(), ndim, dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = cuda.device_array(shape, dtype)
    return _PLACEHOLDERS[key]


def stream_of(op: Operand):
    """The caller's current stream on ``op``'s device, as a Numba stream (0 in the simulator)."""
    if op.family == "numpy" or SIMULATOR:
        return 0
    from numba import cuda

    if op.family == "torch":
        import torch

        return cuda.external_stream(torch.cuda.current_stream(op.raw.device).cuda_stream)
    if op.family == "cupy":
        import cupy

        with cupy.cuda.Device(op.device):
            return cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    return cuda.default_stream()


# ---- the per-call fast path: signatures, pointers, streams, allocation ---------------------

_FAMILY_OF_TYPE: dict = {}


def fingerprint(x):
    """``(signature, data pointer)`` of a user array, cheaply: the signature holds everything
    validation and kernel views depend on (kind, dtype, shape, strides, device, 16-byte
    alignment), so two arrays with equal signatures can share a launch plan. ``None`` stands
    for an absent argument; an unknown kind gives a signature no plan was made for."""
    if x is None:
        return None, 0
    t = type(x)
    fam = _FAMILY_OF_TYPE.get(t)
    if fam is None:
        fam = _FAMILY_OF_TYPE[t] = _family(x)
    if fam == "torch":
        p = x.data_ptr()
        return (t, x.dtype, x.shape, x.stride(), x.get_device(), p & 15), p
    if fam == "cupy":
        p = x.data.ptr
        return (t, x.dtype, x.shape, x.strides, x.data.device_id, p & 15), p
    if fam == "numba" and SIMULATOR:
        x = x._ary
    if fam in ("numba", "numpy"):
        if isinstance(x, np.ndarray):   # the simulator's: a device only on fake devices
            return (t, x.dtype, x.shape, x.strides, devices.array_device(x),
                    x.ctypes.data & 15), x.ctypes.data
        p = int(x.device_ctypes_pointer.value or 0)
        return (t, x.dtype, x.shape, x.strides, _memory_device(x), p & 15), p
    return (t, id(x)), 0


def stream_handle(op: Operand) -> int:
    """The caller's current stream on ``op``'s device as a raw handle (0: the legacy default
    stream; always 0 in the simulator)."""
    return int(stream_getter(op)())


def stream_getter(op: Operand):
    """A function of no arguments returning :func:`stream_handle` for ``op``'s family and
    device (what a cached launch plan calls per call)."""
    dev = op.device
    if op.family in ("numpy", "numba") or SIMULATOR:
        return lambda: 0
    if op.family == "torch":
        import torch

        get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if get is not None:
            return lambda: get(dev)
        return lambda: torch.cuda.current_stream(dev).cuda_stream
    import cupy

    def cupy_stream():
        with cupy.cuda.Device(dev):
            return cupy.cuda.get_current_stream().ptr

    return cupy_stream


def _maker(like: Operand, dtype: str):
    """``make(shape) -> (array, data pointer)``: a new array of ``dtype`` like :func:`empty`
    would make (``like``'s family and device, through that family's own allocator). It holds
    no reference to ``like``'s array (launch plans keep these as long as they live)."""
    if like.family == "torch":
        import torch

        tdt, dev = getattr(torch, dtype), like.raw.device

        def torch_make(shape):
            y = torch.empty(shape, dtype=tdt, device=dev)
            return y, y.data_ptr()

        return torch_make

    light = dataclasses.replace(like, raw=None)   # empty() reads family and device only

    def make(shape):
        y = empty(light, shape, dtype)
        return y, fingerprint(y)[1]

    return make


def allocator(like: Operand, shape, dtype: str):
    """A function of no arguments returning ``(array, data pointer)``: a new array like
    :func:`empty` would make (``like``'s family and device). It holds no reference to
    ``like``'s array (launch plans keep allocators as long as they live)."""
    return functools.partial(_maker(like, dtype), tuple(shape))


def byte_allocator(like: Operand):
    """A function ``alloc(nbytes) -> (array, data pointer)`` making a new uint8 array of
    ``nbytes`` of ``like``'s family and device through that family's own allocator (PyTorch's
    caching allocator, CuPy's memory pool — inside a CUDA-graph capture, the graph's pool). What
    launch plans allocate their tensor maps and tile counters with
    (:mod:`tilepy.tile.device_write`); it holds no reference to ``like``'s array."""
    make = _maker(like, "uint8")
    return lambda nbytes: make((int(nbytes),))
