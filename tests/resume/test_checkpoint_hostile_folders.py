"""Checkpoint files where other users and other saves get in the way: links another user planted,
or swaps while saves run, in a folder everybody shares; saves of one path in several processes at
once; what saves killed at any point leave; names at the file system's limits; and the exceptions
of signals' handlers during saves and loads.

Real processes and a real second user: ``setpriv`` runs a planter or a swapper as ``nobody`` in a
sticky world-writable folder made under /tmp (pytest's own folders are root's alone), in a folder
anyone may write to that is not sticky, or in a folder of nobody's own; SIGKILL ends savers, timers
and threads send real signals. Where the machine does not permit one of those, its
test is skipped and says why.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import hyperrng.platforms as platforms
import pytest
import torch

import hyperrng.resume._files as files
import hyperrng.resume._paths as paths
from hyperrng.errors import InvalidArgumentError, StorageError
from hyperrng.resume.state import load_rng_state, save_rng_state
from tests.resume.test_checkpoint_files import _entries, _finish, _permitted, _python, _state

NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


@pytest.fixture(autouse=True)
def _on_the_cpu() -> Iterator[None]:
    with platforms.use(platforms.CPUPlatform()):
        yield


@pytest.fixture
def as_nobody() -> tuple[str, ...]:
    """The prefix that runs a command as the user ``nobody``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("runs commands as the user nobody: needs root")
    why = _permitted(*NOBODY, "true")
    if why:
        pytest.skip(f"needs a process as the user nobody: {why}")
    return NOBODY


@pytest.fixture
def shared() -> Iterator[Path]:
    """A sticky world-writable folder, as /tmp is."""
    folder = Path(tempfile.mkdtemp(prefix="hyperrng-shared-", dir="/tmp" if os.path.isdir("/tmp") else None))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def open_to_all(shared: Path) -> Path:
    """A folder anyone may write to, not sticky: anyone may rename anything in it."""
    folder = shared / "open"
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}: {done.stderr}"


def _private_folder(path: Path, contents: dict[str, bytes]) -> Path:
    """A folder of root's alone (mode 0700) holding ``contents``: what a cleaner that followed a link
    would take for a save's."""
    path.mkdir(mode=0o700)
    for name, data in contents.items():
        (path / name).write_bytes(data)
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _work_name(token: str) -> str:
    return f"{files.WORK_PREFIX}{token:0>16}{files.WORK_SUFFIX}"


def _root_only_file(path: Path) -> Path:
    """A file only its owner (root, running the tests) may read: what a planted link points a save at."""
    path.write_bytes(b"root's own file")
    path.chmod(0o600)
    return path


# -- links another user planted in a shared folder ----------------------------------------------------


def test_a_link_another_user_planted_in_a_shared_folder_is_refused_and_the_file_it_names_unchanged(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...]
) -> None:
    # Before, the save resolved the link itself (realpath), so the kernel's protection of sticky
    # folders never saw it: root's save replaced a root-only file another user pointed it at.
    secret = _root_only_file(tmp_path / "shadow")
    link = shared / "rng.pt"
    _run(*as_nobody, "ln", "-s", str(secret), str(link))
    with pytest.raises(PermissionError, match="a symbolic link that another user .* owns") as info:
        save_rng_state(link, _state(1))
    assert isinstance(info.value, StorageError) and info.value.errno == errno.EACCES
    assert secret.read_bytes() == b"root's own file" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert link.is_symlink() and _entries(shared) == ["rng.pt"]
    # A planted link to a folder is refused as well, wherever in the path it is.
    _run(*as_nobody, "ln", "-s", str(tmp_path), str(shared / "run"))
    with pytest.raises(PermissionError, match="a symbolic link that another user"):
        save_rng_state(shared / "run" / "rng.pt", _state(1))
    assert _entries(tmp_path) == ["shadow"]


def test_links_this_user_made_or_in_a_folder_only_this_user_may_write_to_are_followed(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...]
) -> None:
    target = tmp_path / "step1.pt"
    mine = shared / "mine.pt"
    mine.symlink_to(target)
    save_rng_state(mine, _state(1))
    assert mine.is_symlink() and load_rng_state(target)["base_seed"] == 1
    # Another user's link in a folder of this user's that no one else may write to: put there by this
    # user (a backup restored with its owners), as nobody else could have.
    restored = tmp_path / "restored.pt"
    restored.symlink_to("step1.pt")
    os.chown(restored, 65534, 65534, follow_symlinks=False)
    save_rng_state(restored, _state(2))
    assert load_rng_state(target)["base_seed"] == 2 and _entries(tmp_path) == ["restored.pt", "step1.pt"]


@pytest.mark.parametrize("mode", ["755", "1777"], ids=["their-folder", "their-sticky-folder"])
def test_a_link_another_user_made_in_their_own_folder_is_refused_and_the_file_it_names_unchanged(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...], mode: str
) -> None:
    # Before, root followed nobody's link in nobody's folder (the kernel does, as root): a save of
    # /tmp/rvatk/ck.pt replaced root's file the link named, which nobody could not write.
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's own file")
    theirs = shared / "theirs"
    _run(*as_nobody, "mkdir", "-m", mode, str(theirs))
    _run(*as_nobody, "ln", "-s", str(secret), str(theirs / "ck.pt"))
    with pytest.raises(PermissionError, match="another user .* owns, in that user's folder.*'.*secret'"):
        save_rng_state(theirs / "ck.pt", _state(1))
    assert secret.read_bytes() == b"root's own file" and _entries(theirs) == ["ck.pt"]
    save_rng_state(secret, _state(1))  # by its own path, as the message says
    assert load_rng_state(secret)["base_seed"] == 1


def test_a_link_or_a_folder_another_user_planted_as_a_leftover_is_never_followed_nor_emptied(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...]
) -> None:
    # Before, a link named as a killed save's folder led root's save into another folder of root's,
    # which it emptied.
    other = _private_folder(tmp_path / "other", {"checkpoint": b"another run's checkpoint"})
    legacy = _private_folder(tmp_path / "legacy", {"lock": files.LEGACY_LOCK_MAGIC, "checkpoint": b"another run's"})
    planted = {_work_name("a1"): other, ".rng.pt.00000000000000a2.saving": legacy}
    for name, folder in planted.items():
        _run(*as_nobody, "ln", "-s", str(folder), str(shared / name))
    theirs = shared / _work_name("a3")  # a folder of nobody's, shaped like a save's
    _run(*as_nobody, "sh", "-c", 'mkdir -m 700 "$1" && echo theirs > "$1/checkpoint"', "sh", str(theirs))
    before = {folder: _snapshot(folder) for folder in (other, legacy)}
    save_rng_state(shared / "rng.pt", _state(1))
    save_rng_state(shared / "rng.pt", _state(2))
    assert {folder: _snapshot(folder) for folder in (other, legacy)} == before
    assert all((shared / name).is_symlink() for name in planted)
    assert theirs.is_dir() and not theirs.is_symlink() and theirs.stat().st_uid != os.geteuid()
    assert load_rng_state(shared / "rng.pt")["base_seed"] == 2


def test_a_replaced_files_special_bits_never_pass_to_the_new_checkpoint_nor_another_users_bits(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...]
) -> None:
    # Before, the file's whole mode passed on: nobody's 06777 file at the path became root's
    # -rwsrwsrwx checkpoint.
    theirs = shared / "rng.pt"
    _run(*as_nobody, "sh", "-c", 'echo theirs > "$1" && chmod 06777 "$1"', "sh", str(theirs))
    umask = os.umask(0o022)
    try:
        save_rng_state(theirs, _state(1))
    finally:
        os.umask(umask)
    st = theirs.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o644, oct(st.st_mode)
    mine = tmp_path / "rng.pt"  # a file of this user's own keeps its read, write and execute bits only
    save_rng_state(mine, _state(1))
    mine.chmod(0o6770)
    save_rng_state(mine, _state(2))
    assert stat.S_IMODE(mine.stat().st_mode) == 0o770 and load_rng_state(mine)["base_seed"] == 2


@pytest.mark.parametrize(
    ("mode", "contents"),
    [(0o700, {"checkpoint": b"root's"}), (0o700, {"notes": b"root's"}), (0o755, {"notes": b"root's"})],
    ids=["0700-checkpoint", "0700-other-file", "0755-other-file"],
)
def test_a_folder_another_user_renames_over_the_saves_new_folder_is_left_as_it_was(
    open_to_all: Path,
    as_nobody: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    mode: int,
    contents: dict[str, bytes],
) -> None:
    # Before, the save took root's folder, renamed in over its new empty one, for its own: it failed
    # on a checkpoint there and then deleted it with the folder, or chmodded the folder 0700 and saved.
    theirs = _private_folder(open_to_all / "X", contents)
    theirs.chmod(mode)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: Any, *args: Any, **kwargs: Any) -> None:
        real_mkdir(path, *args, **kwargs)
        if str(path).startswith(files.WORK_PREFIX):
            _run(*as_nobody, "mv", "-T", str(theirs), str(open_to_all / path))

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    with pytest.raises(PermissionError, match="put something else in place of the save's new private folder"):
        save_rng_state(open_to_all / "rng.pt", _state(1))
    monkeypatch.undo()
    (moved,) = _entries(open_to_all)
    assert _snapshot(open_to_all / moved) == contents and stat.S_IMODE((open_to_all / moved).stat().st_mode) == mode


@pytest.mark.parametrize("where", ["open-to-all", "another-users"])
def test_a_folder_of_this_users_renamed_as_a_dead_saves_is_left_where_others_can_rename_entries(
    open_to_all: Path, shared: Path, as_nobody: tuple[str, ...], where: str
) -> None:
    # Before, root's own private folder holding a checkpoint, renamed by nobody to a save's folder
    # name, was emptied and removed by root's next save.
    if where == "another-users":
        folder = shared / "nobodys"
        _run(*as_nobody, "mkdir", "-m", "755", str(folder))
    else:
        folder = open_to_all
    mine = _private_folder(folder / "mine", {"checkpoint": b"root's own checkpoint"})
    as_saves = folder / _work_name("0123456789abcdef")
    _run(*as_nobody, "mv", "-T", str(mine), str(as_saves))
    save_rng_state(folder / "rng.pt", _state(1))
    assert _snapshot(as_saves) == {"checkpoint": b"root's own checkpoint"}


def test_a_failed_save_removes_only_the_checkpoint_file_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a save that could not create its file (one there already) unlinked the file there.
    real_hold = files._Work._hold

    def hold_then_plant(work: Any, name: str) -> bool:
        held = real_hold(work, name)
        (tmp_path / name / "checkpoint").write_bytes(b"not the save's")
        return held

    monkeypatch.setattr(files._Work, "_hold", hold_then_plant)
    with pytest.raises(FileExistsError, match="could not save the checkpoint"):
        save_rng_state(tmp_path / "rng.pt", _state(1))
    monkeypatch.undo()
    (left,) = _entries(tmp_path)
    assert _snapshot(tmp_path / left) == {"checkpoint": b"not the save's"}


def test_a_file_system_that_gives_new_folders_another_owner_fails_the_save_at_once_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before (NFS root_squash, a vfat or cifs uid= mount), 64 tries, 64 folders left, and a message
    # blaming other saves.
    if not hasattr(os, "geteuid"):
        pytest.skip("POSIX owners")
    owner = os.geteuid()
    made: list[str] = []
    real_mkdir = os.mkdir

    def counted_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        made.append(str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", counted_mkdir)
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4321)
    with pytest.raises(PermissionError, match=f"to uid {owner}, not to its effective uid {owner + 4321}"):
        save_rng_state(tmp_path / "rng.pt", _state(1))
    monkeypatch.undo()
    assert len(made) == 1 and _entries(tmp_path) == []


_UMASK_SAVER = """
import os, sys
import hyperrng.platforms as platforms
platforms.set_current("cpu")
from hyperrng.resume.state import rng_state_dict, save_rng_state

os.umask(0o477)
for seed in (1, 2):
    save_rng_state(sys.argv[1], rng_state_dict(base_seed=seed))
print(sorted(os.listdir(os.path.dirname(sys.argv[1]))), oct(os.stat(sys.argv[1]).st_mode & 0o777))
"""


def test_a_umask_that_takes_the_owners_read_bit_still_saves_and_leaves_nothing(tmp_path: Path) -> None:
    # Before, mkdir's 0700 less umask 0477 made a d-wx------ folder a process without root's
    # override could not open: every save failed and left one no later save could remove.
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        why = _permitted("setpriv", "--bounding-set=-all", "--inh-caps=-all", "true")
        if why:
            pytest.skip(f"runs as root and cannot drop its file-permission override: {why}")
        prefix = ("setpriv", "--bounding-set=-all", "--inh-caps=-all")
    code, out, err = _finish(_python(_UMASK_SAVER, str(tmp_path / "rng.pt"), prefix=prefix))
    assert code == 0, err[-3000:]
    assert out.split() == ["['rng.pt']", "0o200"], out
    (tmp_path / "rng.pt").chmod(0o600)
    assert load_rng_state(tmp_path / "rng.pt")["base_seed"] == 2


_SWAPPER = """
import os, sys
shared, go = sys.argv[1], sys.argv[2]
secret, *victims = sys.argv[3:]
names = [os.path.join(shared, n) for n in (".hyperrng-00000000000000b1.saving", ".rng.pt.00000000000000b2.saving")]
target = os.path.join(shared, "rng.pt")
rounds = 0
while os.path.exists(go):
    for name, victim in zip(names, victims):
        for step in range(4):
            try:
                if step == 0:
                    os.symlink(victim, name)  # a link to root's private folder, named as a save's folder
                elif step == 1:
                    os.unlink(name)
                    os.mkdir(name, 0o700)  # then a folder of the swapper's own, shaped like a save's
                    with open(os.path.join(name, "checkpoint"), "wb") as file:
                        file.write(b"the swapper's")
                elif step == 2:
                    os.unlink(os.path.join(name, "checkpoint"))
                    os.rmdir(name)
                else:
                    os.symlink(secret, target)  # and a link at the checkpoint's path, now and then
                    os.unlink(target)
            except OSError:
                pass
    rounds += 1
    if rounds == 1:
        print("swapping", flush=True)
print(rounds)
"""


def test_links_swapped_in_while_saves_run_and_remove_leftovers_never_reach_outside_the_shared_folder(
    tmp_path: Path, shared: Path, as_nobody: tuple[str, ...]
) -> None:
    # Before, the cleaner checked a folder's mark through a link, then resolved the path again to
    # delete: swapped in between, a link had root delete a file in a private folder (25 saves).
    secret = _root_only_file(tmp_path / "shadow")
    victims = [
        _private_folder(tmp_path / "victim", {"checkpoint": b"another run's checkpoint"}),
        _private_folder(tmp_path / "victim-legacy", {"lock": files.LEGACY_LOCK_MAGIC, "checkpoint": b"another's"}),
    ]
    before = {folder: _snapshot(folder) for folder in victims}
    go = shared / "go"
    go.write_bytes(b"")
    why = _permitted(*as_nobody, sys.executable, "-c", "pass")
    if why:
        pytest.skip(f"runs Python as the user nobody: {why}")
    swapper = subprocess.Popen(
        [*as_nobody, sys.executable, "-c", _SWAPPER, str(shared), str(go), str(secret), *map(str, victims)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert swapper.stdout is not None and swapper.stdout.readline().strip() == "swapping", swapper.stderr
        outcomes = {"saved": 0, "refused": 0}
        for seed in range(200):
            try:
                save_rng_state(shared / "rng.pt", _state(seed))
                outcomes["saved"] += 1
            except PermissionError as exc:  # the link was there: refused
                assert isinstance(exc, StorageError) and "symbolic link that another user" in str(exc)
                outcomes["refused"] += 1
    finally:
        go.unlink()
        code, out, err = _finish(swapper)
    assert code == 0, err[-3000:]
    assert {folder: _snapshot(folder) for folder in victims} == before
    assert secret.read_bytes() == b"root's own file" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert outcomes["saved"] > 0, outcomes


# -- saves of one path in several processes -------------------------------------------------------------


def _save_concurrently(path: str, seed: int, rounds: int, start: Any) -> None:
    """In a forked child: ``rounds`` saves of ``path``, descheduled at random between creating the
    private folder and locking it, and before every lock (the cleaner's too)."""
    chance = random.Random(seed)
    real_mkdir, real_try_lock = os.mkdir, files._try_lock

    def mkdir_then_wait(*args: Any, **kwargs: Any) -> None:
        real_mkdir(*args, **kwargs)
        time.sleep(chance.uniform(0, 0.003))

    def wait_then_lock(fd: int) -> bool | None:
        time.sleep(chance.uniform(0, 0.001))
        return real_try_lock(fd)

    os.mkdir, files._try_lock = mkdir_then_wait, wait_then_lock  # type: ignore[assignment]
    state = _state(seed)
    start.wait()
    for _ in range(rounds):
        save_rng_state(path, state)
    os._exit(0)


def test_saves_of_one_path_in_several_processes_at_once_all_succeed_and_leave_one_checkpoint(tmp_path: Path) -> None:
    # Before, a cleaner locked a live save's lock file before the save had written its mark: 209 of
    # 825 saves failed ("another process locked ... first").
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    path = tmp_path / "rng.pt"
    start = fork.Event()
    savers = [fork.Process(target=_save_concurrently, args=(str(path), seed, 30, start)) for seed in range(4)]
    for saver in savers:
        saver.start()
    start.set()
    for saver in savers:
        saver.join()
    assert [saver.exitcode for saver in savers] == [0] * 4, "a save failed: its traceback is above"
    assert _entries(tmp_path) == ["rng.pt"]
    assert load_rng_state(path)["base_seed"] in range(4)


# -- what saves killed at any point leave -----------------------------------------------------------------


def _age(folder: Path, seconds: int) -> None:
    """Make ``folder`` ``seconds`` older than its file system says it is (its modification time)."""
    made = folder.stat().st_mtime_ns
    os.utime(folder, ns=(made - seconds * 10**9, made - seconds * 10**9))


def test_a_save_removes_every_shape_of_folder_a_killed_save_leaves(tmp_path: Path) -> None:
    # Before, a save killed after its mkdir, before its lock file held the mark, or between its last
    # unlink and its rmdir left a folder that no later save removed; an earlier release's killed
    # between its mkdir and its lock file stayed for good.
    full = b"a whole checkpoint"
    shapes: dict[str, dict[str, bytes]] = {
        _work_name("c1"): {},  # killed after mkdir (or after the rename, before rmdir)
        _work_name("c2"): {"checkpoint": full[:5]},  # while torch wrote
        _work_name("c3"): {"checkpoint": full},  # before the rename
        ".rng.pt.00000000000000c4.saving": {"lock": b""},  # an earlier release's: before its mark
        ".rng.pt.00000000000000c5.saving": {"lock": files.LEGACY_LOCK_MAGIC, "checkpoint": full},
        ".rng.pt.00000000000000c6.saving": {},  # an earlier release's: before its lock file
    }
    for name, contents in shapes.items():
        _private_folder(tmp_path / name, contents)
    grace = files.LEGACY_GRACE_NS // 10**9
    for name in (".rng.pt.00000000000000c4.saving", ".rng.pt.00000000000000c6.saving"):
        _age(tmp_path / name, grace + 60)  # killed long ago: no live save of an earlier release is that slow
    save_rng_state(tmp_path / "other.pt", _state(1))  # any checkpoint's save in the folder removes them
    legacy = [name for name in shapes if name.startswith(".rng.pt.")]
    assert _entries(tmp_path) == [*legacy, "other.pt"]
    save_rng_state(tmp_path / "rng.pt", _state(2))  # an earlier release's: a save of their checkpoint
    assert _entries(tmp_path) == ["other.pt", "rng.pt"]


def test_an_earlier_releases_folder_its_save_may_be_about_to_lock_stays_until_it_is_old(tmp_path: Path) -> None:
    # An earlier release's save makes its folder, then its lock file, then locks it: a cleaner that
    # removed an empty one made a live save of that release fail.
    young = {".rng.pt.00000000000000f1.saving": {}, ".rng.pt.00000000000000f2.saving": {"lock": b""}}
    for name, contents in young.items():
        _private_folder(tmp_path / name, contents)
        _age(tmp_path / name, files.LEGACY_GRACE_NS // 10**9 - 60)
    save_rng_state(tmp_path / "rng.pt", _state(1))
    assert _entries(tmp_path) == [*young, "rng.pt"]
    for name in young:
        _age(tmp_path / name, 120)
    save_rng_state(tmp_path / "rng.pt", _state(2))
    assert _entries(tmp_path) == ["rng.pt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_named_as_an_earlier_releases_lock_file_never_blocks_a_save(tmp_path: Path) -> None:
    # Before, the cleaner opened it and read it: the save waited forever, deaf to Ctrl-C (the read
    # ran with signals deferred).
    folder = _private_folder(tmp_path / ".rng.pt.00000000000000f3.saving", {})
    os.mkfifo(folder / "lock")
    _age(folder, files.LEGACY_GRACE_NS // 10**9 + 60)
    saver = _python(
        "import sys, hyperrng.platforms as p; p.set_current('cpu')\n"
        "from hyperrng.resume.state import rng_state_dict, save_rng_state\n"
        "save_rng_state(sys.argv[1], rng_state_dict(base_seed=5)); print('saved')",
        str(tmp_path / "rng.pt"),
    )
    try:
        out, err = saver.communicate(timeout=120)  # a hung save ends the test here
    finally:
        saver.kill()
    code = saver.returncode
    assert code == 0 and out.strip() == "saved", err[-3000:]
    assert _entries(tmp_path) == [folder.name, "rng.pt"] and stat.S_ISFIFO((folder / "lock").lstat().st_mode)


def test_a_save_leaves_every_folder_that_only_looks_like_a_killed_saves(tmp_path: Path) -> None:
    open_to_others = _private_folder(tmp_path / _work_name("d1"), {"checkpoint": b"the user's"})
    open_to_others.chmod(0o755)
    _private_folder(tmp_path / _work_name("d2"), {"checkpoint": b"the user's", "notes": b"the user's"})
    _private_folder(tmp_path / _work_name("d3"), {}).joinpath("checkpoint").mkdir()
    (tmp_path / _work_name("d4")).write_bytes(b"a file, not a folder")
    _private_folder(tmp_path / ".rng.pt.00000000000000d5.saving", {"lock": b"the user's own notes"})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    save_rng_state(tmp_path / "rng.pt", _state(1))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == sorted([*before, Path("rng.pt")])


_PAUSED_SAVER = """
import os, sys
import torch
import hyperrng.platforms as platforms
platforms.set_current("cpu")
from hyperrng.resume.state import rng_state_dict, save_rng_state

where = sys.argv[2]
real_save, real_mkdir = torch.save, os.mkdir

def pause(what):
    print(what, flush=True)
    sys.stdin.readline()

def mkdir_and_pause(*args, **kwargs):  # between the (first) folder's mkdir and its lock
    global where
    real_mkdir(*args, **kwargs)
    if where == "mkdir":
        where = None
        pause("paused")

def save_and_pause(obj, file):  # the checkpoint written, before the rename
    real_save(obj, file)
    if where == "written":
        pause("paused")

os.mkdir, torch.save = mkdir_and_pause, save_and_pause
save_rng_state(sys.argv[1], rng_state_dict(base_seed=77))
print("saved", flush=True)
"""


def _paused_saver(path: Path, where: str) -> subprocess.Popen[str]:
    saver = _python(_PAUSED_SAVER, str(path), where, stdin=subprocess.PIPE)
    assert saver.stdout is not None
    line = saver.stdout.readline()
    if line.strip() != "paused":
        saver.kill()
        pytest.fail(f"the saver did not pause: {line!r} {saver.communicate()[1][-3000:]}")
    return saver


def _resume(saver: subprocess.Popen[str]) -> None:
    assert saver.stdin is not None
    saver.stdin.write("go on\n")
    saver.stdin.flush()
    code, out, err = _finish(saver)
    assert code == 0 and out.strip() == "saved", err[-3000:]


_STEPS = {"_save", "create", "_hold", "_write", "seal", "_check_loads", "replace", "_fsync_folder", "remove"}
_STEPS |= {"_remove_abandoned", "_remove_if_dead", "_try_lock", "_same", "at", "close", "_new_file_mode", "_open"}
_STEPS |= {"_others_can_rename"}
"""The save's functions from its private folder's creation on (a kill before leaves nothing on disk)."""
_SAVE_CODE = (files.__file__, paths.__file__)  # the folder (Dir) is the walk's


def _step_events(at: int | None, counted: list[int]) -> Any:
    """A profile hook counting the events of the save's steps (a call starts, a call into C returns),
    and SIGKILLing this process at the ``at``-th."""

    def hook(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event in ("call", "c_return") and code.co_filename in _SAVE_CODE and code.co_name in _STEPS:
            counted.append(1)
            if len(counted) == at:
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _kill_at(path: str, state: dict[str, Any], at: int) -> None:
    """In a forked child: save ``state`` to ``path``, SIGKILLed at the ``at``-th event of its steps."""
    sys.setprofile(_step_events(at, []))
    save_rng_state(path, state)
    sys.setprofile(None)
    os._exit(3)  # the save ended before that event


def test_saves_killed_at_every_point_leave_only_what_the_next_save_removes_and_a_live_save_keeps_its_folder(
    tmp_path: Path,
) -> None:
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    path = tmp_path / "rng.pt"
    previous, new = _state(1), _state(2)
    save_rng_state(path, previous)
    live = _paused_saver(path, "written")  # a save that holds its folder all along: never removed
    try:
        (held,) = [name for name in _entries(tmp_path) if name != "rng.pt"]
        counted: list[int] = []
        sys.setprofile(_step_events(None, counted))
        try:
            save_rng_state(path, previous)
        finally:
            sys.setprofile(None)
        killed = 0
        for at in range(1, len(counted) + 1):
            child = fork.Process(target=_kill_at, args=(str(path), new, at))
            child.start()
            child.join()
            assert child.exitcode in (-signal.SIGKILL, 3), f"event {at}: exit code {child.exitcode}"
            killed += child.exitcode == -signal.SIGKILL
            assert load_rng_state(path)["digest"] in (previous["digest"], new["digest"]), f"event {at}"
            save_rng_state(path, previous)
            assert _entries(tmp_path) == sorted(["rng.pt", held]), f"left behind (killed at event {at})"
        assert killed >= len(counted) - 5, f"{killed} of {len(counted)} saves were killed"
    finally:
        _resume(live)
    assert _entries(tmp_path) == ["rng.pt"] and load_rng_state(path)["base_seed"] == 77


def _save_until_killed(path: str, state: dict[str, Any]) -> None:
    while True:
        save_rng_state(path, state)


def test_a_process_killed_at_random_times_while_it_saves_leaves_what_the_next_save_removes(tmp_path: Path) -> None:
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    path = tmp_path / "rng.pt"
    save_rng_state(path, _state(1))
    chance = random.Random(11)
    for trial in range(20):
        saver = fork.Process(target=_save_until_killed, args=(str(path), _state(5)))
        saver.start()
        saver.join(chance.uniform(0.0, 0.1))
        saver.kill()
        saver.join()
        assert saver.exitcode == -signal.SIGKILL, f"trial {trial}: exit code {saver.exitcode}"
        assert load_rng_state(path)["base_seed"] in (1, 5), f"trial {trial}"
        save_rng_state(path, _state(1))
        assert _entries(tmp_path) == ["rng.pt"], f"trial {trial}"


def test_a_save_a_cleaner_overtook_between_its_mkdir_and_its_lock_saves_all_the_same(tmp_path: Path) -> None:
    path = tmp_path / "rng.pt"
    save_rng_state(path, _state(1))
    saver = _paused_saver(path, "mkdir")  # its folder made, not yet locked: a cleaner takes it for dead
    try:
        save_rng_state(path, _state(2))
        assert _entries(tmp_path) == ["rng.pt"], "the unlocked empty folder is removed"
    finally:
        _resume(saver)  # ... and the save goes on in a folder of a fresh name
    assert _entries(tmp_path) == ["rng.pt"] and load_rng_state(path)["base_seed"] == 77


def test_a_save_whose_private_folder_is_moved_and_replaced_by_a_link_after_torch_wrote_leaves_no_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the save went on by the folder's path: the rename and the removal missed the moved
    # folder and left it behind with a whole copy of the checkpoint.
    path = tmp_path / "rng.pt"
    previous = _state(1)
    save_rng_state(path, previous)
    victim = _private_folder(tmp_path / "victim", {"checkpoint": b"someone else's"})
    real_save = torch.save
    moved: list[Path] = []

    def save_then_move(obj: object, file: Any) -> None:
        real_save(obj, file)
        (work,) = [p for p in tmp_path.glob(f"{files.WORK_PREFIX}*") if not p.is_symlink()]
        moved.append(tmp_path / f"moved-{len(moved)}")
        work.rename(moved[-1])
        work.symlink_to(victim)

    monkeypatch.setattr(torch, "save", save_then_move)
    new = _state(2)
    save_rng_state(path, new)  # through the descriptors it holds
    assert load_rng_state(path)["digest"] == new["digest"] and _entries(moved[0]) == []
    with pytest.raises(InvalidArgumentError, match="cannot read back"):
        save_rng_state(path, {"rng": previous, "odd": object()})
    assert _entries(moved[1]) == [] and load_rng_state(path)["digest"] == new["digest"]
    assert _snapshot(victim) == {"checkpoint": b"someone else's"}


def test_without_paths_relative_to_a_folder_a_save_goes_by_paths_and_leaves_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the OS has no ``dir_fd`` (Windows) and no /proc/self/fd: the same save, by paths."""
    monkeypatch.setattr(paths, "_AT", False)
    monkeypatch.setattr(files, "_PROC_FD", False)
    (tmp_path / "step1").mkdir()
    latest = tmp_path / "latest.pt"
    latest.symlink_to(Path("step1") / "rng.pt")
    leftover = _private_folder(tmp_path / _work_name("e1"), {"checkpoint": b"a killed save's"})
    for seed in (1, 2):
        save_rng_state(latest, _state(seed))
        assert load_rng_state(latest)["base_seed"] == seed and latest.is_symlink()
    assert _entries(tmp_path / "step1") == ["rng.pt"] and leftover.is_dir()


# -- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["n" * 252 + ".pt", "é" * 125 + "ab.pt"], ids=["ascii", "two-byte"])
def test_a_name_of_255_bytes_saves_and_loads(tmp_path: Path, name: str) -> None:
    # Before, the private folder's name added 25 bytes to the checkpoint's: 232 bytes or more never saved.
    assert len(os.fsencode(name)) == 255
    for seed in (1, 2):
        save_rng_state(tmp_path / name, _state(seed))
        assert load_rng_state(tmp_path / name)["base_seed"] == seed
    assert _entries(tmp_path) == [name]


@pytest.mark.parametrize(
    ("make_path", "fragment"),
    [
        (lambda d: d / "rng\0.pt", "holds a NUL character"),
        (lambda d: d / "rng\ud800.pt", "cannot be written in the file system's encoding"),
        (lambda d: d / ("n" * 253 + ".pt"), "longer than the file system allows"),
        (lambda d: d / ("n" * 256) / "rng.pt", "longer than the file system allows"),
    ],
    ids=["nul", "lone-surrogate", "256-bytes", "256-byte-folder"],
)
def test_a_name_no_file_system_takes_is_an_invalid_argument_for_save_and_load(
    tmp_path: Path, make_path: Any, fragment: str
) -> None:
    # Before: a bare ValueError ("embedded null byte"), a UnicodeEncodeError, a plain OSError.
    path = make_path(tmp_path)
    with pytest.raises(InvalidArgumentError, match=fragment):
        save_rng_state(path, _state(1))
    with pytest.raises(InvalidArgumentError, match=fragment):
        load_rng_state(path)
    assert _entries(tmp_path) == []


# -- signals' exceptions during saves and loads ---------------------------------------------------------

_INTERRUPTED_BY_A_THREAD = """
import gc, os, random, signal, sys, threading, time
import hyperrng.platforms as platforms
platforms.set_current("cpu")
import hyperrng.resume._files as files
from hyperrng.resume.state import load_rng_state, rng_state_dict, save_rng_state

folder, rounds = sys.argv[1], int(sys.argv[2])
os.mkdir(folder)
path = os.path.join(folder, "rng.pt")
states = [rng_state_dict(base_seed=seed) for seed in (1, 2)]
descriptors = len(os.listdir("/proc/self/fd"))
chance = random.Random(7)
through_a_path = files._PROC_FD
for kind in ("path", "file object"):  # how torch writes: by a path, or through a Python file object
    files._PROC_FD = through_a_path and kind == "path"
    save_rng_state(path, states[0])
    start = time.perf_counter()
    save_rng_state(path, states[1])
    took = time.perf_counter() - start
    outcomes = {"saved": 0, "interrupted": 0}
    for round in range(rounds):
        try:
            timer = threading.Timer(chance.uniform(0.0, 1.2 * took), os.kill, (os.getpid(), signal.SIGINT))
            try:
                timer.start()
                save_rng_state(path, states[round % 2])
                outcomes["saved"] += 1
            except KeyboardInterrupt:
                outcomes["interrupted"] += 1
            except BaseException as exc:
                print(f"{kind}, round {round}: {exc!r}", file=sys.stderr)
                raise SystemExit(1)
            timer.join()
            time.sleep(0.001)  # a SIGINT sent after the save lands here
        except KeyboardInterrupt:
            pass
        left = sorted(os.listdir(folder))
        assert left == ["rng.pt"], f"{kind}, round {round}: {left} left"
        gc.collect()  # an interrupted write's file object lives as long as its traceback, which a cycle may hold
        assert len(os.listdir("/proc/self/fd")) == descriptors, f"{kind}, round {round}: a descriptor left open"
        assert load_rng_state(path)["digest"] in {s["digest"] for s in states}, f"{kind}, round {round}: torn"
    print(kind, outcomes["saved"], outcomes["interrupted"])
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd (Linux)")
def test_ctrl_c_from_another_thread_during_saves_into_a_non_ascii_folder_is_a_keyboard_interrupt(
    tmp_path: Path,
) -> None:
    # Before, torch wrote a non-ASCII path through a Python file object, and 3 interrupts in 799
    # came out as StorageError ("unexpected pos"); with a file object a process could even abort.
    code, out, err = _finish(_python(_INTERRUPTED_BY_A_THREAD, str(tmp_path / "dossier-é-检查点"), "80"))
    assert code == 0, err[-3000:]
    for line in out.splitlines():
        *kind, saved, interrupted = line.split()
        assert int(saved) + int(interrupted) == 80 and int(interrupted) >= 8, out
    assert len(out.splitlines()) == 2, out


_WATCHDOG = """
import os, random, signal, sys, time
import hyperrng.platforms as platforms
platforms.set_current("cpu")
from hyperrng.resume.state import load_rng_state, rng_state_dict, save_rng_state

folder, rounds = sys.argv[1], int(sys.argv[2])
path = os.path.join(folder, "rng.pt")

def watchdog(signum, frame):
    raise TimeoutError("the step took too long")

signal.signal(signal.SIGALRM, watchdog)
state = rng_state_dict(base_seed=1)
save_rng_state(path, state)
chance = random.Random(9)
for what, act in (("save", lambda: save_rng_state(path, state)), ("load", lambda: load_rng_state(path))):
    start = time.perf_counter()
    act()
    took = time.perf_counter() - start
    outcomes = {"done": 0, "timed out": 0}
    for round in range(rounds):
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, chance.uniform(1e-6, 1.2 * took))
                act()
                outcomes["done"] += 1
            except TimeoutError as exc:
                assert type(exc) is TimeoutError and exc.errno is None, f"{what}, round {round}: {exc!r}"
                outcomes["timed out"] += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except TimeoutError:  # the alarm went off after the call returned
            pass
        assert sorted(os.listdir(folder)) == ["rng.pt"], f"{what}, round {round}: {os.listdir(folder)}"
    print(what, outcomes["done"], outcomes["timed out"])
"""


def test_a_watchdogs_time_out_raised_by_a_signal_handler_during_a_save_or_a_load_comes_out_as_itself(
    tmp_path: Path,
) -> None:
    # Before, a SIGALRM handler's TimeoutError came out as StorageError (errno 5).
    code, out, err = _finish(_python(_WATCHDOG, str(tmp_path), "80"))
    assert code == 0, err[-3000:]
    for line in out.splitlines():
        what, done, timed_out = line.split()
        assert int(done) + int(timed_out) == 80 and int(timed_out) >= 8, out
    assert len(out.splitlines()) == 2, out


@pytest.fixture
def alarm_raises() -> Iterator[None]:
    def time_out(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("the step took too long")

    previous = signal.signal(signal.SIGALRM, time_out)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_handlers_exception_that_torch_swallows_or_translates_comes_out_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alarm_raises: None
) -> None:
    path = tmp_path / "rng.pt"
    previous = _state(1)
    save_rng_state(path, previous)
    real_save = torch.save

    def save_then_alarm(obj: object, file: Any) -> None:
        real_save(obj, file)
        signal.raise_signal(signal.SIGALRM)

    def writer_swallows_it(obj: object, file: Any) -> None:  # what torch's writer does inside a write
        try:
            signal.raise_signal(signal.SIGALRM)
        except TimeoutError:
            pass
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 1216 vs 1110")

    for fake in (save_then_alarm, writer_swallows_it):
        monkeypatch.setattr(torch, "save", fake)
        with pytest.raises(TimeoutError, match="the step took too long") as info:
            save_rng_state(path, _state(2))
        assert type(info.value) is TimeoutError and info.value.errno is None
        assert _entries(tmp_path) == ["rng.pt"] and load_rng_state(path)["digest"] == previous["digest"]
    monkeypatch.undo()

    def unpickler_translates_it(*args: Any, **kwargs: Any) -> Any:  # weights_only's error for any exception
        try:
            signal.raise_signal(signal.SIGALRM)
        except TimeoutError as exc:
            raise pickle.UnpicklingError(f"Weights only load failed: {exc}") from None

    monkeypatch.setattr(torch, "load", unpickler_translates_it)
    with pytest.raises(TimeoutError, match="the step took too long") as info:
        load_rng_state(path)
    assert type(info.value) is TimeoutError


def test_a_handlers_value_error_inside_torchs_writer_is_not_taken_for_an_object_that_cannot_be_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The save calls a ValueError out of torch.save a state that cannot be pickled (ArgumentTypeError);
    # one that a signal's handler raised there is the handler's, and comes out as itself.
    def handler(signum: int, frame: FrameType | None) -> None:
        raise ValueError("the handler's")

    previous_handler = signal.signal(signal.SIGUSR1, handler)
    try:
        monkeypatch.setattr(torch, "save", lambda obj, file: signal.raise_signal(signal.SIGUSR1))
        with pytest.raises(ValueError, match="the handler's") as info:
            save_rng_state(tmp_path / "rng.pt", _state(1))
        assert type(info.value) is ValueError and _entries(tmp_path) == []
    finally:
        signal.signal(signal.SIGUSR1, previous_handler)


def test_a_time_out_of_the_file_system_while_saving_is_still_a_storage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def time_out(obj: object, file: Any) -> None:
        raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")

    monkeypatch.setattr(torch, "save", time_out)
    with pytest.raises(TimeoutError, match="could not save the checkpoint") as info:
        save_rng_state(tmp_path / "rng.pt", _state(1))
    assert isinstance(info.value, StorageError) and info.value.errno == errno.ETIMEDOUT
    assert _entries(tmp_path) == []


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("unable to mmap 17259 bytes from file <{file}>: Cannot allocate memory (12)", errno.ENOMEM),
        ("PytorchStreamReader failed reading zip archive: failed finding central directory", errno.EIO),
    ],
)
def test_a_read_back_the_os_refused_is_a_storage_error_and_the_previous_checkpoint_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, message: str, code: int
) -> None:
    # Before, torch's RuntimeError for an open or a mapping refused (out of descriptors or address
    # space), or for a file it could not read back, came out of the save's read-back check as it was.
    path = tmp_path / "rng.pt"
    previous = _state(1)
    save_rng_state(path, previous)

    def unreadable(file: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message.format(file=file))

    monkeypatch.setattr(torch, "load", unreadable)
    with pytest.raises(StorageError, match="could not save the checkpoint .* it is as it was") as info:
        save_rng_state(path, _state(2))
    assert info.value.errno == code
    monkeypatch.undo()
    assert _entries(tmp_path) == ["rng.pt"] and load_rng_state(path)["digest"] == previous["digest"]
