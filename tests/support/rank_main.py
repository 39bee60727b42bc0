"""What each rank started by ``serve(..., ranks=N)`` runs: ``python rank_main.py SCRIPT ARGS...``
gives the rank a kernel cache of its own, then runs ``SCRIPT ARGS...`` as ``__main__``.

mlx's CPU backend compiles kernels into ``$TMPDIR/mlx/<version>/cpu`` and loads them from there.
With mlx 0.30.x, two local ranks compiling the same kernel at once can load each other's
half-written library ("Could not load C++ shared library ...: file too short"): the rank's
generation thread dies. Each rank gets a private ``TMPDIR`` in which the kernels compiled before
the launch (complete files) are linked, so it compiles only what is missing, alone. Real hosts
do not share a ``TMPDIR``; on Apple GPUs nothing is compiled to files.
"""

import atexit
import os
import pathlib
import runpy
import shutil
import sys
import tempfile


def private_tmp() -> None:
    base = pathlib.Path(tempfile.gettempdir())
    mine = pathlib.Path(tempfile.mkdtemp(prefix=f"rank-{os.environ.get('MLX_RANK', 'x')}-", dir=base))
    atexit.register(shutil.rmtree, mine, ignore_errors=True)
    shared = base / "mlx"
    for path in shared.rglob("*") if shared.is_dir() else ():
        if path.is_file():
            link = mine / "mlx" / path.relative_to(shared)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    os.environ["TMPDIR"] = str(mine)
    tempfile.tempdir = None


if __name__ == "__main__":
    private_tmp()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
