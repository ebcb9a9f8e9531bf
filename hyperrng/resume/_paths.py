"""Where a save writes: the checkpoint's path checked (:func:`check_path`, :func:`refuse_special`) and walked
one component at a time to an open folder (:func:`open_target`), so that the save then acts by descriptor and
never follows a link that another user could have planted (:func:`_walk` says which links it follows).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

from hyperrng.errors import ArgumentTypeError, HyperRNGError, InvalidArgumentError, StorageError
from hyperrng.platforms.validate import error_gist

__all__ = [
    "Dir",
    "Target",
    "check_path",
    "name_too_long",
    "open_target",
    "os_reason",
    "refuse_special",
    "storage_error",
]

MAX_LINKS = 40
"""Symbolic links a save follows before it calls the path a loop (Linux's limit)."""

NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_PATH = getattr(os, "O_PATH", 0)
# Folders walked through: O_PATH needs only the permission to search them, as the kernel's own walk.
WALK = _DIRECTORY | NO_FOLLOW | CLOEXEC | (O_PATH or os.O_RDONLY)
READ_FOLDER = os.O_RDONLY | _DIRECTORY | NO_FOLLOW | CLOEXEC  # listed, fsynced, locked

# Whether the OS takes every path relative to an open folder that a save needs (not on Windows).
_AT = (
    bool(_DIRECTORY and NO_FOLLOW)
    and {os.open, os.mkdir, os.rename, os.unlink, os.rmdir, os.stat, os.readlink} <= os.supports_dir_fd
)


def check_path(path: object) -> str:
    """``path`` as the text the OS is given (``os.fspath``, so that a trailing ``/`` or ``/.``,
    which names a folder, is kept), refused where no file system could take it: not a ``str`` or
    ``os.PathLike`` of ``str`` (:class:`ArgumentTypeError`), a NUL character, or a character the
    file system's encoding cannot write (:class:`InvalidArgumentError`)."""
    text: object = path
    if isinstance(path, os.PathLike):
        try:
            text = os.fspath(path)
        except Exception as exc:  # noqa: BLE001 - whatever a caller's __fspath__ raises
            raise ArgumentTypeError(
                f"path {type(path).__name__} could not give its text: its __fspath__ raised {error_gist(exc)}."
            ) from None
    if not isinstance(text, str):
        raise ArgumentTypeError(
            f"path must be a str or an os.PathLike such as pathlib.Path, got {type(path).__name__} {path!r:.80}."
        )
    if "\0" in text:
        raise InvalidArgumentError(
            f"the path {_abridged(text)} holds a NUL character, which no file name can hold; remove it."
        )
    try:
        os.fsencode(text)
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"the path {_abridged(text)} cannot be written in the file system's encoding ({exc.encoding}): "
            f"{exc.object[exc.start : exc.end]!r} at position {exc.start} ({exc.reason}, such as a lone surrogate); "
            "give a path of valid characters."
        ) from None
    return text


_SEPARATORS = tuple({"/", os.sep, os.altsep or "/"})
_DOT_SEPARATORS = tuple(sep + "." for sep in _SEPARATORS)


def _names_a_folder(text: str) -> bool:
    """Whether ``text`` ends with a separator or a separator and ``.``: the name before is a folder's."""
    return text.endswith(_SEPARATORS) or text.endswith(_DOT_SEPARATORS)


def _folder_named(text: str) -> str:
    """``text`` less its trailing separators and ``.`` names: ``a/b`` for ``a/b/``, ``a/b/.``, ``a/b/./``."""
    bare = text
    while len(bare) > 1 and _names_a_folder(bare):
        bare = bare[:-1] if bare.endswith(_SEPARATORS) else bare[:-2]
    return bare or text


def _missing_folder(shown: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{shown!r} does not exist, and the path names it as a folder (a path ending in '/' names a folder); "
        "give the path of the checkpoint file, without the trailing '/'."
    )


def _not_a_folder(shown: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{shown!r} is not a folder, yet the path names it as one (a path ending in '/' names a folder); "
        "give the path of the checkpoint file, without the trailing '/'."
    )


def _abridged(text: str) -> str:
    """``text`` for a message: its ``repr``, its middle left out when long."""
    return repr(text) if len(text) <= 100 else f"{text[:60]!r}...{text[-30:]!r}"


def name_too_long(path: str) -> InvalidArgumentError:
    """The refusal of a path the file system found too long (``ENAMETOOLONG``)."""
    longest = max((len(os.fsencode(part)) for part in path.split(os.sep)), default=0)
    return InvalidArgumentError(
        f"the path {_abridged(path)} is longer than the file system allows (its longest name has {longest} bytes; "
        "most file systems take 255 per name); give a shorter name."
    )


def refuse_special(target: str | os.PathLike[str], verb: str, mode: int | None = None) -> None:
    """Refuse ``target`` where it exists and is not a regular file (a device such as ``/dev/null``, a FIFO,
    a socket): a save would replace it with a file, a load of a FIFO would wait forever. ``mode``: its
    ``st_mode`` when already known, else read following links."""
    text = os.fspath(target)
    if mode is None:
        try:
            mode = os.stat(text).st_mode
        except (OSError, ValueError):  # missing, unreadable or unnamable: the save or load itself says why
            if _names_a_folder(text):  # "file/": is the file a folder?
                bare = _folder_named(text)
                try:
                    named = os.stat(bare).st_mode
                except (OSError, ValueError):
                    return
                if not stat.S_ISDIR(named):
                    raise _not_a_folder(bare) from None
            return
    if not stat.S_ISREG(mode):
        kinds = {stat.S_ISDIR: "a folder", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}
        kinds.update({stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"})
        kind = next((what for test, what in kinds.items() if test(mode)), None)
        what = f"is {kind}, not a regular file" if kind else "is not a regular file"
        raise InvalidArgumentError(f"{text!r} {what}: hyperrng will not {verb} it. Give the path of a checkpoint file.")


def os_reason(exc: OSError) -> tuple[int, str]:
    """The errno of a file system's refusal (``EIO`` when it gives none) and its words."""
    code = exc.errno if exc.errno is not None else errno.EIO
    return code, exc.strerror or str(exc) or os.strerror(code)


def storage_error(exc: OSError, target: str, what: str, *, kept: bool = True) -> StorageError:
    code, reason = os_reason(exc)
    hint = {
        errno.ENOSPC: "free space on that file system or save elsewhere",
        errno.EDQUOT: "free space within your quota or save elsewhere",
        errno.EACCES: "make its folder writable for this user or save elsewhere",
        errno.EPERM: "make its folder writable for this user or save elsewhere",
        errno.EROFS: "save to a writable file system",
    }.get(code, "check the file system, then save again")
    outcome = "it is as it was" if kept else "it holds the new checkpoint, which a crash now may undo"
    return StorageError(code, f"could not {what} {target!r} ({reason}): {hint}; {outcome}", target)


# -- the walk -------------------------------------------------------------------------------------
class Dir:
    """A folder: an open descriptor, every name looked up in that very folder wherever its path now
    leads (``fd`` ``None`` where the OS cannot: then by its path, on Windows)."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int | None, path: str) -> None:
        self.fd, self.path = fd, path

    def at(self, name: str) -> str:
        """What to pass with ``dir_fd=self.fd`` for ``name`` in this folder."""
        return name if self.fd is not None else os.path.join(self.path, name)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class Target(NamedTuple):
    folder: Dir  # open for reading: listed, fsynced
    name: str  # the file's name in it
    shown: str  # its path, for messages
    mode: int | None  # the permission bits kept from the file replaced (None: a new file's, see _kept_mode)


def _parts(text: str) -> list[str]:
    """The names a walk of ``text`` visits; a last ``"."`` where it must end at a folder (``a/``)."""
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if not parts or text.endswith(("/", "/.")):
        parts.append(".")
    return parts


def open_target(path: str) -> Target:
    """Walk ``path`` (see :func:`_walk`) to the folder that holds the file a save replaces."""
    if not _AT:
        return _open_target_by_path(path)
    try:
        return _walk(path)
    except OSError as exc:
        if isinstance(exc, HyperRNGError):
            raise
        if exc.errno == errno.ENAMETOOLONG:
            raise name_too_long(path) from None
        if exc.errno == errno.ELOOP:
            raise InvalidArgumentError(f"{path!r} is a symbolic link that loops; point it at a file.") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # a folder removed or replaced while the walk passed
            raise InvalidArgumentError(f"the folder of {path!r} does not exist; create it before saving.") from None
        raise storage_error(exc, path, "save the checkpoint to") from exc


def _walk(path: str) -> Target:
    """A link is followed only where no other user could have put it.

    A save walks the path
        itself, one component at a time, each folder opened relative to the one before with
        ``O_NOFOLLOW``, and then works relative to the open folder that holds the checkpoint: it
        creates, renames, deletes and re-checks by descriptor (``openat``, ``renameat``, ``unlinkat``),
        never by resolving a path a second time, so a link swapped in while it runs redirects nothing.
        Where the walk meets a symbolic link it reads it and goes on from the link's folder (at most
        :data:`MAX_LINKS` links, as the kernel) if this process's effective user or root owns the link,
        or if the folder holding it is this user's or root's and no one else may write to it (no write
        bit for group or others: only they could have put it there, or copied it there with its owner).
        Any other link is refused (:class:`~hyperrng.errors.StorageError`, ``EACCES``): another user's
        link in their own folder, in a shared sticky folder (``/tmp``), or in a folder others may write
        to, since its owner could point the save at any file this user may write (as root, any file).
        That is stricter than the kernel, which as root follows a link of the folder's owner, and outside
        sticky world-writable folders any link. A link the user made is followed: ``latest.pt ->
        step100.pt`` keeps the link and replaces ``step100.pt`` in its own folder. (A load opens its path
        as the kernel resolves it.)
    """
    absolute = path.startswith("/")
    cur = os.open("/" if absolute else ".", WALK)
    shown = "/" if absolute else ""
    parts, links = _parts(path), 0
    try:
        while True:
            name = parts.pop(0)
            here = os.path.join(shown, name)
            if name in (".", ".."):
                if not parts:
                    it = (shown or ".") if name == "." else here
                    raise InvalidArgumentError(f"{it!r} is a folder; give the path of the checkpoint file to write.")
                if name == "..":
                    cur = _step(cur, os.open("..", WALK, dir_fd=cur))
                    shown = here
                continue
            try:
                st: os.stat_result | None = os.stat(name, dir_fd=cur, follow_symlinks=False)
            except FileNotFoundError:
                if parts == ["."]:  # "sub/": named as a folder
                    raise _missing_folder(here) from None
                if parts:
                    raise InvalidArgumentError(
                        f"the folder of {path!r} does not exist ({here!r} is missing); create it before saving."
                    ) from None
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise InvalidArgumentError(f"{path!r} is a symbolic link that loops; point it at a file.")
                text = os.readlink(name, dir_fd=cur)
                _refuse_planted(cur, st, here, text)
                if text.startswith("/"):
                    cur, shown = _step(cur, os.open("/", WALK)), "/"
                parts = _parts(text) + parts
                continue
            if not parts:
                if st is not None and stat.S_ISDIR(st.st_mode):
                    raise InvalidArgumentError(f"{here!r} is a folder; give the path of the checkpoint file to write.")
                if st is not None:
                    refuse_special(here, "replace", st.st_mode)
                folder = Dir(os.open(".", READ_FOLDER, dir_fd=cur), shown or ".")
                return Target(folder, name, here, _kept_mode(st))
            if not stat.S_ISDIR(st.st_mode):  # type: ignore[union-attr]
                if parts == ["."]:  # "file/" or "file/.": never the file itself
                    raise _not_a_folder(here)
                raise InvalidArgumentError(
                    f"the folder of {path!r} does not exist ({here!r} is not a folder); create it before saving."
                )
            cur = _step(cur, os.open(name, WALK, dir_fd=cur))
            shown = here
    finally:
        os.close(cur)


def _kept_mode(replaced: os.stat_result | None) -> int | None:
    """The permission bits the new checkpoint takes over from the file it replaces: its read, write
    and execute bits where this effective user owns it (never setuid, setgid or sticky); ``None``
    (those of a new file) where there is none or another user owns it, whose bits say what that
    user allowed, not what the new file of this user should allow."""
    if replaced is None:
        return None
    euid = os.geteuid() if hasattr(os, "geteuid") else None
    if euid is not None and replaced.st_uid != euid:
        return None
    return stat.S_IMODE(replaced.st_mode) & 0o777


def _step(old: int, new: int) -> int:
    os.close(old)
    return new


def _refuse_planted(folder_fd: int, link: os.stat_result, shown: str, text: str) -> None:
    """Refuse a link that another user could have put where it is: followed only where this
    effective user or root owns it, or where its folder is this user's or root's and no one else
    may write to it (then only they could have put it there, or copied it there, owner and all)."""
    euid = os.geteuid()
    if link.st_uid in (euid, 0):
        return
    folder = os.fstat(folder_fd)
    others_write = folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if folder.st_uid in (euid, 0) and not others_write:
        return
    if folder.st_uid == link.st_uid:
        where = "in that user's folder"
    elif folder.st_uid not in (euid, 0):
        where = f"in a folder of another user's (uid {folder.st_uid})"
    elif folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH:
        where = "in a folder anyone may write to (sticky and world-writable, such as /tmp)"
    else:
        where = "in a folder other users may write to"
    raise StorageError(
        errno.EACCES,
        f"{shown!r} is a symbolic link that another user (uid {link.st_uid}) owns, {where}: hyperrng does not "
        f"follow it, since that user could point it at any file you may write. Save to the file it names "
        f"({_abridged(text)}) by its own path, or remove the link",
        shown,
    )


def _open_target_by_path(path: str) -> Target:
    """Where the OS takes no paths relative to a folder: links resolved with ``realpath``."""
    target = Path(path)
    if _names_a_folder(path):  # Path() drops a trailing separator: "file/" must not replace "file"
        if target.is_dir():
            raise InvalidArgumentError(f"{str(target)!r} is a folder; give the path of the checkpoint file to write.")
        raise _not_a_folder(str(target)) if target.exists() else _missing_folder(str(target))
    if target.is_symlink():
        resolved = Path(os.path.realpath(target))
        if resolved.is_symlink():
            raise InvalidArgumentError(f"{path!r} is a symbolic link that loops; point it at a file.")
        target = resolved
    if target.is_dir():
        raise InvalidArgumentError(f"{str(target)!r} is a folder; give the path of the checkpoint file to write.")
    refuse_special(target, "replace")
    if not target.parent.is_dir():
        raise InvalidArgumentError(f"the folder of {str(target)!r} does not exist; create it before saving.")
    try:
        mode = _kept_mode(target.stat())
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise name_too_long(path) from None
        raise storage_error(exc, str(target), "read the permission bits of") from exc
    return Target(Dir(None, str(target.parent)), target.name, str(target), mode)
