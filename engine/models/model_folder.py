"""Writing a model folder safely when several processes may build it at once.

Tests and the demo may ask for the same converted or trained model concurrently: one process
builds it under an exclusive lock, the others wait and then reuse it. The folder is written in
a staging directory beside it and moved into place with one ``os.replace``, so a crash mid-build
never leaves a half-written folder that looks finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def exclusive_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock (a ``.NAME.lock`` file beside ``out_dir``) for the block."""
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """Yield an empty staging folder; on success it replaces ``out_dir``, on any error it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only
    try:
        yield staging
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
