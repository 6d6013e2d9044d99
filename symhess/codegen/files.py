"""Every file symhess writes goes through ``write_atomic``.

Contract (the same for kernel modules, reports, CSV tables and pictures):

* **atomic** — the content is written to a temporary file in the destination's folder
  (``TMP_PREFIX`` + random), flushed, then moved over the destination with ``os.replace``:
  a reader sees the old file or the new one, never a part;
* **never through a link** — an existing symbolic link at the destination is replaced by the
  new file (``os.replace`` renames onto the link itself); its target is left untouched;
* **the umask's mode** — the file gets ``0o666 & ~umask`` like any file a program opens
  for writing (``mkstemp`` alone would leave 0600);
* **temporaries** — a failed write removes its temporary; a temporary that a killed run left
  behind is removed by ``remove_stale_temporaries`` once it is older than ``STALE_AFTER``
  seconds (a younger one may be another process's write in progress).
"""
from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

TMP_PREFIX = ".symhess-tmp-"
STALE_AFTER = 3600.0


def umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_open(path, mode="w", **kw):
    """A file object whose content replaces ``path`` when the block ends without an error
    (module docstring); ``mode`` "w" (text; ``encoding`` defaults to UTF-8) or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes with mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        if mode == "w":
            kw.setdefault("encoding", "utf-8")
        with os.fdopen(fd, mode, **kw) as fh:
            yield fh
            fh.flush()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path, data) -> Path:
    """Replace ``path`` by ``data`` (str or bytes) atomically (module docstring)."""
    with atomic_open(path, "wb" if isinstance(data, (bytes, bytearray)) else "w") as fh:
        fh.write(data)
    return Path(path)


def save_figure(fig, path, **kw) -> Path:
    """``fig.savefig`` into ``path`` atomically; the format follows the suffix."""
    fmt = kw.pop("format", None) or Path(path).suffix.lstrip(".") or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, **kw)
    return Path(path)


def remove_stale_temporaries(folder, older_than=STALE_AFTER):
    """Delete the temporaries of writes that never finished, once they are ``older_than``
    seconds old (a younger one may belong to a write still running in another process)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    now = time.time()
    for p in folder.rglob(TMP_PREFIX + "*"):
        try:
            if now - p.lstat().st_mtime > older_than:
                p.unlink()
        except OSError:
            pass


__all__ = ["atomic_open", "write_atomic", "save_figure", "remove_stale_temporaries",
           "TMP_PREFIX", "umask"]
