"""
What every script shares: the one-line error a user sees, and files written so that a reader never
sees half of one (atomic writes, strict JSON, one process at a time through a pid lock, a cell's lock).
"""

import argparse
import errno
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: the message is the one line the user sees (after 'error: '), and the exit is non-zero."""


class ConfigError(UserError):
    """A setting, a flag or a recorded run that does not fit."""


class DataError(UserError):
    """A data file, a record or a disk that does not fit."""


class Parser(argparse.ArgumentParser):
    """Every script's argument parser: its docstring is --help, and a usage error is one line naming the script."""

    def __init__(self, script, doc):
        super().__init__(prog=script, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        sys.exit(f"error: {message}; see python {self.prog} --help")


def run(main):
    """Every script's entry point: main(sys.argv[1:]), where bad input (a UserError) is one line and exit 1."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        sys.exit(f"error: {e}")


def write_atomic(path, write):
    """
    write(tmp) to a temporary of this process, then renamed onto path: a reader never sees half a
    file, two writers never share a temporary, and a failed write leaves the previous file and no
    temporary behind. The temporary is created exclusively, so nothing planted at its name (a
    symlink) is followed, and temporaries of path that killed writers left are removed first. A
    SIGTERM or SIGHUP meanwhile (a timeout, a closed terminal) removes the temporary before the
    process dies of it (dying_cleanly). Every file the project writes goes through here.
    """
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    in_the_way = False
    with dying_cleanly():
        try:
            open(tmp, "x").close()  # inside the try: a signal just after it still removes the temporary
            write(tmp)
            os.replace(tmp, path)
        except FileExistsError:
            in_the_way = True
            raise DataError(
                f"cannot write {path}: {tmp} is in the way (not a file this process made); remove it"
            ) from None
        except OSError as e:
            raise cannot_write(path, e) from None
        finally:
            if os.path.lexists(tmp) and not in_the_way:
                os.remove(tmp)


class Terminated(BaseException):
    """SIGTERM or SIGHUP as an exception (dying_cleanly): not an Exception, so no handler of errors catches it."""


@contextmanager
def dying_cleanly():
    """
    Inside, SIGTERM and SIGHUP raise Terminated where they would kill the process outright (their
    default action; a handler someone installed stays), so finally blocks run; then the process dies
    of the signal as it would have. Python handles signals in the main thread only: elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(signum)

    previous = {
        s: signal.signal(s, terminate) for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL
    }
    try:
        yield
    except Terminated as e:
        for s in previous:
            signal.signal(s, signal.SIG_DFL)
        previous = {}
        os.kill(os.getpid(), e.args[0])  # the default action now: the process ends as the signal meant
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cannot_write(path, e):
    if e.errno == errno.ENAMETOOLONG:
        return DataError(
            f"cannot write {path}: the name is too long for this filesystem; use a shorter out_dir or arm name"
        )
    return DataError(
        f"cannot write {path} ({e.strerror or e}); free disk space or check the permissions "
        f"of {os.path.dirname(path) or '.'}"
    )


def temporary_name(path):
    """<path>.<pid>.<host>.tmp: whose it is, so the next writer of path can tell a killed writer's leftover."""
    return f"{path}.{os.getpid()}.{socket.gethostname()}.tmp"


def stale_temporaries(path, every=False):
    """The temporaries of path whose writer is gone from this host (a kill mid-write leaves one), and this pid's
    own (left by an earlier process of the same pid); a live writer's or another host's are not among them.
    every: those of every file in path's folder (report.py's, of plots it may not write again)."""
    folder, prefix, suffix = os.path.dirname(path) or ".", os.path.basename(path) + ".", f".{socket.gethostname()}.tmp"
    prefix = "" if every else prefix
    try:
        names = os.listdir(folder)
    except OSError:
        return []  # the write that follows says what is wrong with the folder
    stale = []
    for name in names:
        stem = name[len(prefix) : -len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
        written, _, pid = stem.rpartition(".") if every else ("", "", stem)
        if (written or not every) and pid.isdigit() and (int(pid) == os.getpid() or not process_exists(int(pid))):
            stale.append(os.path.join(folder, name))
    return stale


def remove_stale_temporaries(path, every=False):
    """Remove path's stale temporaries (stale_temporaries), which are files."""
    for name in stale_temporaries(path, every):
        try:
            os.remove(name)  # a symlink itself, never what it points to
        except OSError:
            pass  # a folder is no temporary of ours, and another writer may have removed it already


def write_json(path, obj):
    """Strict JSON, written atomically: a NaN or an Infinity is the caller's bug (a ValueError naming the path)."""

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)

    try:
        write_atomic(path, write)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; write null for a number that is not finite") from None


def write_text(path, text):
    """text as the file's whole content, written atomically."""

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    write_atomic(path, write)


def read_json(path, strict=True):
    """The file's JSON value, strictly (NaN and Infinity are not JSON) unless strict=False; OSError, or
    ValueError naming why it is not JSON (torn, not UTF-8, NaN, nested past Python's stack)."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    with open(path) as f:
        try:
            return json.load(f, parse_constant=refuse if strict else None)
        except RecursionError:
            raise ValueError("nested too deeply to read") from None


def check_writable(folder, remedy):
    """Create folder if needed and make a file in it: a read-only place fails before the work, not after.
    The probe has no name (or a random one, removed at once), so nothing planted is followed and no kill
    leaves it behind. remedy: what the one line tells the user to do."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise DataError(f"cannot write into {folder} ({e.strerror or e}); {remedy}") from None


class LockHeld(DataError):
    """A lock that a live process holds (or one on another host, or one that names no process, which cannot be
    checked)."""

    def __init__(self, message, holder, alive):
        super().__init__(message)
        self.holder = holder  # 'pid N on HOST', or what a lock naming no process holds, escaped
        self.alive = alive  # whether a live process on this host holds it (else no one here can tell)


# the locks this process holds (absolute paths): a lock naming this pid on this host that is not among them is
# from an earlier process with the same pid (a container or pid-namespace restart), whose lock is stale
held_locks = set()


@contextmanager
def pid_lock(path, busy):
    """
    One process at a time: path holds the holder's pid and host while it runs (take_lock), removed
    however the work ends. busy: what the error says is going on.
    """
    take_lock(path, busy)
    try:
        yield
    finally:
        release_lock(path)


def take_lock(path, busy):
    """
    Create the lock path holding this process's pid and host, or raise LockHeld when a live process
    holds it. A lock whose process is gone from this host (a killed run, or this pid before a restart)
    is taken over; one from another host (a shared filesystem), or one that names no process, cannot be
    checked and stays until removed. The lock appears with its content (a hard link of a written
    file), so no kill leaves an empty one. Anything else at path (a symlink, a folder) is one line
    saying to remove it.
    """
    host, mine, stale = socket.gethostname(), temporary_name(path), temporary_name(path + "-stale")
    remove_stale_temporaries(path)
    remove_stale_temporaries(path + "-stale")
    try:
        with open(mine, "x") as f:  # exclusive: a symlink planted at this name is not followed
            f.write(f"{os.getpid()} {host}")
    except OSError as e:
        raise cannot_write(mine, e) from None
    try:
        while True:
            try:
                os.link(mine, path)
                held_locks.add(os.path.abspath(path))
                break
            except FileExistsError:
                pid, owner = read_lock(path)
                if pid is None:
                    continue  # released meanwhile
                if (pid, owner) == (str(os.getpid()), host) and os.path.abspath(path) not in held_locks:
                    pass  # this pid's lock from before a restart: the process that wrote it is gone
                elif pid and (owner != host or not pid.isdigit() or process_exists(int(pid))):
                    named = pid.isdigit() and owner.isprintable() and len(owner) <= 255  # a host name's limit
                    holder = (
                        f"pid {pid} on {owner or '?'}"
                        if named
                        else f"a lock naming no process ({ascii(f'{pid} {owner}'.strip())[:80]})"
                    )  # garbage, escaped
                    raise LockHeld(
                        f"{busy} by {holder}; wait for it, or remove {path} if that process is gone",
                        holder,
                        named and owner == host,
                    ) from None
                # stale: its process ended without releasing it (or an older version left it empty). Another worker
                # may have read the same dead pid and taken the lock over since: a rename moves it away atomically
                # (one worker wins), and only a lock that still names the dead pid is removed; a new one goes back
                try:
                    os.rename(path, stale)
                except FileNotFoundError:
                    continue  # another worker moved it first
                if read_lock(stale) != (pid, owner):
                    try:
                        os.link(stale, path)  # the next read names its live holder
                    except FileExistsError:
                        pass  # a third worker took the free name meanwhile: that one holds the cell
                os.remove(stale)
    finally:
        os.remove(mine)


@contextmanager
def cell_lock(cell_dir, master):
    """One process at a time trains a cell: cell_dir/lock (take_lock: pid and host, a killed run's
    lock taken over). Yields None when this process holds it, else who does ('pid N on HOST', or what
    a lock naming no process holds), so a worker of a shared grid passes on to the next cell. Under DDP
    rank 0 holds it (the others get None)."""
    if not master:
        yield None
        return
    try:
        os.makedirs(cell_dir, exist_ok=True)
    except OSError as e:  # a file where the arm's or the cell's folder should be, a read-only disk
        raise ConfigError(
            f"cannot create the cell folder {cell_dir} ({e.strerror}); move away the file in its "
            f"place, or choose another --out_dir"
        ) from None
    path = os.path.join(cell_dir, "lock")
    try:
        take_lock(path, f"cell {cell_dir} is being trained")
    except LockHeld as e:
        yield e.holder
        return
    try:
        yield None
    finally:
        release_lock(path)


def release_lock(path):
    held_locks.discard(os.path.abspath(path))
    os.remove(path)


def read_lock(path):
    """(pid, host) a lock file holds, as text; (None, None) when it is gone."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            kind = "a symlink" if os.path.islink(path) else "a folder" if os.path.isdir(path) else "not a file"
            raise DataError(f"{path} is {kind}, not a lock (a file holding a pid and a host); remove it")
        with open(path) as f:  # written by hand or by another tool, it may end in a newline
            pid, _, owner = f.read().strip().partition(" ")
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path} cannot be read as a lock ({getattr(e, 'strerror', None) or e}); remove it if no run is using it"
        ) from None
    return pid, owner


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return False
    except PermissionError:
        return True  # another user's process
    return True
