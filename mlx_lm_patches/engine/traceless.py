"""Work that runs inside a user's process (probes) leaves no trace: mlx's random state, files.

mlx draws from one implicit key per thread (``mx.random.state``) whenever a random function is
called without ``key=`` - and ``mlx.nn`` layers draw their initial weights that way. A probe
that builds a tiny model would otherwise move the user's stream: ``mx.random.seed(1234)`` then
``import mlx_lm`` would sample differently with the package installed.

* :func:`random_state_kept` - a block after which the calling thread's key is the one it had
  before (the engine runs every probe inside one);
* :func:`seeded` - a block that draws from ``mx.random.seed(seed)`` (a reproducible tiny model)
  and then puts the caller's key back;
* :func:`scratch_folder` - a temporary folder for a library that only reads files, gone after
  the block, ``tempfile``'s module state as before.

The key is restored through ``mx.random.seed``: a key is the pair ``(seed >> 32, seed &
0xFFFFFFFF)``, and from mlx 0.32 ``mx.random.state`` can be read but not assigned.
"""

import contextlib


def _key():
    import mlx.core as mx

    return mx.random.state[0]


def _restore(saved) -> None:
    import mlx.core as mx

    if _key() is saved:
        return  # nothing drew meanwhile
    high, low = (int(v) for v in saved.tolist())
    mx.random.seed((high << 32) | low)


@contextlib.contextmanager
def random_state_kept():
    """The calling thread's mlx random key is the same after the block as before it."""
    try:
        saved = _key()
    except ImportError:  # no mlx: nothing to keep
        yield
        return
    try:
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def seeded(seed: int):
    """Inside the block mlx draws from ``mx.random.seed(seed)``; after it, from the caller's key
    as it was."""
    import mlx.core as mx

    with random_state_kept():
        mx.random.seed(seed)
        yield


@contextlib.contextmanager
def scratch_folder():
    """A private temporary folder for a library that reads only from disk, removed with
    everything in it when the block ends; ``tempfile``'s cached temporary directory (set by its
    first use) is put back as it was, so a later change of ``TMPDIR`` still counts."""
    import tempfile

    cached = tempfile.tempdir
    try:
        with tempfile.TemporaryDirectory(prefix="mlx-lm-patches-") as folder:
            yield folder
    finally:
        tempfile.tempdir = cached
