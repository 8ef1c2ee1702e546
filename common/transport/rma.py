"""One-sided UCX RMA (put/get into a peer's registered memory) for objects ucxx created.

ucxx 0.52's Python layer has no memory handles, remote keys, put or get, but the UCP context
it makes has ``UCP_FEATURE_RMA`` on and its low-level objects expose their raw handles as
integers (``UCXContext.handle``, ``UCXWorker.handle``, ``UCXEndpoint.handle``). This module
calls the UCP C API on those handles through :mod:`ctypes`, on the very ``libucp`` ucxx loaded
(found in ``/proc/self/maps`` and opened with ``RTLD_NOLOAD``: a second copy of UCX in the
process would have its own globals and could not understand ucxx's handles).

Measured on the loopback hosts (UCX 1.21, ``UCX_PROTO_INFO=y``): on a listener /
``create_endpoint`` endpoint with error handling on (dualpath's links, ``TLS=tcp,sm,self``)
put is "zero-copy" over tcp/lo (``UCX_TCP_PUT_ENABLE=n`` turns it into active-message
emulation over shared memory) and get is "software emulation" over sysv; without error
handling RMA is zero-copy over cma. Either way the *target's* worker must be progressed for
puts/gets to complete: this is not NIC-offloaded RMA here.

Rules for callers:

* Nothing here progresses a worker: the caller runs ``worker.progress()`` between
  :meth:`Request.done` polls. Requests carry no callbacks (``op_attr_mask = 0``), so UCX never
  calls into Python from one of its threads.
* Call everything from the thread that progresses the worker owning the endpoint.
* Close :class:`RemoteRegion` before its worker is destroyed and :class:`LocalRegion` before its
  context is (there is no ``__del__``: after ucxx freed the worker/context it would crash).
* A put's source / a get's destination must stay alive until its request is done (or the
  endpoint is closed): a request freed in flight is completed by UCX internally, later.

Struct layouts follow the UCX 1.21 headers (``ucp/api/ucp.h``, ``ucs/type/status.h``); note
``ucs_status_t`` is a ``UCS_S_PACKED`` enum, i.e. one signed byte in returns and arguments.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

_LIBRARY = "libucp.so"
_UCS_OK = 0
_UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_PTR_ERR_FIRST = (1 << 64) + _UCS_ERR_LAST     # UCS_PTR_IS_ERR: (uintptr_t)ptr >= this
_MEM_MAP_FIELD_ADDRESS = 1 << 0                # UCP_MEM_MAP_PARAM_FIELD_ADDRESS
_MEM_MAP_FIELD_LENGTH = 1 << 1                 # UCP_MEM_MAP_PARAM_FIELD_LENGTH

_status_t = ctypes.c_int8                      # typedef enum {...} UCS_S_PACKED ucs_status_t


class _MemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t`` (ucp.h, UCX 1.21): 48 bytes on LP64."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),               # ucs_memory_type_t (not packed)
        ("exported_memh_buffer", ctypes.c_void_p),
    ]


class _RequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (ucp.h, UCX 1.21): 72 bytes on LP64; used all-zero."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),                     # union of callback pointers
        ("datatype", ctypes.c_uint64),               # ucp_datatype_t
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),               # ucs_memory_type_t
        ("recv_info", ctypes.c_void_p),              # union { size_t *; ucp_tag_recv_info_t * }
        ("memh", ctypes.c_void_p),
    ]


_P = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ucp_mem_map": (_status_t, [_P, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_P)]),
    "ucp_mem_unmap": (_status_t, [_P, _P]),
    "ucp_rkey_pack": (_status_t, [_P, _P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_size_t)]),
    "ucp_rkey_buffer_release": (None, [_P]),
    "ucp_ep_rkey_unpack": (_status_t, [_P, _P, ctypes.POINTER(_P)]),
    "ucp_rkey_destroy": (None, [_P]),
    "ucp_put_nbx": (_P, [_P, _P, ctypes.c_size_t, ctypes.c_uint64, _P,
                         ctypes.POINTER(_RequestParam)]),
    "ucp_get_nbx": (_P, [_P, _P, ctypes.c_size_t, ctypes.c_uint64, _P,
                         ctypes.POINTER(_RequestParam)]),
    "ucp_ep_flush_nbx": (_P, [_P, ctypes.POINTER(_RequestParam)]),
    "ucp_request_check_status": (_status_t, [_P]),
    "ucp_request_free": (None, [_P]),
    "ucs_status_string": (ctypes.c_char_p, [_status_t]),   # libucs, a dependency of libucp
}

# The only module state: the loaded library (or why it could not be), resolved once.
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _find_loaded(name: str) -> str | None:
    """Path of a mapped shared object whose file name starts with ``name``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(name):
                    return parts[5].strip()
    except OSError:
        return None
    return None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    global _lib, _lib_error
    if _lib is not None:
        return _lib, None
    path = _find_loaded(_LIBRARY)
    if path is None:   # not cached: ucxx may simply not be imported yet
        return None, f"{_LIBRARY} is not loaded in this process (import ucxx first)"
    if _lib_error is not None:
        return None, _lib_error
    try:
        # RTLD_NOLOAD: the handle of the copy already mapped, never a second one
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError as e:
        _lib_error = f"cannot open the loaded {path}: {e}"
        return None, _lib_error
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            _lib_error = f"{path} lacks the symbol {name}"
            return None, _lib_error
        fn.restype, fn.argtypes = restype, argtypes
    _lib = lib
    return lib, None


def available() -> str | None:
    """None when RMA can be used in this process, else why not.

    Needs ucxx imported (its ``libucp`` is the one used) and every UCP symbol used here.
    Whether a given context has ``UCP_FEATURE_RMA`` is not checked (ucxx's default has it).
    """
    return _load()[1]


def _ucp() -> ctypes.CDLL:
    lib, error = _load()
    if lib is None:
        raise RuntimeError(f"UCX RMA unavailable: {error}")
    return lib


class RmaError(Exception):
    """A UCX call or request ended with an error ``status`` (a negative ``ucs_status_t``)."""

    def __init__(self, status: int, what: str = "") -> None:
        self.status = status
        raw = _ucp().ucs_status_string(status)
        self.status_string = raw.decode(errors="replace") if raw else f"status {status}"
        super().__init__(f"{what}: {self.status_string}" if what else self.status_string)


def _check(status: int, what: str) -> None:
    if status != _UCS_OK:
        raise RmaError(status, what)


def _address(arr: np.ndarray, writable: bool) -> int:
    """Address of a 1-D C-contiguous uint8 array (TypeError/ValueError otherwise)."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError("expected a 1-D numpy uint8 array")
    if not arr.flags.c_contiguous:
        raise ValueError("array is not contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("array is read-only")
    return int(arr.__array_interface__["data"][0])


class Request:
    """A UCX request in flight (put, get or flush), polled with :meth:`done`.

    Holds the buffer the operation reads or writes until it is done or freed. Freeing one
    still in progress is allowed: UCX then completes it internally, so that buffer must stay
    alive until the endpoint is closed (the request no longer keeps it).
    """

    def __init__(self, ptr: int, keep: object, what: str) -> None:
        self._ptr: int | None = ptr
        self._keep: object = keep
        self._what = what

    def done(self) -> bool:
        """True once complete (the request is then freed); raises :class:`RmaError` if it
        completed with an error (freed as well). Only advances when the worker is progressed."""
        if self._ptr is None:
            return True
        lib = _ucp()
        status = int(lib.ucp_request_check_status(self._ptr))
        if status == _UCS_INPROGRESS:
            return False
        self.free()
        _check(status, self._what)
        return True

    def free(self) -> None:
        """Release the request (idempotent); see the class note on buffers in flight."""
        ptr, self._ptr = self._ptr, None
        self._keep = None
        if ptr is not None:
            _ucp().ucp_request_free(ptr)


def _request(result: int | None, keep: object, what: str) -> Request | None:
    """Decode a ``ucs_status_ptr_t``: NULL = done inline, an error code = raise, else poll."""
    if result is None or result == 0:
        return None
    if result >= _PTR_ERR_FIRST:
        raise RmaError(result - (1 << 64), what)
    return Request(result, keep, what)


class LocalRegion:
    """Memory of this process registered with a UCP context, for peers to put into/get from.

    ``rkey`` is the packed remote key to hand to a peer along with ``base`` and ``nbytes``.
    The arena is referenced while registered. :meth:`close` (``ucp_mem_unmap``) must come
    before the context is destroyed; the caller ensures no remote access is in flight then.
    """

    def __init__(self, context_handle: int, memh: int, arena: np.ndarray, rkey: bytes) -> None:
        self._context = context_handle
        self._memh: int | None = memh
        self._arena: np.ndarray | None = arena
        self.base = _address(arena, writable=True)
        self.nbytes = int(arena.nbytes)
        self.rkey = rkey

    @classmethod
    def register(cls, context_handle: int, arena: np.ndarray) -> LocalRegion:
        """Register ``arena`` (1-D contiguous, writable uint8) with the context
        (``ucp_mem_map`` of the existing memory) and pack its remote key."""
        lib = _ucp()
        params = _MemMapParams(field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH,
                               address=_address(arena, writable=True), length=arena.nbytes)
        memh = ctypes.c_void_p()
        _check(lib.ucp_mem_map(context_handle, ctypes.byref(params), ctypes.byref(memh)),
               "ucp_mem_map")
        assert memh.value is not None
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        status = lib.ucp_rkey_pack(context_handle, memh, ctypes.byref(buf), ctypes.byref(size))
        if status != _UCS_OK:
            lib.ucp_mem_unmap(context_handle, memh)
            raise RmaError(status, "ucp_rkey_pack")
        try:
            rkey = ctypes.string_at(buf.value or 0, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buf)
        return cls(context_handle, memh.value, arena, rkey)

    def close(self) -> None:
        """Unregister (idempotent)."""
        memh, self._memh = self._memh, None
        if memh is not None:
            self._arena = None
            _check(_ucp().ucp_mem_unmap(self._context, memh), "ucp_mem_unmap")

    def __enter__(self) -> LocalRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteRegion:
    """A peer's registered memory as seen through one endpoint (an unpacked remote key).

    Offsets are relative to the peer's ``base`` and bounds-checked here, before UCX sees
    them. :meth:`close` (``ucp_rkey_destroy``) must come before the worker is destroyed.
    """

    def __init__(self, ep_handle: int, rkey: int, base: int, nbytes: int) -> None:
        self._ep = ep_handle
        self._rkey: int | None = rkey
        self.base, self.nbytes = base, nbytes

    @classmethod
    def unpack(cls, ep_handle: int, rkey: bytes, base: int, nbytes: int) -> RemoteRegion:
        """Unpack a peer's ``LocalRegion.rkey`` for use on the endpoint ``ep_handle``."""
        if base < 0 or nbytes < 0:
            raise ValueError("base and nbytes must be >= 0")
        lib = _ucp()
        out = ctypes.c_void_p()
        _check(lib.ucp_ep_rkey_unpack(ep_handle, rkey, ctypes.byref(out)), "ucp_ep_rkey_unpack")
        assert out.value is not None
        return cls(ep_handle, out.value, base, nbytes)

    def _target(self, offset: int, length: int) -> tuple[ctypes.CDLL, int, int]:
        if self._rkey is None:
            raise ValueError("remote region is closed")
        if offset < 0 or offset + length > self.nbytes:
            raise ValueError(f"[{offset}, {offset + length}) is outside the remote region "
                             f"of {self.nbytes} bytes")
        return _ucp(), self.base + offset, self._rkey

    def put(self, src: np.ndarray, offset: int) -> Request | None:
        """Write ``src`` at ``offset`` of the remote region (``ucp_put_nbx``). None: done
        inline (the source may be reused; remote completion still needs :func:`flush`)."""
        addr = _address(src, writable=False)
        lib, remote, rkey = self._target(offset, src.nbytes)
        param = _RequestParam()
        result = lib.ucp_put_nbx(self._ep, addr, src.nbytes, remote, rkey, ctypes.byref(param))
        return _request(result, src, "ucp_put_nbx")

    def get(self, dst: np.ndarray, offset: int) -> Request | None:
        """Read ``dst.nbytes`` from ``offset`` of the remote region into ``dst``
        (``ucp_get_nbx``); the data is there once the request is done (or None: inline)."""
        addr = _address(dst, writable=True)
        lib, remote, rkey = self._target(offset, dst.nbytes)
        param = _RequestParam()
        result = lib.ucp_get_nbx(self._ep, addr, dst.nbytes, remote, rkey, ctypes.byref(param))
        return _request(result, dst, "ucp_get_nbx")

    def close(self) -> None:
        """Destroy the unpacked key (idempotent)."""
        rkey, self._rkey = self._rkey, None
        if rkey is not None:
            _ucp().ucp_rkey_destroy(rkey)

    def __enter__(self) -> RemoteRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def flush(ep_handle: int) -> Request | None:
    """``ucp_ep_flush_nbx``: once complete, every put/get posted earlier on the endpoint is
    complete at the peer too (a put is only locally complete when its own request is)."""
    param = _RequestParam()
    return _request(_ucp().ucp_ep_flush_nbx(ep_handle, ctypes.byref(param)), None,
                    "ucp_ep_flush_nbx")
