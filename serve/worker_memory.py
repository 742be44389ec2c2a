"""Memory a worker freed handed back to the system (the standard library only: shipped in
every archive beside its handler).

Loading a model frees much along the way (the empty float model the quantized modules
replace, buffers the loaded weights replace); glibc's allocator keeps freed heap memory for
reuse, so a worker's resident size stays near its loading peak. `malloc_trim(0)` returns
the free pages to the system."""

from __future__ import annotations

import ctypes
import ctypes.util


def return_freed_memory() -> bool:
    """glibc's `malloc_trim(0)` where the C library is glibc; whether it ran."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to do
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
