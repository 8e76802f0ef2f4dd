"""Write a file so that its final name only ever holds a complete file."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Run ``write(tmp)`` on a fresh file next to ``path``, then rename it to ``path``.

    The temporary file lives in the same directory (so ``os.replace`` is an atomic rename on
    one file system), is flushed to disk before the rename, and is removed if anything fails,
    also on ``KeyboardInterrupt``. A file already at ``path`` is untouched unless the whole
    write succeeds.
    """
    final = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(final)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save to {final!r}: directory {directory!r} does not exist")
    if os.path.isdir(final):
        raise IsADirectoryError(f"cannot save to {final!r}: it is a directory")
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never clobber someone else's file; 0o666 lets the umask decide, like open().
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(temporary)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    except BaseException:
        try:
            os.remove(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
