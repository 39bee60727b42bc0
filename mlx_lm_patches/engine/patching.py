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

Patches may share a target. Each live object of ours on an attribute is a *layer*; the layers
of one attribute form a chain (outermost first) kept in a registry, so a layer anywhere in the
chain can be taken out (its outer neighbour is relinked to what it wrapped) and a patch applied
again is put back at its declared place (``after:`` in the matrix: a later patch stays outside
the ones it is after) - never a second wrapper of one patch on one attribute.

Changes that do not live on a module or class attribute go through the patcher too, so status
shows them and revert undoes them:

* ``p.track(obj, undo, what)`` – a change made to one object (e.g. a loaded model); ``undo(obj)``
  runs on revert if the object is still alive.
* ``p.memo`` – a dict for state a patch keeps between calls (e.g. the last loaded model, a
  prompt-cache store seen): never a module global, which would outlive ``revert()``. It is
  cleared on revert (a patch applied again gets a fresh one) and its keys are listed in status,
  so name them as what they hold. Wrappers reach it through a closure or ``functools.partial``.
  Per-call scope (set for the duration of one call) goes in a ``contextvars.ContextVar``, not
  a ``threading.local``: one thread of an asyncio server runs many requests' tasks.
"""

import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional

TAG = "_self_mlx_lm_patches_id"  # on our wrapt proxies (wrapt keeps _self_* on the proxy)
SET_TAG = "__mlx_lm_patches_id__"  # on functions/classes we install with set()


class Switch(list):
    """Whether a patch's wrappers run, as wrapt's ``enabled``: true while it holds an item. A
    list, not a function, so that wrapt tests it in C on every call of a wrapped function
    (a callable would be one more Python call per call, e.g. per decoded token)."""

    def turn(self, on: bool) -> None:
        self[:] = [True] if on else []


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


@dataclass(eq=False)
class Op:
    kind: str  # "wrap" or "set"
    target: str
    owner: Any
    attr: str
    original: Any  # what owner.__dict__ held under this layer (another layer of ours), or MISSING
    installed: Any
    patch_id: str = ""

    def in_place(self) -> bool:
        """Our object is the live attribute, or lies under other layers of ours only (patches
        stacked on one target, e.g. wrappers of ``speculative_generate_step``), or waits for the
        layer that adds its attribute (suspended)."""
        return _chain_to(self) is not None or self in _SUSPENDED.get(_key(self.owner, self.attr), ())

    def undo(self) -> Optional[str]:
        """Take this layer out (restoring the original when it is the last one); returns a note
        when someone else has replaced our object."""
        suspended = _SUSPENDED.get(_key(self.owner, self.attr))
        if suspended and self in suspended:
            suspended.remove(self)
            return None
        path = _chain_to(self)
        if path is None:
            _forget(self)
            return f"{self.target} was replaced by someone else; left as is (switched off)"
        parent = path[-1] if path else None
        below = self.original
        if parent is None:
            if below is MISSING:
                if self.attr in vars(self.owner):
                    delattr(self.owner, self.attr)
            else:
                setattr(self.owner, self.attr, below)
        elif below is MISSING and not _has_beneath(self.owner, self.attr):
            # this layer added the attribute: the layers above it have nothing to wrap, so they
            # come off with it and wait (suspended) until a layer adds the attribute again
            delattr(self.owner, self.attr)
            for op in path:
                _forget(op)
            _SUSPENDED.setdefault(_key(self.owner, self.attr), [])[:0] = path
        else:
            parent.original = below
            if _links(parent.installed):
                if _links(self.installed):
                    inner = self.installed.__wrapped__
                elif below is not MISSING:
                    inner = below
                else:  # the layer added the attribute: the one above now wraps its absence
                    try:
                        inner = _beneath(self.owner, self.attr, self.target)
                    except AttributeError:
                        inner = _absent(self.target)
                parent.installed.__wrapped__ = inner
        _forget(self)
        return None


class Instance:
    """A change a patch made to one object outside the targets (``Patcher.track``)."""

    def __init__(self, obj, undo: Callable[[Any], None], what: str):
        try:
            self.ref = weakref.ref(obj)
        except TypeError:
            self.ref = lambda obj=obj: obj
        self.undo, self.what = undo, what

    def alive(self) -> bool:
        return self.ref() is not None


# -- the layers of ours on each attribute ---------------------------------------------------
_LAYERS: Dict[tuple, List[Op]] = {}  # (id(owner), attr) -> live layers
_SUSPENDED: Dict[tuple, List[Op]] = {}  # layers waiting for their attribute, outermost first


def _has_beneath(owner, attr) -> bool:
    try:
        _beneath(owner, attr, attr)
        return True
    except AttributeError:
        return False


def _resume(owner, attr) -> None:
    """Put suspended layers back on top of the attribute a layer has just added again."""
    waiting = _SUSPENDED.pop(_key(owner, attr), [])
    for op in reversed(waiting):  # innermost first
        below = vars(owner).get(attr, MISSING)
        op.original = below
        if _links(op.installed):
            op.installed.__wrapped__ = below
        setattr(owner, attr, op.installed)
        _remember(op)


def _key(owner, attr):
    return (id(owner), attr)


def _layer(owner, attr, obj) -> Optional[Op]:
    for op in _LAYERS.get(_key(owner, attr), ()):
        if op.installed is obj:
            return op
    return None


def _remember(op: Op) -> None:
    _LAYERS.setdefault(_key(op.owner, op.attr), []).append(op)


def _forget(op: Op) -> None:
    layers = _LAYERS.get(_key(op.owner, op.attr))
    if layers is not None:
        layers[:] = [o for o in layers if o is not op]
        if not layers:
            del _LAYERS[_key(op.owner, op.attr)]


def _chain_to(op: Op) -> Optional[List[Op]]:
    """The layers of ours above ``op``, outermost first, or ``None`` if ``op`` is not reached
    from the live attribute through layers of ours."""
    path: List[Op] = []
    current = vars(op.owner).get(op.attr, MISSING)
    while current is not op.installed:
        layer = _layer(op.owner, op.attr, current)
        if layer is None:
            return None
        path.append(layer)
        current = layer.original
    return path


def layers(owner, attr) -> List[Op]:
    """The live layers of ours on ``owner.attr``, outermost first (what tests inspect)."""
    out, current = [], vars(owner).get(attr, MISSING)
    while True:
        layer = _layer(owner, attr, current)
        if layer is None:
            return out
        out.append(layer)
        current = layer.original


def beneath_layers(owner, attr):
    """What ``owner.attr`` is under every live layer of ours (the stock object, or whatever
    another library put there before us): for a patch that calls the function itself from inside
    another patched call, where the other patches' wrappers must not run a second time."""
    found = layers(owner, attr)
    if not found:
        return getattr(owner, attr)
    if found[-1].original is MISSING:
        raise AttributeError(f"{attr} is only there through a patch")
    return found[-1].original


def _links(obj) -> bool:
    """Whether ``obj`` calls what it sits on through a settable ``__wrapped__`` (a wrapt proxy of
    ours, a stacked property) rather than replacing it."""
    import wrapt

    return isinstance(obj, (wrapt.FunctionWrapper, _StackedProperty))


def _absent(target):
    """Stands in under a layer whose attribute another layer added and has taken out again:
    calling it fails as the attribute's absence would."""
    def absent(*args, **kwargs):
        raise AttributeError(f"{target} is not there (the patch that added it is reverted)")

    absent.__name__ = absent.__qualname__ = target.rpartition(".")[2]
    return absent


def _beneath(owner, attr, target):
    """What ``owner.attr`` resolves to without ``owner``'s own entry (a base class's)."""
    if isinstance(owner, type):
        for klass in owner.__mro__[1:]:
            if attr in vars(klass):
                return vars(klass)[attr]
        raise AttributeError(f"cannot wrap {target}: no such attribute")
    return _static_lookup(owner, attr, target)


_MISSING = object()


class TargetNotDeclared(ValueError):
    pass


@dataclass
class Patcher:
    patch_id: str
    declared: tuple
    is_active: Any  # wrapt's ``enabled``: a :class:`Switch` (or a callable giving a bool)
    outer: FrozenSet[str] = frozenset()  # patches declared after this one: their layers stay outside
    ops: List[Op] = field(default_factory=list)
    deferred: List[tuple] = field(default_factory=list)  # (module name, thunk, target)
    instances: List[Instance] = field(default_factory=list)
    memo: Dict[str, Any] = field(default_factory=dict)

    # -- public API for patch modules -------------------------------------------------------
    def wrap(self, target: str, wrapper: Callable) -> None:
        self._run_or_defer(target, lambda: self._wrap_now(target, wrapper))

    def wrap_if_present(self, target: str, wrapper: Callable, own: bool = False) -> None:
        """``wrap`` for a target that some releases do not have (``?`` in the matrix): when its
        module is imported, wrapped if its owner has the attribute, else left alone. Present
        means defined there (a module-level ``__getattr__`` forwarding the name elsewhere, as
        mlx-vlm 0.6's ``mlx_vlm.generate`` does, does not make it a target there). ``own``: a
        class must define it itself; one it inherits from a class this patch wraps already goes
        through that wrapper (wrapping it again would run the wrapper twice)."""
        def thunk():
            try:
                owner, attr = owner_of(target)
            except (KeyError, AttributeError, TypeError):
                return
            if own and isinstance(owner, type):
                present = attr in vars(owner)
            else:
                present = inspect.getattr_static(owner, attr, _MISSING) is not _MISSING
            if present:
                self._wrap_now(target, wrapper)

        self._run_or_defer(target, thunk)

    def set(self, target: str, value: Any) -> None:
        self._run_or_defer(target, lambda: self._set_now(target, value))

    def module(self, name: str):
        """An already imported module (patch code should not import mlx-lm modules itself)."""
        return sys.modules[name]

    def track(self, obj, undo: Callable[[Any], None], what: str) -> None:
        """Record a change made to ``obj`` (not a target): ``undo(obj)`` runs on revert."""
        self.instances = [i for i in self.instances if i.alive()]
        self.instances.append(Instance(obj, undo, what))

    # -- engine side ------------------------------------------------------------------------
    def revert(self) -> List[str]:
        notes = []
        for op in reversed(self.ops):
            note = op.undo()
            if note:
                notes.append(note)
        for change in reversed(self.instances):
            obj = change.ref()
            if obj is None:
                continue
            try:
                change.undo(obj)
            except Exception as exc:  # one object's undo must not stop the rest
                notes.append(f"undoing {change.what} failed: {type(exc).__name__}: {exc}")
        self.ops.clear()
        self.deferred.clear()
        self.instances.clear()
        self.memo.clear()
        return notes

    def in_place(self) -> List[str]:
        """Targets whose installed object is no longer the live attribute."""
        return [op.target for op in self.ops if not op.in_place()]

    def outside(self) -> List[str]:
        """What this patch holds beyond its targets: changes on live objects, kept state."""
        counts: Dict[str, int] = {}
        for change in self.instances:
            if change.alive():
                counts[change.what] = counts.get(change.what, 0) + 1
        held = [f"{what} (x{n})" if n > 1 else what for what, n in counts.items()]
        held += [f"holds {key}" for key, value in self.memo.items() if value is not None]
        return held

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

    def _place(self, owner, attr):
        """Where a new layer of this patch goes: under the layers of patches declared after it.
        Returns (the layer above it or None, what it sits on: an object or MISSING)."""
        parent, current = None, vars(owner).get(attr, MISSING)
        while True:
            layer = _layer(owner, attr, current)
            if layer is None or layer.patch_id not in self.outer:
                return parent, current
            parent, current = layer, layer.original

    def _link(self, owner, attr, parent, obj) -> None:
        if parent is None:
            setattr(owner, attr, obj)
        else:
            parent.original = obj
            if _links(parent.installed):
                parent.installed.__wrapped__ = obj

    def _mine(self, owner, attr):
        """A layer of this patch already on the attribute: ours now (same patcher), or left
        switched off by an earlier revert under someone else's object (found through
        ``__wrapped__``), which is switched back on instead of adding another."""
        for layer in layers(owner, attr):
            if layer.patch_id == self.patch_id:
                return layer
        current, seen = vars(owner).get(attr, MISSING), 0
        while current is not MISSING and current is not None and seen < 32:
            if installed_by(current) == self.patch_id:
                return current
            current, seen = getattr(current, "__wrapped__", None), seen + 1
        return None

    def _wrap_now(self, target: str, wrapper: Callable) -> None:
        import wrapt

        owner, attr = owner_of(target)
        mine = self._mine(owner, attr)
        if isinstance(mine, Op):
            if mine not in self.ops:
                self.ops.append(mine)
            return  # already ours: never double-wrap
        if mine is not None:  # switched off under someone else's object: adopt it
            op = Op("wrap", target, owner, attr, getattr(mine, "__wrapped__", MISSING), mine, self.patch_id)
            self.ops.append(op)
            return
        parent, below = self._place(owner, attr)
        inner = below if below is not MISSING else _beneath(owner, attr, target)
        proxy = wrapt.FunctionWrapper(inner, wrapper, enabled=self.is_active)
        setattr(proxy, TAG, self.patch_id)
        self._install(Op("wrap", target, owner, attr, below, proxy, self.patch_id), parent)

    def _set_now(self, target: str, value: Any) -> None:
        owner, attr = owner_of(target)
        if vars(owner).get(attr, MISSING) is value or _layer(owner, attr, value) is not None:
            return
        try:
            setattr(value, SET_TAG, self.patch_id)
        except (AttributeError, TypeError):
            pass  # e.g. ints, builtins: identity check in Op.in_place still works
        parent, below = self._place(owner, attr)
        if isinstance(value, _StackedProperty):  # extends what it sits on, wherever that is
            value.__wrapped__ = below if below is not MISSING else _beneath(owner, attr, target)
        self._install(Op("set", target, owner, attr, below, value, self.patch_id), parent)

    def _install(self, op: "Op", parent) -> None:
        """Put ``op``'s object in the chain under ``parent`` (or live), record it, and give back
        the layers that waited for the attribute it adds."""
        self._link(op.owner, op.attr, parent, op.installed)
        _remember(op)
        self.ops.append(op)
        if parent is None and op.original is MISSING:
            _resume(op.owner, op.attr)


class _StackedProperty(property):
    """A property installed by a patch over another one (kept as ``__wrapped__``), so patches
    stacked on one property are recognised as ours and reverted latest first."""


def property_over(previous: property, compute: Callable[[Any, Any], Any]) -> property:
    """A property whose value is ``compute(self, value of previous)``: what a patch installs with
    ``p.set`` to extend a property that another patch may already have extended."""
    prop = _StackedProperty(lambda self: compute(self, prop.__wrapped__.__get__(self, type(self))))
    prop.__wrapped__ = previous  # read at each access: a layer under it may be taken out
    return prop


def _static_lookup(owner, attr, target):
    import inspect

    try:
        return inspect.getattr_static(owner, attr)
    except AttributeError:
        raise AttributeError(f"cannot wrap {target}: no such attribute") from None
