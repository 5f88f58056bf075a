"""Linux calls that Python's ``os`` and ``mmap`` modules lack, through libc.

ctypes releases the GIL for the length of each call, so threads making them run in
parallel (``mmap.madvise`` holds the GIL while the kernel works).
"""

from __future__ import annotations

import ctypes
import errno
import os

LIBC = ctypes.CDLL(None, use_errno=True)
_madvise = LIBC.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap
PAGE = os.sysconf("SC_PAGE_SIZE")


def populate_write(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) as if each were written, in one
    call: in a private file mapping, each becomes the process's own copy of the file's
    page, copied once in the kernel (no zeroed page, no fault per page in user space).

    False where the kernel cannot (before 5.14) or where a page lies past the end of a
    file that shrank (the access would raise SIGBUS): the caller reads those bytes
    another way, which reports what is missing. Other failures (no memory) raise OSError.
    """
    start = address - address % PAGE
    while True:
        if _madvise(start, address + length - start, _MADV_POPULATE_WRITE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in (errno.EINVAL, errno.EFAULT):
            return False
        raise OSError(err, os.strerror(err))
