"""Tensor maps for TMA, host side: describe a tensor in device memory and the box a copy moves.

A *tensor map* (``CUtensorMap``, 128 bytes) is what the copies of :mod:`tilepy.ptx.tma` read
(``tma_load_2d/3d/4d``, the stores, the multicast loads of :mod:`tilepy.ptx.cluster`): the
tensor's device address, element type, shape, byte strides, the box one copy moves into shared
memory, and the swizzle it is written with. :func:`encode_tiled` validates the description and
encodes it — with ``cuTensorMapEncodeTiled`` from ``cuda.bindings.driver`` on a GPU, in a
tilepy-private format that the twins read under the CUDA simulator — and returns a
:class:`TensorMap`, whose :meth:`~TensorMap.to_device` copy is what a kernel takes (Numba cannot
mark a kernel parameter ``__grid_constant__``; the kernel fences the global copy with
``fence_proxy_tensormap_acquire`` before its first TMA).

Maps in device memory: :func:`maps_to_device` (and :meth:`TensorMap.to_device`) put encoded
maps into a buffer from an allocation callback, :data:`MAP_ALIGN`-byte aligned, written by a
kernel launch on the given stream (:mod:`tilepy.tile.device_write`) — no pageable copy and no
allocation outside the callback, so it may run while the stream is captured into a CUDA graph.

Everything here is in NumPy order, outermost dimension first — ``shape`` (rows, cols),
``strides`` in bytes, ``box`` (box_rows, box_cols) — and knows nothing of CuPy or PyTorch: give
it a device pointer (an int), a dtype name, a shape and strides. The device-side coordinates
are in PTX order, innermost first (``x`` = column).

Rules (checked here, with the argument named): rank 1 … 5; the innermost dimension contiguous
(its stride equals the element size); the address 16-byte aligned; the other strides multiples
of 16 bytes below 2**40; every size 1 … 2**32; box sizes 1 … 256 with the box's inner row a
multiple of 16 bytes; with a swizzle, the box's inner row at most the swizzle size (32, 64 or
128 bytes). Out-of-bounds elements read as zeros.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..ptx import tma as _ptx_tma
from ..ptx.asm import SIMULATOR

SWIZZLES = (0, 32, 64, 128)
#: Alignment (bytes) of a tensor map in global memory that TMA instructions read.
MAP_ALIGN = 64

#: dtype name -> (CUtensorMapDataType member, element bytes)
DTYPES = {
    "uint8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "int8": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "float8_e4m3fn": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),   # TMA moves the bytes
    "float8_e5m2": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),
    "uint16": ("CU_TENSOR_MAP_DATA_TYPE_UINT16", 2),
    "int16": ("CU_TENSOR_MAP_DATA_TYPE_UINT16", 2),
    "float16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2),
    "bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    "uint32": ("CU_TENSOR_MAP_DATA_TYPE_UINT32", 4),
    "int32": ("CU_TENSOR_MAP_DATA_TYPE_INT32", 4),
    "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
    "uint64": ("CU_TENSOR_MAP_DATA_TYPE_UINT64", 8),
    "int64": ("CU_TENSOR_MAP_DATA_TYPE_INT64", 8),
    "float64": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT64", 8),
}


def dtype_name(dtype) -> str:
    """A dtype given as a string, a NumPy / ml_dtypes dtype or scalar type, by name."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = getattr(dtype, "name", None) or str(dtype)
    if name not in DTYPES:
        raise TypeError(f"dtype: {dtype!r} has no tensor-map type; expected one of "
                        f"{', '.join(DTYPES)}")
    return name


def _ints(name, values, rank=None):
    try:
        out = tuple(int(v) for v in values)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of integers, got {values!r}") from None
    if rank is not None and len(out) != rank:
        raise ValueError(f"{name}: expected {rank} values (one per dimension), got {len(out)}")
    return out


@dataclass(frozen=True)
class TensorMapSpec:
    """A validated tiled tensor-map description (NumPy order, outermost first)."""

    address: int
    dtype: str
    shape: tuple
    strides: tuple  # bytes
    box: tuple
    swizzle: int = 128

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def box_bytes(self) -> int:
        """Bytes one copy writes to shared memory (and completes on the mbarrier)."""
        return int(np.prod(self.box)) * self.elem_bytes

    # PTX / driver order: innermost first
    @property
    def dims(self) -> tuple:
        return tuple(reversed(self.shape))

    @property
    def box_dims(self) -> tuple:
        return tuple(reversed(self.box))

    @property
    def global_strides(self) -> tuple:
        """Byte strides of dimensions 1 … rank-1, innermost first (the driver's globalStrides)."""
        return tuple(reversed(self.strides))[1:]


def tensor_map_spec(address: int, dtype, shape, strides, box, swizzle: int = 128) -> TensorMapSpec:
    """Validate a tiled tensor-map description; see the module docstring for the rules."""
    name = dtype_name(dtype)
    esize = DTYPES[name][1]
    shape = _ints("shape", shape)
    rank = len(shape)
    if not 1 <= rank <= 5:
        raise ValueError(f"shape: a tensor map has 1 … 5 dimensions, got {rank}")
    strides = _ints("strides", strides, rank)
    box = _ints("box", box, rank)
    address = int(address)
    if address <= 0 or address % 16:
        raise ValueError(f"address: {address:#x} must be a non-null device pointer aligned to "
                         "16 bytes")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle: {swizzle!r} must be one of {SWIZZLES} (bytes)")
    for i, n in enumerate(shape):
        if not 1 <= n <= 2**32:
            raise ValueError(f"shape[{i}] is {n}; it must be 1 … 2**32")
    if strides[-1] != esize:
        raise ValueError(f"strides[-1] is {strides[-1]} bytes; the innermost dimension must be "
                         f"contiguous ({esize} bytes for {name})")
    for i, s in enumerate(strides[:-1]):
        if s <= 0 or s % 16 or s >= 2**40:
            raise ValueError(f"strides[{i}] is {s} bytes; it must be a positive multiple of 16 "
                             "below 2**40")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"box[{i}] is {b}; it must be 1 … 256")
    row = box[-1] * esize
    if row % 16:
        raise ValueError(f"box[-1] is {box[-1]} elements = {row} bytes; the box's inner row "
                         "must be a multiple of 16 bytes")
    if swizzle and row > swizzle:
        raise ValueError(f"box[-1] is {box[-1]} elements = {row} bytes; with the {swizzle}-byte "
                         f"swizzle the box's inner row must be at most {swizzle} bytes")
    return TensorMapSpec(address, name, shape, strides, box, swizzle)


@dataclass(frozen=True)
class TensorMap:
    """An encoded tensor map: its spec and its 128 bytes (``data``, uint8)."""

    spec: TensorMapSpec
    data: np.ndarray

    def to_device(self, stream=0, alloc=None):
        """A Numba device array (uint8[128], :data:`MAP_ALIGN`-byte aligned) holding the map,
        for a kernel argument (the kernel takes ``global_addr(arr, 0)`` of it): allocated with
        ``alloc`` and written on ``stream`` as :func:`maps_to_device` does."""
        return maps_to_device(self.data, stream, alloc).view((_ptx_tma.MAP_BYTES,), np.uint8)


def maps_to_device(raw, stream=0, alloc=None):
    """A :class:`tilepy.tile.device_write.DeviceBuffer` holding the encoded maps ``raw``
    (uint8, a multiple of 128 bytes: maps back to back) at a :data:`MAP_ALIGN`-byte aligned
    address: memory from ``alloc(nbytes) -> (owner, pointer)`` (default: a Numba device
    array), bytes written by writer-kernel launches enqueued on ``stream`` — so a kernel
    launched after it on the same stream reads them. Capturable (see the module docstring)."""
    from . import device_write

    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size % _ptx_tma.MAP_BYTES:
        raise ValueError(f"maps_to_device: {raw.size} bytes is not a whole number of "
                         f"{_ptx_tma.MAP_BYTES}-byte tensor maps")
    buf = device_write.allocate(alloc, raw.size, MAP_ALIGN)
    device_write.write(stream, buf.ptr, raw)
    return buf


def _driver_encode(spec: TensorMapSpec) -> bytes:
    from cuda.bindings import driver
    from numba import cuda

    cuda.current_context()  # the driver must be initialised
    swz = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[spec.swizzle]
    err, tmap = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, DTYPES[spec.dtype][0]),
        spec.rank,
        spec.address,
        [driver.cuuint64_t(d) for d in spec.dims],
        [driver.cuuint64_t(s) for s in spec.global_strides],
        [driver.cuuint32_t(b) for b in spec.box_dims],
        [driver.cuuint32_t(1)] * spec.rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swz}"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for {spec}")
    return ctypes.string_at(tmap.getPtr(), _ptx_tma.MAP_BYTES)


def encode_tiled(address: int, dtype, shape, strides, box, swizzle: int = 128) -> TensorMap:
    """Validate and encode a tiled tensor map (see the module docstring)."""
    spec = tensor_map_spec(address, dtype, shape, strides, box, swizzle)
    if SIMULATOR:
        raw = _ptx_tma.sim_encode(spec.address, spec.elem_bytes, spec.dims, spec.global_strides,
                                  spec.box_dims, spec.swizzle)
    else:
        raw = _driver_encode(spec)
    return TensorMap(spec, np.frombuffer(raw, dtype=np.uint8).copy())


__all__ = [
    "DTYPES",
    "MAP_ALIGN",
    "SWIZZLES",
    "TensorMap",
    "TensorMapSpec",
    "dtype_name",
    "encode_tiled",
    "maps_to_device",
    "tensor_map_spec",
]
