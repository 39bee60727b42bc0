"""Write docs/patches.md: every patch of compat_matrix.yaml - what it fixes, the affected releases,
the first fixed release, its upstream references and (where it has one) its Metal note.

    uv run -q --no-project --with pyyaml --with packaging python tools/patch_table.py [--check]

``--check`` writes nothing and exits 1 if the committed file differs (tests/test_matrix_file.py
runs the same comparison).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "docs" / "patches.md"

HEADER = """\
# Patches

<!-- Generated from compat_matrix.yaml by tools/patch_table.py: edit the matrix, then run the tool. -->

Every patch, from `compat_matrix.yaml` (the single source of versions, upstream links and
fixed-in releases). Each patch module (`mlx_lm_patches/patches/<id with _>.py`) says in its
docstring what the bug is, how it is fixed and when the patch can be retired.

"Affected" is where the bug is known; an open range means upstream has not fixed it yet and the
probe decides on newer releases. A patch about another distribution's bug (mlx-vlm, vllm-mlx)
gives that distribution's versions.

"""


def render_references(the_matrix) -> str:
    lines = ["## Upstream references", ""]
    for spec in the_matrix.patches:
        lines.append(f"* `{spec.id}`: " + ", ".join(f"<{url}>" for url in spec.upstream))
    notes = [spec for spec in the_matrix.patches if spec.metal_note]
    if notes:
        lines += ["", "## Metal", ""]
        lines += [f"* `{spec.id}`: {' '.join(spec.metal_note.split())}" for spec in notes]
    return "\n".join(lines)


def render(the_matrix) -> str:
    from mlx_lm_patches.__main__ import render_table  # what ``python -m mlx_lm_patches table`` prints

    return HEADER + render_table(the_matrix) + "\n\n" + render_references(the_matrix) + "\n"


def _matrix():
    from mlx_lm_patches.engine import matrix

    return matrix.load(str(REPO / "compat_matrix.yaml"))


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO))
    argv = sys.argv[1:] if argv is None else argv
    text = render(_matrix())
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.is_file() else ""
        if current != text:
            print(f"{TARGET.relative_to(REPO)} is stale: run tools/patch_table.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
