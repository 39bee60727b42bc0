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
            changed = [k for k in set(class_dict) | set(current)
                       if class_dict.get(k, MISSING) is not current.get(k, MISSING)
                       and k != "__slotnames__"]  # copyreg's cache, set by copy/pickle of instances
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


def shared_targets(applied_only=True):
    """{target: [patch ids]} of the targets more than one patch declares (applied ones only,
    by default), in matrix order."""
    live = states()
    by_target = {}
    for pid, target in _targets():
        if applied_only and live.get(pid) != "applied":
            continue
        by_target.setdefault(target, []).append(pid)
    return {t: ids for t, ids in by_target.items() if len(ids) > 1}


def assert_layers_ok():
    """On every declared target: at most one layer per patch, only layers of applied patches,
    and the layers in the declared order (a patch ``after`` another stays outside it)."""
    from mlx_lm_patches.engine.patching import layers

    the_matrix = matrix.load()
    live = states()
    seen = set()
    for _, target in _targets():
        owner, attr = owner_of_or_none(target)
        if owner is None or target in seen:
            continue
        seen.add(target)
        ids = [layer.patch_id for layer in layers(owner, attr)]
        assert len(ids) == len(set(ids)), f"{target}: a patch layered twice: {ids}"
        stale = [pid for pid in ids if live.get(pid) != "applied"]
        assert not stale, f"{target}: layers of patches not applied: {stale} in {ids}"
        for i, outer in enumerate(ids):
            for inner in ids[i + 1:]:
                assert inner not in the_matrix.later_than(outer), \
                    f"{target}: {inner} is declared after {outer} but lies inside it: {ids}"
        # every wrapper reachable from the live attribute is one of the layers
        obj, wrappers = vars(owner).get(attr, MISSING), []
        while obj is not MISSING and obj is not None and installed_by(obj):
            wrappers.append(installed_by(obj))
            obj = getattr(obj, "__wrapped__", None)
        assert len(wrappers) == len(set(wrappers)), f"{target}: wrapped twice: {wrappers}"
        assert not [w for w in wrappers if live.get(w) != "applied"], \
            f"{target}: a reverted patch's wrapper is still live: {wrappers}"
