"""State that only the service's own user may read: the batch database (tenants' prompts and outputs) and the
directories that hold it are created 0600 / 0700, whatever the umask.

A database file found readable by others is tightened to 0600 (logged with its old mode): it holds what clients
sent. A directory that already existed is the operator's (it may be shared, e.g. /tmp) and is left as it is; one
that others can read is logged as a warning naming it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)
FILE_MODE, DIR_MODE = 0o600, 0o700


def private_dir(path: Path) -> None:
    """Creates `path` and every missing parent 0700; warns about an existing one open to other users."""
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:  # made meanwhile by another process: it chose the mode
            continue
        os.chmod(p, DIR_MODE)  # mkdir's mode is masked by the umask; this one is not
    if not missing:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("state directory is open to other users; `chmod 700` it if only this service uses it",
                        extra={"path": str(path), "mode": oct(mode)})


def private_file(path: Path) -> None:
    """Creates `path` empty with mode 0600 if it does not exist; tightens an existing one open to other users."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        fd = None
    if fd is not None:
        os.fchmod(fd, FILE_MODE)  # exactly 0600: the umask may have removed the owner's write bit
        os.close(fd)
        return
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, FILE_MODE)
        log.warning("state file was open to other users; tightened to 0600", extra={"path": str(path),
                                                                                     "old_mode": oct(mode)})
