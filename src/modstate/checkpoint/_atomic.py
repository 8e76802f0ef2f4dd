"""Write a file so that its final name only ever holds a complete file.

The file is written in a temporary directory beside the final name, flushed to disk, and renamed
over the final name (``os.replace``: atomic on one file system). A temporary directory rather
than a temporary file, because the writer (safetensors) makes temporary files of its own beside
the file it writes: they land in that directory too. A failure removes the directory and raises
an ``OSError`` that keeps the errno and names the final path. A process killed outright (SIGKILL,
power loss) cannot remove it: temporary names carry the writer's host and process id, and the
next save to the same path removes those whose writer is gone.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import socket
from collections.abc import Callable

_OUT_OF_SPACE = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def write_atomically(
    path: str | os.PathLike, write: Callable[[str], None], *, function: str = "checkpoint.save"
) -> None:
    """Run ``write(tmp)`` on a fresh file next to ``path``, then rename it to ``path``.

    A file already at ``path`` is untouched unless the whole write succeeds; the temporary file is
    removed if anything fails, also on ``KeyboardInterrupt``. ``function`` names the caller in
    errors.

    Raises:
        FileNotFoundError: The directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        OSError: The write failed (a full disk: ``ENOSPC``; the file-size limit: ``EFBIG``),
            with the errno of the failure and a message naming ``path``.
    """
    final = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(final)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{function}: {final!r}: its directory {directory!r} does not exist; create it first",
        )
    if os.path.isdir(final):
        raise IsADirectoryError(
            errno.EISDIR, f"{function}: {final!r}: it is a directory; give a file name"
        )
    _remove_abandoned(directory, name)
    workspace = os.path.join(directory, _temporary_name(name))
    temporary = os.path.join(workspace, name)
    try:
        os.mkdir(workspace)  # fails if it exists: never someone else's
        try:
            # The mode open() would give (0o666 less the umask); the writer may make it 0o600.
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            mode = os.stat(temporary).st_mode & 0o777
            write(temporary)
            os.chmod(temporary, mode)
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(temporary, final)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
    except OSError as error:
        raise _naming(error, function, final) from error
    fsync_directory(directory)


def _naming(error: OSError, function: str, final: str) -> OSError:
    """``error`` as an ``OSError`` of the same errno (and subclass) whose message names ``final``."""
    if error.errno in _OUT_OF_SPACE:
        fix = "free disk space (or raise the file-size limit) and save again"
    else:
        fix = "save again once the cause is fixed"
    why = error.strerror or str(error)
    text = (
        f"{function}: {final!r}: the write failed ({why}); {fix}; the file that was there is "
        "untouched and no temporary file is left"
    )
    return OSError(error.errno, text) if error.errno is not None else OSError(text)


def _temporary_name(name: str) -> str:
    return f".{name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def _remove_abandoned(directory: str, name: str) -> None:
    """Remove the temporary directories of earlier writes to ``name`` whose writer, a process on
    this host, is gone (killed before it could clean up). Live writers' are left alone."""
    if os.name != "posix":
        return
    prefix, host = f".{name}.", socket.gethostname()
    try:
        entries = [e for e in os.listdir(directory) if e.startswith(prefix) and e.endswith(".tmp")]
    except OSError:
        return
    for entry in entries:
        parts = entry[len(prefix) : -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or _alive(int(parts[1])):
            continue
        shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fsync_directory(directory: str) -> None:
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
