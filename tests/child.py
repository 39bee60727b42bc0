"""Helpers imported by the fresh interpreters the subprocess tests start (PYTHONPATH=tests).

Generic over every patch in compat_matrix.yaml: snapshots of each declared target, identity
checks after revert, and the no-double-wrapping invariant.
"""

import sys

from mlx_lm_patches.engine import matrix
from mlx_lm_patches.engine.patching import MISSING, TAG, installed_by, owner_of


def _targets():
    for spec in matrix.load().patches:
        for target in spec.targets:
            if target.split(":")[0] in sys.modules:
                yield spec.id, target


def snapshot():
    """{target: (object, copy of its __dict__ if it is a class)} for imported targets."""
    snap = {}
    for _, target in _targets():
        owner, attr = owner_of_or_none(target)
        if owner is None:
            continue
        obj = vars(owner).get(attr, MISSING)
        snap[target] = (obj, dict(vars(obj)) if isinstance(obj, type) else None)
    return snap


def owner_of_or_none(target):
    try:
        return owner_of(target)
    except (KeyError, AttributeError):
        return None, None


def assert_restored(snap):
    for target, (obj, class_dict) in snap.items():
        owner, attr = owner_of_or_none(target)
        now = MISSING if owner is None else vars(owner).get(attr, MISSING)
        assert now is obj, f"{target}: {now!r} is not the original {obj!r}"
        if class_dict is not None:
            current = dict(vars(obj))
            changed = [k for k in set(class_dict) | set(current) if class_dict.get(k, MISSING) is not current.get(k, MISSING)]
            assert not changed, f"{target}: attributes still changed after revert: {changed}"


def assert_not_double_wrapped():
    """No patch wraps its own object twice, anywhere under the targets (two different patches
    may stack on one target, e.g. both speculative patches on speculative_generate_step)."""
    seen = 0
    for _, target in _targets():
        owner, attr = owner_of_or_none(target)
        if owner is None:
            continue
        candidates = [vars(owner).get(attr)]
        if isinstance(candidates[0], type):
            candidates += list(vars(candidates[0]).values())
        for obj in candidates:
            if installed_by(obj):
                seen += 1
                ids, inner = [installed_by(obj)], getattr(obj, "__wrapped__", None)
                while inner is not None and isinstance(getattr(inner, TAG, None), str):
                    ids.append(getattr(inner, TAG))
                    inner = getattr(inner, "__wrapped__", None)
                assert len(ids) == len(set(ids)), f"{target} double wrapped: {ids}"
    return seen


def states():
    import mlx_lm_patches

    return {row.id: row.state for row in mlx_lm_patches.status()}
