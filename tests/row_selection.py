"""Which tests run on which row of the matrix (``tested_versions`` in compat_matrix.yaml),
declared once: tests/conftest.py marks the tests, tools/run_matrix.py builds each row's
selection from the row's attributes and these names. Plain data: read by both without importing
mlx, mlx-lm or pytest.

* ``python_only``: depends on the Python version, not on mlx-lm's: one row per Python runs it.
  The text reports of ``status`` and ``check`` are among them: what they say depends on the
  release and is asserted on every row through ``--json`` (``test_cli.py``, the matrix cells);
  how they lay it out does not.
* ``core``: every row runs it, ``suite: core`` rows included: the matrix cells (each patch's
  scenario stock and patched, through ``check``), the probes' traces, decoding's calls per
  token, and what changes with each release beside the patches' scenarios: batching, cache
  construction and offsets, MambaCache, MTP weights at load, ``max_kv_size``.
* ``release_only`` (declared in the modules, ``pytestmark``): entry points in fresh processes,
  run on the release's own row, not on a newest-mlx twin.
* A row with further packages runs ``PACKAGE_ROWS`` and its packages' files in ``PACKAGES``;
  everything else is its mlx-lm release's, proven on the release's own row.
"""

PYTHON_ONLY = (
    "test_activation.py",
    "test_engine_fake.py",
    "test_env.py",
    "test_matrix_file.py",
    "test_run_matrix.py",
    "test_cli.py::test_status_text_and_disabled_activation",
    "test_cli.py::test_status_exits_non_zero_when_a_patch_failed",
    "test_cli.py::test_check_unknown_id_is_a_clear_error",
    "test_cli.py::test_table_matches_matrix",
    "test_cli.py::test_status_text_is_a_summary_line_then_rows_within_100_columns",
    "test_cli.py::test_check_text_report",
)

CORE = (
    "test_matrix_cells.py",
    "test_cli.py",
    "test_probe_traces.py",
    "test_decode_overhead.py",
    "test_batching.py",
    "test_mamba_cache_compat.py",
    "test_arrays_cache_optional_size.py",
    "test_arrays_cache_graph.py",
    "test_offset_consumers.py",
    "test_mtp_load.py",
    "test_mtp_load_paths.py",
    "test_max_kv_size.py",
    "test_fixtures.py",
)

PACKAGE_ROWS = ("test_matrix_cells.py", "test_cli.py", "test_probe_traces.py")

PACKAGES = {
    "mlx-vlm": ("test_mlx_vlm_batching.py",),
    "vllm-mlx": ("test_vllm_mlx.py",),
}


def core_row_files(python_only: bool) -> list:
    """The test files (paths from the repository root) a ``suite: core`` row collects: its
    selection is by marker, and naming the files spares collecting (importing) the others."""
    names = list(CORE) + ([entry.split("::")[0] for entry in PYTHON_ONLY] if python_only else [])
    return [f"tests/{name}" for name in dict.fromkeys(names)]


def package_row_files(packages) -> list:
    """The test files (paths from the repository root) a row with further ``packages`` (names)
    runs."""
    names = list(PACKAGE_ROWS) + [f for name in packages for f in PACKAGES.get(name, ())]
    return [f"tests/{name}" for name in dict.fromkeys(names)]
