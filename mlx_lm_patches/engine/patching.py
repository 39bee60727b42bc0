"""Revertible, tagged patch operations: the only way patch modules touch mlx-lm.

A patch module's ``apply(p)`` receives a :class:`Patcher` and calls

* ``p.wrap("pkg.mod:Class.method", wrapper)`` – wrap an existing function or method with a
  ``wrapt.FunctionWrapper`` (``wrapper(wrapped, instance, args, kwargs)``). The wrapper is
  switched off everywhere (alias copies included) when the patch is reverted.
* ``p.set("pkg.mod:Class.attr", value)`` – replace or add a class or module attribute.

Every target must be declared in the patch's ``targets`` in compat_matrix.yaml (or lie under
one), so the matrix stays truthful. Operations on modules that are not imported yet are
deferred until the import (post-import hook) – the engine wires that up. Each operation records
what it replaced so :meth:`Patcher.revert` restores the original objects, and tags what it
installed so the engine never double-wraps and only reverts its own objects.
"""

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

TAG = "_self_mlx_lm_patches_id"  # on our wrapt proxies (wrapt keeps _self_* on the proxy)
SET_TAG = "__mlx_lm_patches_id__"  # on functions/classes we install with set()


class _Missing:
    def __repr__(self):
        return "<missing>"


MISSING = _Missing()


def split_target(target: str):
    module, _, qualname = target.partition(":")
    return module, qualname


def owner_of(target: str):
    """Resolve ``module:Qual.attr`` to (owner object, attribute name), without binding."""
    module_name, qualname = split_target(target)
    owner = sys.modules[module_name]
    *path, attr = qualname.split(".")
    for name in path:
        owner = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    return owner, attr


def installed_by(obj) -> Optional[str]:
    """The patch id that installed ``obj``, or ``None`` if it is not ours."""
    try:
        tag = getattr(obj, TAG, None)
    except Exception:
        tag = None
    if isinstance(tag, str):
        return tag
    try:
        tag = vars(obj).get(SET_TAG) if hasattr(obj, "__dict__") else None
    except TypeError:
        tag = None
    return tag if isinstance(tag, str) else None


@dataclass
class Op:
    kind: str  # "wrap" or "set"
    target: str
    owner: Any
    attr: str
    original: Any  # what owner.__dict__ held, or MISSING
    installed: Any

    def in_place(self) -> bool:
        """Our object is the live attribute, or is wrapped only by other patches of ours
        (patches stacked on one target, e.g. two wrappers of ``speculative_generate_step``)."""
        current = vars(self.owner).get(self.attr, MISSING)
        while current is not self.installed:
            if installed_by(current) is None or getattr(current, "__wrapped__", None) is None:
                return False
            current = current.__wrapped__
        return True

    def undo(self) -> Optional[str]:
        """Restore the original; returns a note when someone else has replaced our object."""
        if vars(self.owner).get(self.attr, MISSING) is not self.installed:
            return f"{self.target} was replaced by someone else; left as is"
        if self.original is MISSING:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.original)
        return None


class TargetNotDeclared(ValueError):
    pass


@dataclass
class Patcher:
    patch_id: str
    declared: tuple
    is_active: Callable[[], bool]
    ops: List[Op] = field(default_factory=list)
    deferred: List[tuple] = field(default_factory=list)  # (module name, thunk, target)

    # -- public API for patch modules -------------------------------------------------------
    def wrap(self, target: str, wrapper: Callable) -> None:
        self._run_or_defer(target, lambda: self._wrap_now(target, wrapper))

    def set(self, target: str, value: Any) -> None:
        self._run_or_defer(target, lambda: self._set_now(target, value))

    def module(self, name: str):
        """An already imported module (patch code should not import mlx-lm modules itself)."""
        return sys.modules[name]

    # -- engine side ------------------------------------------------------------------------
    def revert(self) -> List[str]:
        notes = []
        for op in reversed(self.ops):
            note = op.undo()
            if note:
                notes.append(note)
        self.ops.clear()
        self.deferred.clear()
        return notes

    def in_place(self) -> List[str]:
        """Targets whose installed object is no longer the live attribute."""
        return [op.target for op in self.ops if not op.in_place()]

    # -- internals --------------------------------------------------------------------------
    def _check_declared(self, target: str) -> None:
        for declared in self.declared:
            if target == declared or target.startswith(declared + "."):
                return
        raise TargetNotDeclared(
            f"patch {self.patch_id!r} touches {target!r}, which is not under its targets "
            f"{list(self.declared)} in compat_matrix.yaml"
        )

    def _run_or_defer(self, target: str, thunk: Callable[[], None]) -> None:
        self._check_declared(target)
        module_name, _ = split_target(target)
        if module_name in sys.modules:
            thunk()
        else:
            self.deferred.append((module_name, thunk, target))

    def _wrap_now(self, target: str, wrapper: Callable) -> None:
        import wrapt

        owner, attr = owner_of(target)
        own = vars(owner).get(attr, MISSING)
        if own is not MISSING and installed_by(own) == self.patch_id:
            return  # already ours: never double-wrap
        original = own if own is not MISSING else _static_lookup(owner, attr, target)
        proxy = wrapt.FunctionWrapper(original, wrapper, enabled=self.is_active)
        setattr(proxy, TAG, self.patch_id)
        setattr(owner, attr, proxy)
        self.ops.append(Op("wrap", target, owner, attr, own, proxy))

    def _set_now(self, target: str, value: Any) -> None:
        owner, attr = owner_of(target)
        own = vars(owner).get(attr, MISSING)
        if own is value:
            return
        try:
            setattr(value, SET_TAG, self.patch_id)
        except (AttributeError, TypeError):
            pass  # e.g. ints, builtins: identity check in Op.in_place still works
        setattr(owner, attr, value)
        self.ops.append(Op("set", target, owner, attr, own, value))


class _StackedProperty(property):
    """A property installed by a patch over another one (kept as ``__wrapped__``), so patches
    stacked on one property are recognised as ours and reverted latest first."""


def property_over(previous: property, compute: Callable[[Any, Any], Any]) -> property:
    """A property whose value is ``compute(self, value of previous)``: what a patch installs with
    ``p.set`` to extend a property that another patch may already have extended."""
    prop = _StackedProperty(lambda self: compute(self, previous.__get__(self, type(self))))
    prop.__wrapped__ = previous
    return prop


def _static_lookup(owner, attr, target):
    import inspect

    try:
        return inspect.getattr_static(owner, attr)
    except AttributeError:
        raise AttributeError(f"cannot wrap {target}: no such attribute") from None
