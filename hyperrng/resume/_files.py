"""Checkpoint files on disk: the save behind :func:`hyperrng.save_rng_state`. It walks the path to an open
folder (:mod:`hyperrng.resume._paths`), writes into a private folder of its own beside the checkpoint
(:class:`_Work`), checks that the file reads back as a load would read it, renames it over the checkpoint,
and then removes the private folders that killed saves left (:func:`_remove_abandoned`: which, and why that
never harms a live save). A signal's exception comes out as itself
(:class:`~hyperrng._guard.interrupts.SignalExceptions`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import re
import secrets
import stat
import sys
from collections.abc import Mapping
from typing import Any

import torch

from hyperrng._guard.interrupts import SignalExceptions, deferred
from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, StorageError
from hyperrng.platforms.validate import error_gist
from hyperrng.resume._paths import (
    CLOEXEC,
    NO_FOLLOW,
    O_PATH,
    READ_FOLDER,
    WALK,
    Dir,
    Target,
    check_path,
    open_target,
    os_reason,
    storage_error,
)
from hyperrng.resume._untrusted import check_file

__all__ = ["save"]

WORK_PREFIX = ".hyperrng-"
WORK_SUFFIX = ".saving"
_WORK_TOKEN_BYTES = 8  # random hex in the private folder's name: concurrent saves never share one
_DATA_NAME = "checkpoint"
_CREATE_ATTEMPTS = 64  # fresh names a save tries when cleaners keep taking its new folder first

LEGACY_LOCK_NAME = "lock"
LEGACY_LOCK_MAGIC = b"hyperrng save_rng_state: a save in progress while this file is locked\n"
"""What an earlier release wrote in the ``lock`` file of its private folders."""
LEGACY_GRACE_NS = 600 * 10**9
"""How much older than a save's own rename (by the file system's clock) an earlier release's folder
must be for that save to remove it while it holds nothing, or only an empty ``lock`` file: an earlier
release's save goes from ``mkdir`` to locking that file within microseconds, so such a folder is a
killed save's, unless its save was stopped in between (then it fails, and its checkpoint stays)."""

# What torch's writer raises when a write fails (a full disk, an I/O error): a RuntimeError.
_WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "cannot be opened")

_BINARY = getattr(os, "O_BINARY", 0)
# An earlier release's lock file: read and locked, opened without waiting whatever it is (a FIFO, a tty).
_READ_LEGACY_LOCK = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | NO_FOLLOW | CLOEXEC

# Whether /proc/self/fd/<n> names an open descriptor (Linux): torch then writes and maps by that path.
_PROC_FD = sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")


# -- the save -------------------------------------------------------------------------------------
def save(path: object, state: object) -> None:
    """:func:`hyperrng.save_rng_state` (documented there)."""
    with SignalExceptions():
        text = check_path(path)  # as given: a trailing '/' names a folder
        if not isinstance(state, Mapping):
            raise ArgumentTypeError(
                f"save_rng_state writes the dict rng_state_dict() returned, got {type(state).__name__}."
            )
        target = None
        try:
            with deferred():  # every descriptor opened is recorded before a signal can raise
                target = open_target(text)
            _save(target, state)
        finally:  # one call into C: no Python frame for a signal to raise in before the descriptor is closed
            if target is not None and target.folder.fd is not None:
                os.close(target.folder.fd)


def _save(target: Target, state: Mapping[str, Any]) -> None:
    work = _Work(target.folder, target.shown)
    replaced = False
    try:
        with deferred():
            work.create(target.mode)
        _write(state, work, target.shown)  # torch writes by a path: interruptible at any point
        with deferred():
            work.seal()
        _check_loads(work, target.shown)
        with deferred():
            work.replace(target.name)
            replaced = True
            _fsync_folder(target.folder)
            work.remove()
    except BaseException as exc:
        with deferred():
            work.remove()
        if isinstance(exc, OSError) and not isinstance(exc, HyperRNGError):
            if replaced:  # the new checkpoint is in place; only its rename's durability failed
                what, kept = "make durable the rename of the new checkpoint to", False
            else:
                what, kept = "save the checkpoint to", True
            raise storage_error(exc, target.shown, what, kept=kept) from exc
        raise
    _remove_abandoned(target.folder, target.name)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class _Replaced(Exception):
    """The private folder's name leads to something else than the folder this save's ``mkdir`` made."""


class _Work:
    """One save's private folder: created, sealed and removed under deferred signals, each step
    recorded as it is made, so an exception at any point leaves nothing behind once :meth:`remove`
    has run (a process killed leaves it for the next save: see :func:`_remove_abandoned`).

    A save writes into a folder of its own beside the checkpoint,
    ``.hyperrng-<16 hex digits>.saving`` (the same length whatever the checkpoint's name, so every
    name the file system accepts can be saved), mode 0700 (given on the folder's descriptor where the
    umask took some of ``mkdir``'s bits), holding one file, ``checkpoint``, renamed over the
    checkpoint at the end. The save holds an OS lock (``flock``) on the folder itself, taken on the
    folder's own descriptor; the OS drops it when the process ends, however it ends, in any PID
    namespace, container or host that shares the folder with working locks. It holds the folder only
    once it has checked, lock taken, that the folder is the one its ``mkdir`` made (the same device
    and inode as right after ``mkdir``, this user's, empty, no bits for others), so a folder another
    user renames over the new one is never written, changed or removed; a save that cannot hold its
    folder for another reason than a cleaner (the file system gives it another owner, as NFS's
    ``root_squash`` or a ``uid=`` mount does; it cannot be opened) removes it where it is still the
    empty folder made, and fails at once, saying why. On failure a save removes only the
    ``checkpoint`` file it created itself (the same device and inode).
    """

    def __init__(self, folder: Dir, shown: str) -> None:
        self.folder = folder
        self.shown = shown  # the checkpoint's path, for messages
        self.name: str | None = None  # its name in ``folder``, once held
        self.dir: Dir | None = None  # the folder itself, open and locked (by its path where the OS cannot)
        self.data: int | None = None  # the checkpoint's descriptor
        self.written: os.stat_result | None = None  # the checkpoint file this save created: only it is removed
        self.mode: int | None = None  # the permission bits seal gives the checkpoint

    def create(self, replaced_mode: int | None) -> None:
        for _ in range(_CREATE_ATTEMPTS):
            name = f"{WORK_PREFIX}{secrets.token_hex(_WORK_TOKEN_BYTES)}{WORK_SUFFIX}"
            try:
                os.mkdir(self.folder.at(name), 0o700, dir_fd=self.folder.fd)
            except FileExistsError:
                continue
            if self._hold(name):
                break
        else:
            raise OSError(errno.EAGAIN, "other saves in this folder kept removing this save's new private folder")
        assert self.dir is not None
        # torch reopens the file by /proc/self/fd/<n>, which checks its permission bits: it is created
        # writable, and seal gives it its bits: those of the file it replaces, or those a new file gets.
        self.mode = replaced_mode if replaced_mode is not None else _new_file_mode()
        created = 0o600 if self.mode is not None else 0o666  # 0o666: the umask decides, as for any new file
        self.data = os.open(
            self.dir.at(_DATA_NAME),
            os.O_RDWR | os.O_CREAT | os.O_EXCL | NO_FOLLOW | CLOEXEC | _BINARY,
            created,
            dir_fd=self.dir.fd,
        )
        self.written = os.fstat(self.data)
        if self.mode is not None and stat.S_IMODE(self.written.st_mode) != created and hasattr(os, "fchmod"):
            os.fchmod(self.data, created)  # the umask took the owner's bits torch's reopening needs

    def _hold(self, name: str) -> bool:
        """Make the folder ``name``, just made, this save's: open it (its owner given every
        permission first where the umask took some from mkdir's 0700), take its lock, and check,
        lock held, that its name still leads to it and that it is the empty folder ``mkdir`` made.
        ``False`` where a cleaner removed it first (the caller makes another). Where it cannot be
        held for any other reason it raises :class:`StorageError`, having removed the folder where
        its name still leads to the empty folder made: the file system gives it another owner
        (NFS's ``root_squash``, a ``uid=`` mount), refuses to open it, or another process put
        something else in its place (then nothing is removed or changed)."""
        if self.folder.fd is None:  # no folder locks here, and no cleaner either
            self.name, self.dir = name, Dir(None, self.folder.at(name))
            return True
        parent = self.folder.fd
        try:
            made = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False  # a cleaner took the empty, unlocked folder for a dead save's
        except OSError as exc:
            raise self._cannot_hold(name, exc) from exc
        # mkdir's 0700 makes an empty folder with no bits for others: anything else was put in its place.
        if not stat.S_ISDIR(made.st_mode) or made.st_mode & 0o077 or made.st_nlink > 2:
            raise self._replaced(name)
        if made.st_uid != os.geteuid():
            self._discard(name, made)
            raise self._cannot_hold(name, None, owner=made.st_uid)
        try:
            fd = self._open(name, made)
        except FileNotFoundError:
            return False
        except _Replaced:
            raise self._replaced(name) from None
        except OSError as exc:
            self._discard(name, made)
            raise self._cannot_hold(name, exc) from exc
        try:
            if _try_lock(fd) is False:  # None: the file system has no locks, and no cleaner can take one either
                os.close(fd)
                return False
            try:
                now = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:  # a cleaner removed it while this save opened it
                os.close(fd)
                return False
            if not _same(now, made) or os.listdir(fd):
                if stat.S_IMODE(os.fstat(fd).st_mode) != stat.S_IMODE(made.st_mode):
                    os.fchmod(fd, stat.S_IMODE(made.st_mode))  # put back what _open changed: not ours
                raise _Replaced
            if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # the umask took some of mkdir's bits (and _open had no need to give them)
        except _Replaced:
            os.close(fd)
            raise self._replaced(name) from None
        except OSError as exc:
            os.close(fd)
            self._discard(name, made)
            raise self._cannot_hold(name, exc) from exc
        except BaseException:
            os.close(fd)
            raise
        self.name, self.dir = name, Dir(fd, name)
        return True

    def _open(self, name: str, made: os.stat_result) -> int:
        """The folder ``name`` of :attr:`folder`, checked to be ``made``, open for reading; first
        given mode 0700 where mkdir's 0700 less the umask left its owner without some permission
        (through ``/proc/self/fd`` on a descriptor that needs none)."""
        parent = self.folder.fd
        try:
            if stat.S_IMODE(made.st_mode) == 0o700 or not (_PROC_FD and O_PATH):
                fd = os.open(name, READ_FOLDER, dir_fd=parent)
            else:
                path = os.open(name, WALK, dir_fd=parent)
                try:
                    if not _same(os.fstat(path), made):
                        raise _Replaced
                    os.chmod(f"/proc/self/fd/{path}", 0o700)
                    fd = os.open(".", READ_FOLDER, dir_fd=path)
                finally:
                    os.close(path)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file in its place
                raise _Replaced from None
            raise
        if not _same(os.fstat(fd), made):
            os.close(fd)
            raise _Replaced
        return fd

    def _discard(self, name: str, made: os.stat_result) -> None:
        """Remove the folder ``name`` where it still is ``made`` (``rmdir`` removes it only if empty)."""
        with contextlib.suppress(OSError):
            if _same(os.stat(name, dir_fd=self.folder.fd, follow_symlinks=False), made):
                os.rmdir(name, dir_fd=self.folder.fd)

    def _replaced(self, name: str) -> StorageError:
        return StorageError(
            errno.EACCES,
            f"could not save the checkpoint to {self.shown!r}: another process put something else in place of "
            f"the save's new private folder {name!r} (nothing of it was changed): other users can rename entries "
            "in that folder. Save to a folder only you can write to; it is as it was",
            self.shown,
        )

    def _cannot_hold(self, name: str, exc: OSError | None, *, owner: int | None = None) -> StorageError:
        if exc is None:
            code = errno.EPERM
            why = (
                f"the file system gives the folders this process makes there to uid {owner}, not to its effective "
                f"uid {os.geteuid()} (NFS with root_squash, a mount with a uid= option), so a save cannot tell its "
                "private folder from another user's. Save to a file system that keeps its owner, or as that user"
            )
        else:
            code, reason = os_reason(exc)
            why = f"{reason}. Make the folder readable and writable for this user, or save elsewhere"
        return StorageError(
            code,
            f"could not save the checkpoint to {self.shown!r}: the save's new private folder {name!r} could not be "
            f"held ({why}); it was removed, and the checkpoint is as it was",
            self.shown,
        )

    def seal(self) -> None:
        """Give the checkpoint its permission bits and flush it to disk, through its descriptor."""
        assert self.data is not None and self.dir is not None
        if self.mode is not None:
            if hasattr(os, "fchmod"):
                os.fchmod(self.data, self.mode)
            else:  # Windows before Python 3.13: the path is inside the private folder
                os.chmod(self.dir.at(_DATA_NAME), self.mode)
        os.fsync(self.data)

    def replace(self, name: str) -> None:
        """Rename the checkpoint over ``name``, once checked to be still the file this save wrote."""
        assert self.data is not None and self.dir is not None
        here = os.stat(self.dir.at(_DATA_NAME), dir_fd=self.dir.fd, follow_symlinks=False)
        if not _same(here, os.fstat(self.data)):
            raise OSError(errno.ESTALE, "the file written in the save's private folder was replaced by another")
        os.replace(self.dir.at(_DATA_NAME), self.folder.at(name), src_dir_fd=self.dir.fd, dst_dir_fd=self.folder.fd)

    def remove(self) -> None:
        """Close and remove what :meth:`create` made (idempotent; file-system errors are ignored:
        what cannot be removed now is a dead save's folder for the next save). The checkpoint goes
        through the folder's descriptor, wherever the folder has been moved, and only where it is
        still the file this save created; the folder goes by its name only where that name still
        leads to it; the lock goes last."""
        if self.data is not None:
            fd, self.data = self.data, None
            with contextlib.suppress(OSError):
                os.close(fd)
        work, name, written, self.dir, self.name, self.written = self.dir, self.name, self.written, None, None, None
        if work is None or name is None:
            return
        with contextlib.suppress(OSError):
            if written is not None and _same(
                os.stat(work.at(_DATA_NAME), dir_fd=work.fd, follow_symlinks=False), written
            ):
                os.unlink(work.at(_DATA_NAME), dir_fd=work.fd)
        with contextlib.suppress(OSError):
            if work.fd is None or _same(os.fstat(work.fd), os.stat(name, dir_fd=self.folder.fd, follow_symlinks=False)):
                os.rmdir(self.folder.at(name), dir_fd=self.folder.fd)
        with contextlib.suppress(OSError):
            work.close()


def _new_file_mode() -> int | None:
    """The permission bits a new file gets (0o666 less the umask), read without changing the umask
    (which no thread can do safely), where ``/proc/self/status`` tells it; else ``None``."""
    if not _PROC_FD:
        return None
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _write(state: Mapping[str, Any], work: _Work, target: str) -> None:
    """Write ``state`` into the private folder's ``checkpoint``. torch writes the file through its own path
    (``/proc/self/fd/<n>``, which leads to the descriptor the save created, and is ASCII whatever the folder's
    name): torch's writer writes a path itself, but goes through a Python file object for any other name or
    for a file object, where a signal's exception raised inside a write turned into a ``RuntimeError``.
    Where ``/proc/self/fd`` is missing (macOS), torch writes through a file object on the descriptor, and the
    read-back check reads the file rather than mapping it. (Where the OS takes no paths relative to a folder's
    descriptor, Windows, a save works through paths, follows links with ``realpath``, and removes no leftover
    folders: it cannot lock a folder there.)"""
    assert work.data is not None
    try:
        if _PROC_FD:
            torch.save(dict(state), f"/proc/self/fd/{work.data}")
        else:
            with deferred():  # the descriptor is recorded before a signal can raise
                file = io.FileIO(os.dup(work.data), "wb")
            torch.save(dict(state), file)
            # Closed only after a save that returned: on an exception torch's writer, alive as long as the
            # traceback, writes its end when it goes (into a closed file, it would abort the process).
            file.close()
    except HyperRNGError:  # one of hyperrng's objects refused (a ValueError, an OSError): as it is
        raise
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, NotImplementedError) as exc:
        raise _cannot_pickle(exc, target) from None
    except RuntimeError as exc:
        if not any(mark in str(exc) for mark in _WRITER_FAILURES):  # torch's or pickle's, of an object
            raise _cannot_pickle(exc, target) from None
        # torch's writer reports no errno: a file system without free blocks or inodes was full.
        try:
            space = os.fstatvfs(work.data) if hasattr(os, "fstatvfs") else None
        except OSError:
            space = None
        full = space is not None and (space.f_bavail == 0 or space.f_favail == 0)
        code = errno.ENOSPC if full else errno.EIO
        raise storage_error(OSError(code, error_gist(exc)), target, "write the checkpoint to") from exc


def _cannot_pickle(exc: BaseException, target: str) -> ArgumentTypeError:
    """The refusal of a state that pickle or torch cannot write: an object whose ``__reduce__``
    raises, a tensor whose storage torch cannot reach (MKL-DNN's), a state nested too deeply."""
    return ArgumentTypeError(
        f"the state cannot be saved: {error_gist(exc)}; keep only plain data in it (dicts, lists, "
        f"tuples, strings, numbers, dense tensors). {target!r} is unchanged."
    )


def _check_loads(work: _Work, target: str) -> None:
    """Refuse a written file that :func:`hyperrng.load_rng_state` would refuse, before it replaces
    anything: its structure checked as the load checks it (:func:`hyperrng.resume._untrusted.check_file`,
    reading through the written descriptor), then the file loaded with ``weights_only=True`` (plain
    data only), tensors memory-mapped where torch can reopen the file by ``/proc/self/fd`` (the
    file's permission bits let its owner read it), else read through the descriptor."""
    assert work.data is not None
    by_path = _PROC_FD and (work.mode is None or work.mode & stat.S_IRUSR)
    file = None
    try:
        with deferred():  # the descriptor is recorded before a signal can raise
            file = io.FileIO(os.dup(work.data), "rb")
        try:
            check_file(file, target)  # leaves the file at its start
            if by_path:
                torch.load(f"/proc/self/fd/{work.data}", weights_only=True, mmap=True, map_location="cpu")
            else:
                torch.load(file, weights_only=True, map_location="cpu")
        except InvalidArgumentError as exc:  # beyond the load's limits: what the load refuses, and what to save instead
            raise InvalidArgumentError(
                f"the state makes a file that load_rng_state would refuse to read back, so it is not saved and "
                f"{target!r} is unchanged: {getattr(exc, 'refused', exc)}. Keep only plain data in it: dicts, lists, "
                "tuples, strings, numbers and dense tensors (a tensor of the simulated device, or of a tensor "
                "subclass, as t.cpu()), within the limits load_rng_state's documentation lists."
            ) from None
        except RuntimeError as exc:
            # torch reports an open or a mapping the OS refused (out of descriptors or address space) with
            # the errno at the end of its message: the file system's refusal, like any OSError here.
            first = str(exc).splitlines()[0] if str(exc) else ""
            # Any other: the file just written does not read back (changed under it, a failing disk).
            found = re.match(r"unable to (?:open|mmap) .*\((\d+)\)\s*$", first)
            if found is None:
                raise OSError(errno.EIO, error_gist(exc)) from exc
            code = int(found.group(1))
            raise OSError(code, os.strerror(code)) from exc
        except pickle.UnpicklingError as exc:  # weights_only's refusal; anything else passes through as itself
            # torch's weights_only refusal names the object on a later line than its first.
            reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line), error_gist(exc))
            raise InvalidArgumentError(
                f"the state holds data that load_rng_state cannot read back ({reason}); keep only plain "
                f"data in it (dicts, lists, tuples, strings, numbers, tensors). {target!r} is unchanged."
            ) from None
    finally:  # one call into C: no Python frame for a signal to raise in before the descriptor is closed
        if file is not None:
            file.close()


def _fsync_folder(folder: Dir) -> None:
    """Make a rename in ``folder`` durable; Windows cannot open a folder, and needs no such step."""
    if folder.fd is not None:
        os.fsync(folder.fd)
    elif os.name != "nt":
        fd = os.open(folder.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- what killed saves leave ----------------------------------------------------------------------
def _try_lock(fd: int) -> bool | None:
    """Take an exclusive OS lock on the open file or folder ``fd`` without waiting: ``True`` if taken,
    ``False`` if another process holds it, ``None`` if the file system offers no locks."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return False if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, errno.EDEADLK) else None
    return True


def _is_work_name(entry: str, prefix: str = WORK_PREFIX) -> bool:
    token = entry[len(prefix) : -len(WORK_SUFFIX)]
    return (
        entry.startswith(prefix)
        and entry.endswith(WORK_SUFFIX)
        and len(token) == 2 * _WORK_TOKEN_BYTES
        and all(c in "0123456789abcdef" for c in token)
    )


def _others_can_rename(folder: os.stat_result) -> bool:
    """Whether users other than this effective user and root can rename entries of ``folder``: it is
    another user's, or writable by its group or by others without being sticky. There a folder shaped
    like a dead save's may be one of this user's that another renamed to that name."""
    if folder.st_uid not in (os.geteuid(), 0):
        return True
    return bool(folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) and not folder.st_mode & stat.S_ISVTX


def _remove_abandoned(folder: Dir, name: str) -> None:
    """Remove the private folders that saves left when they died, in ``folder``.

    After a successful save,
    in a folder where no other user can rename entries (one this user or root owns, with no write
    bit for group or others unless it is sticky), the save removes every folder of that name
    pattern in the checkpoint's folder (those of other checkpoints too) that it can open without
    following a link, whose lock it can take, that is owned by this effective user with no
    permission bits for group or others, and that holds nothing but a ``checkpoint`` file. Where
    other users can rename entries, one of them could give a folder of this user's that name, and
    nothing is removed. The invariant that makes this safe:

    * a save writes into its folder only while it holds the folder's lock, having checked, after
      taking the lock, that the folder's name still leads to the folder it holds; it keeps the
      lock until the folder is gone (it closes the descriptor after ``rmdir``);
    * a cleaner changes a folder only while it holds that folder's lock.

    So a cleaner never touches a folder while a live save holds it; and a folder that a cleaner
    locked first (in the instant between the save's ``mkdir`` and its lock, when the folder is
    empty) is one the save gives up (its lock or its check fails) for a fresh name, so a cleaner
    never makes a live save fail. Every state a killed save can leave (an empty folder, one with
    a partial or a complete ``checkpoint``) is unlocked once the process is gone and meets the
    criteria, so the next save removes it. A save also removes folders that an earlier release
    left (``.<name>.<16 hex digits>.saving``, for the checkpoint's own name) where it can take the
    lock on their ``lock`` file, a regular file (opened without waiting, whatever it is) holding
    :data:`LEGACY_LOCK_MAGIC`. An earlier release's save locked that file after creating it and
    before writing the mark, so one that is empty, or a folder without it, may be a live save of
    that release about to lock it: such a folder is removed only once it is ten minutes
    (:data:`LEGACY_GRACE_NS`) older than this save's rename, by the file system's own clock.
    """
    if folder.fd is None:  # no folder locks: nothing tells a dead save's folder from a live one
        return
    try:
        here = os.fstat(folder.fd)  # its modification time: this save's rename and rmdir, by the file system's clock
        if _others_can_rename(here):
            return
        entries = os.listdir(folder.fd)
    except OSError:
        return
    legacy = f".{name}."
    for entry in entries:
        if _is_work_name(entry):
            with deferred():
                _remove_if_dead(folder.fd, entry, legacy=None)
        elif _is_work_name(entry, legacy):
            with deferred():
                _remove_if_dead(folder.fd, entry, legacy=here.st_mtime_ns)


def _remove_if_dead(parent: int, entry: str, *, legacy: int | None) -> None:
    """Remove the folder ``entry`` of ``parent`` if a save made it and died; every step by descriptor.
    ``legacy``: for an earlier release's folder, the file system's time now (nanoseconds)."""
    try:
        fd = os.open(entry, READ_FOLDER, dir_fd=parent)
    except OSError:  # gone, a link, or not a folder
        return
    lock: int | None = None
    try:
        if _try_lock(fd) is not True:
            return  # a live save holds it, or no lock can tell
        made = os.fstat(fd)
        if made.st_uid != os.geteuid() or made.st_mode & 0o077:
            return  # not made by a save of this user (a save's folder is 0700)
        inside = set(os.listdir(fd))
        if legacy is not None:
            if LEGACY_LOCK_NAME in inside:  # opened without waiting, whatever it is (a FIFO would block a read)
                lock = os.open(LEGACY_LOCK_NAME, _READ_LEGACY_LOCK, dir_fd=fd)
                if not stat.S_ISREG(os.fstat(lock).st_mode) or _try_lock(lock) is not True:
                    return  # not a lock file, or a live save of an earlier release holds it
                mark = os.read(lock, len(LEGACY_LOCK_MAGIC) + 1)
                if mark != LEGACY_LOCK_MAGIC and (mark or legacy - made.st_mtime_ns < LEGACY_GRACE_NS):
                    return  # not the mark, or empty and young: its save may be about to lock it
            elif inside or legacy - made.st_mtime_ns < LEGACY_GRACE_NS:
                return  # empty and young: its save may be about to create its lock file
        if not inside <= ({_DATA_NAME, LEGACY_LOCK_NAME} if legacy is not None else {_DATA_NAME}):
            return  # something a save never writes: not ours to remove
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_DATA_NAME, dir_fd=fd)
        if lock is not None:
            os.unlink(LEGACY_LOCK_NAME, dir_fd=fd)
        if _same(made, os.stat(entry, dir_fd=parent, follow_symlinks=False)):
            os.rmdir(entry, dir_fd=parent)
    except OSError:
        return
    finally:
        if lock is not None:
            os.close(lock)
        os.close(fd)
