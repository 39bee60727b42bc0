"""What a benchmark's ratios were measured on: the versions, and how matrix products scale.

Speculation pays where a pass over a few tokens costs little more than a pass over one, as on
Apple GPUs and on CPUs with an optimized BLAS (decoding is memory-bound: the weights are read
once per pass). The ``mlx[cpu]`` wheel for Linux bundles netlib's reference BLAS: its matrix
products run at about 2 GFLOPS on the 2-core CI machine and cost in proportion to their rows,
so a verify pass of ``k + 1`` tokens costs about ``k + 1`` decode steps and no draft can pay.
Preloading an optimized BLAS, e.g. Debian's ``libopenblas0-pthread``::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/...

makes products memory-bound there too. :func:`header` measures which regime this process is in
and says it beside every table.
"""

import os
import time

ROWS = 8  # tokens in the wide product, against one


def product_scaling(width=2048, repeats=5):
    """What a product of ``ROWS`` rows by a ``width`` x ``width`` matrix costs against one row
    (best of ``repeats``): about 1 where products are memory-bound, about ``ROWS`` where they are
    compute-bound."""
    import mlx.core as mx

    weight = mx.ones((width, width)) / width
    mx.eval(weight)

    def best(rows):
        x = mx.ones((rows, width))
        mx.eval(x @ weight)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(x @ weight)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(ROWS) / best(1)


def blas_libraries():
    """The BLAS libraries mapped into this process (Linux; empty elsewhere), preloaded ones first."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "blas" in line.lower() and "/" in line}
    except OSError:
        return []
    preloaded = {os.path.realpath(p) for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()}
    return [os.path.basename(p) for p in sorted(paths, key=lambda p: os.path.realpath(p) not in preloaded)]


def header():
    """One line: mlx-lm and mlx versions, the BLAS, and how a product's cost scales with rows."""
    import mlx.core as mx

    from mlx_lm_patches.engine import versions

    scaling = product_scaling()
    regime = ("memory-bound" if scaling < ROWS / 2
              else "compute-bound, so a pass over k + 1 tokens costs about k + 1 steps: see benchmarks/machine.py")
    libraries = ", ".join(blas_libraries()) or "the platform's"
    return (f"mlx-lm {versions.mlx_lm().describe()}, mlx {versions.mlx().describe()}, device {mx.default_device()}; "
            f"BLAS {libraries}: {ROWS} rows of a product cost {scaling:.1f}x one ({regime})")
