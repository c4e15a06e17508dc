"""Write a directory all at once: build it under a temporary name, then rename it into place.

A crash or Ctrl-C mid-write leaves only a hidden `.<name>.tmp-*` folder, never a half-written
`<name>` that a later run would mistake for a finished one.
"""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_output_dir(out_dir: Path) -> Iterator[Path]:
    """Yield an empty temp dir beside `out_dir`; on success it replaces `out_dir`, on error it is deleted."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp_dir
        # mkdtemp makes the folder private (0700); outputs are meant to be shared like any data dir.
        os.chmod(tmp_dir, 0o755)
        old_dir = None
        if out_dir.exists():
            old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old_dir / out_dir.name)
        os.replace(tmp_dir, out_dir)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
