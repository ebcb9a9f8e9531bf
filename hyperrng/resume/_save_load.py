"""Saving an RNG state dict to a file and reading it back: :func:`save_rng_state` writes atomically
(through :mod:`hyperrng.resume._files`), :func:`load_rng_state` checks a file's structure
(:mod:`hyperrng.resume._untrusted`) before ``torch.load(weights_only=True)`` reads it. Both are
public as :mod:`hyperrng.resume.state`'s (and ``hyperrng``'s); this module only holds them.
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Mapping
from typing import Any

import torch

import hyperrng.resume._files as _files
from hyperrng._guard.interrupts import SignalExceptions
from hyperrng.errors import HyperRNGError, InvalidArgumentError, StorageError
from hyperrng.platforms.validate import error_gist
from hyperrng.resume._paths import check_path, name_too_long, os_reason, refuse_special
from hyperrng.resume._untrusted import check_file, unreadable

__all__ = ["save_rng_state", "load_rng_state"]

# The save's file-system work (the walk of the path, the private folder, its lock, the removal of
# what killed saves left) lives in hyperrng.resume._files; its docstring gives the scheme and its invariant.


def save_rng_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write a state from :func:`hyperrng.rng_state_dict` (or any dict of plain data, such as a training
    checkpoint holding one) to ``path``, atomically.

    The state is written by ``torch.save`` into a private folder beside ``path`` (mode 0700),
    fsynced, checked to read back with ``weights_only=True``, then renamed over ``path``, and the
    folder holding ``path`` is fsynced so the rename itself survives a crash. A process killed at
    any point therefore leaves ``path`` holding either the previous complete checkpoint or the new
    one, never a partial file. Ctrl-C (and any signal with a Python handler) is deferred across the
    steps that create, seal and rename files, so an interrupt leaves them as before or as after, and
    on any exception what the save created is closed and removed. An exception raised by a signal's
    handler during the save (a ``KeyboardInterrupt``, a watchdog's ``TimeoutError``) reaches the
    caller as itself. A file of this user's that is replaced passes on its read, write and
    execute bits (set on the open file, never through a path); setuid, setgid and sticky bits,
    and the bits of another user's file, are not passed on: the new file gets a new file's bits
    (0666 less the umask). Any name the file system accepts can be saved (up to its limit, 255
    bytes on most); a path ending in ``/`` or ``/.`` names a folder, and is refused.

    **A link is followed only where no other user could have put it.** The save opens each
    folder of the path in turn and then creates, renames and deletes relative to the open
    folder, never resolving a path a second time, so a link swapped in while it runs redirects
    nothing. Its private folder is used only once checked to be the empty folder it made, so a
    folder another user renames in its place is never written, changed or removed.

    **Symlinks.** When ``path`` is a symbolic link (``latest.pt -> step100.pt``), the link stays
    and the file it points to is replaced, atomically, in that file's folder (a link to a
    missing file creates it). A chain of links is followed to its end (40 links at most). A
    link is followed where this process's effective user or root owns it, or where the folder
    holding it is this user's or root's and no one else may write to it; any other link is
    refused (another user's link in their own folder, in a sticky shared folder such as
    ``/tmp``, or in a folder others may write to), since its owner could point the save at any
    file this user may write. That is stricter than the kernel, which as root follows the links
    of a folder's owner, and any link outside sticky world-writable folders.

    **Leftovers.** A process killed mid-save (SIGKILL, a power cut) leaves its private folder,
    ``.hyperrng-<random>.saving``. The save holds an OS lock (``flock``) on that folder for as long
    as it runs, and the OS drops the lock when the process ends, so the next successful save into
    the same folder (of any checkpoint there) removes exactly the folders whose lock it can take:
    those of saves that died, at whatever point, never one still being written, whatever PID
    namespace, container or host (on a shared file system with working locks) it runs in. It
    removes only folders of that name owned by this user with mode 0700 holding nothing but what
    a save writes, never following a link: nothing else in the folder is touched. Where other
    users can rename entries of the folder (it is another user's, or writable by group or others
    and not sticky), where the file system offers no locks, and on Windows (where a folder
    cannot be locked), nothing is removed.

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``, or
            ``state`` is not a mapping or holds something that cannot be pickled (a lambda,
            a lock, an object whose ``__reduce__`` raises, an MKL-DNN tensor, nesting deeper
            than Python's recursion limit).
        InvalidArgumentError: ``path`` holds a NUL character or a character the file system's
            encoding cannot write (a lone surrogate), or a name longer than the file system
            allows; it is a folder, a device, a FIFO or a socket (never replaced), ends in ``/``,
            its folder does not exist, or it is a link that loops; or ``state`` makes a file
            that :func:`load_rng_state` would refuse (it reads with ``weights_only=True``: dicts,
            lists, tuples, strings, numbers, dense tensors; and within its limits, checked as it
            checks them). Nothing is written when it is raised: the file is checked and read
            back, tensors memory-mapped, before it replaces ``path``.
        StorageError: the file system refused the save (a full disk or quota:
            ``errno.ENOSPC``; no permission: also a ``PermissionError``; an I/O error; new
            folders given another owner, as NFS's ``root_squash`` does), or ``path`` leads
            through a link another user could have put there, or another process put something
            in place of the save's private folder (both also a ``PermissionError``); an
            ``OSError``. What the save created is removed and ``path`` is as it was.
    """
    _files.save(path, state)


# The errnos of a read that the file system refused, as opposed to a file whose content is cut off.
_READ_FAILURES = {
    errno.EIO, errno.ETIMEDOUT, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ESTALE,
    errno.EMFILE, errno.ENFILE, errno.ENOMEM,  # out of descriptors or memory: the OS refused, the file is whole
}  # fmt: skip


def load_rng_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state written by :func:`save_rng_state`, with ``weights_only=True``.

    An exception raised by a signal's handler during the load (a ``KeyboardInterrupt``, a
    watchdog's ``TimeoutError``) reaches the caller as itself.

    **Limits.** The file's structure is checked before torch reads it
    (:mod:`hyperrng.resume._untrusted`), so any file is read or refused in time and memory bounded by
    its size (under a second per megabyte, and the file's size plus 16 MiB): a zip as
    ``torch.save`` writes it, every entry stored (not compressed) in a region of its own; a
    pickle of at most 8,192 instructions plus one per 7 bytes of file (a tensor over a storage
    another one used counts as 12 more), calling only what ``torch.save`` writes with the
    arguments it writes (no quantized, sparse or nested tensors), with dict keys and set items
    that are strings, ints below 2**61 - 1 in size, floats, bools or None (no tuples), whose
    objects fit in 16 MiB beyond the file's size, about 7,000 tensors. A checkpoint beyond these
    that you trust can be read with ``torch.load(path, weights_only=True)`` and its state passed
    to :func:`hyperrng.load_rng_state_dict`, whose own limits hold for any dict.

    A file that another user owns, or that its group or others may write, is read into memory
    once, and both checked and loaded from that copy: whoever can write it cannot change it
    between the check and the load (it then holds the file's size once more).

    Raises:
        ArgumentTypeError: ``path`` is not a ``str`` or ``os.PathLike`` of ``str``.
        InvalidArgumentError: the file is truncated, or not a torch file of plain data, or beyond
            a limit above (the message names it, and nothing was loaded); or
            ``path`` is not a regular file (a device, a FIFO, a socket), refused without waiting, or a
            symbolic link that loops;
            or it holds a NUL character, a character the file system's encoding cannot write (a
            lone surrogate), or a name longer than the file system allows.
        StorageError: the file system refused the read: no such file, or a part of ``path`` that is
            not a folder (also a ``FileNotFoundError`` or ``NotADirectoryError``), no permission
            (also a ``PermissionError``), a time-out or an I/O error; an ``OSError``.
    """
    target = check_path(path)
    with SignalExceptions():  # a signal handler's exception comes out as itself, never translated
        refuse_special(target, "read")  # a socket cannot even be opened
        try:
            # Opened without waiting (a FIFO nobody writes would block), checked to be a regular file by
            # its descriptor, and read through that descriptor: the file checked is the file read (and,
            # where another user could rewrite it meanwhile, the bytes checked are the bytes loaded).
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
            with os.fdopen(fd, "rb") as file:
                info = os.fstat(file.fileno())
                refuse_special(target, "read", info.st_mode)
                source: Any = file
                if info.st_uid != getattr(os, "geteuid", lambda: -1)() or info.st_mode & 0o022:
                    # Another user could rewrite it between the check and torch's read: both read one copy.
                    source = io.BytesIO(file.read(info.st_size))
                check_file(source, str(path))  # bounded: what torch.load would make of it, read from its structure
                loaded = torch.load(source, weights_only=True)
        except HyperRNGError:
            raise
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise name_too_long(str(path)) from None
            if exc.errno == errno.ELOOP:  # as a save says it
                raise InvalidArgumentError(
                    f"{str(path)!r} is a symbolic link that loops; point it at a file."
                ) from None
            if exc.errno not in _READ_FAILURES and not isinstance(exc, TimeoutError):  # torch's seek past a cut-off end
                raise unreadable(str(path), error_gist(exc)) from exc
            code, reason = os_reason(exc)
            raise StorageError(code, f"could not read the RNG state at {str(path)!r} ({reason})", str(path)) from exc
        except Exception as exc:
            raise unreadable(str(path), error_gist(exc)) from exc
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(f"{str(path)!r} holds a {type(loaded).__name__}, not an RNG state dict.")
    return loaded
