"""The recurrent states after every token of one forward pass, for gated-delta layers of the
Qwen3-Next layout (Qwen3-Next, Qwen3.5/3.6) and Mamba-2 layers (Nemotron-H, Falcon-H1,
Granite-4-H, Mamba-2, PLaMo-2): what lets a row that rejected drafts keep exactly the tokens it
accepted, with no re-run.

Such a layer's cache holds two states: the last ``K - 1`` inputs of its short convolution (slot
0) and the recurrence's state (slot 1). A forward pass over ``W`` tokens replaces both, and the
states after fewer of them are gone. While :class:`StepStates` is open around one forward pass
of a model, each such layer

* hands its convolution's input (its ``K - 1`` earlier inputs, then the pass's ``W``) to the
  recorder: the convolution state after ``j`` tokens is the window of ``K - 1`` starting at ``j``,
  what a pass over those ``j`` tokens stores;
* gives the state after ``j`` tokens from mlx-lm's own function. A gated-delta layer runs
  ``gated_delta_update`` one token a call, the state after each kept: the very steps mlx-lm's
  ops path loops over in one call (on Metal: its kernel once per token instead of once per
  pass). A Mamba-2 layer runs ``ssm_update`` once, as stock, and the state after ``j`` tokens
  is ``ssm_update`` over the pass's first ``j`` (the same scan a pass over them runs), built
  when asked for and computed only if used: only where a rollback restores it. (Its scan of one
  token at a time cost a verify pass of 4 tokens a fifth to a third more on the CPU.)

A recurrent layer whose pass did not go through both (another layout: a Mamba-1 scan, short
convolutions alone, separate convolutions per projection, a layer outside this model's module)
is not recorded, and :meth:`StepStates.after` answers None for the whole pass: the caller goes
back as it did without it (to the state before the pass).
"""

import sys
from typing import Dict, List, Optional

_MIXERS = "_mlx_lm_patches_recurrent_mixers"
# mlx-lm's recurrences, by the name a model module calls them under: their arguments with a
# token axis (axis 1), each also taking the state before the pass (``state``); and whether the
# pass runs them a token a call (the states after each kept as they come), or once as stock with
# the state after ``j`` tokens computed when asked for, over the first ``j`` (lazily: only a state
# a rollback restores is ever computed)
_RECURRENCES = {
    "gated_delta_update": (("q", "k", "v", "a", "b"), True),
    "ssm_update": (("hidden_states", "B", "C", "dt"), False),
}


def _recurrences(module):
    return [name for name in _RECURRENCES if callable(getattr(module, name, None))]


def _mixers(model):
    """The model's modules with a ``conv1d`` child whose own module calls one of mlx-lm's
    recurrences (found once per model)."""
    import mlx.nn as nn

    known = getattr(model, "__dict__", {})
    found = known.get(_MIXERS)
    if found is None:
        modules = getattr(model, "modules", None)  # a model that is not an mlx Module: none found
        found = tuple(m for m in (modules() if callable(modules) else ())
                      if isinstance(m, nn.Module) and isinstance(m.get("conv1d"), nn.Conv1d)
                      and _recurrences(sys.modules.get(type(m).__module__)))
        known[_MIXERS] = found
    return found


class _RecordingConv:
    """A layer's convolution while a pass is recorded: called, it hands its input to the
    recorder; its weights and the rest read through (a model that reads ``conv1d.weight``
    itself, without calling it, is not recorded)."""

    def __init__(self, conv, recorder):
        self._conv, self._recorder = conv, recorder

    def __call__(self, x):
        self._recorder.conv_input = x
        return self._conv(x)

    def __getattr__(self, name):
        return getattr(self._conv, name)


class StepStates:
    """``with StepStates(model) as steps: logits = model(inputs, cache=caches)``; then
    ``steps.after(caches, before, wanted)``."""

    def __init__(self, model):
        self.mixers = _mixers(model)
        self.records = {}  # id(state before the pass) -> (that state, convolution input, width, j -> state after j)
        self.conv_input = None  # the last recorded convolution's input, until its recurrence takes it
        self._undo = []

    def __bool__(self):
        return bool(self.mixers)

    def __enter__(self):
        for module in {sys.modules[type(m).__module__] for m in self.mixers}:
            for name in _recurrences(module):
                original = getattr(module, name)
                setattr(module, name, self._recording_update(original, *_RECURRENCES[name]))
                self._undo.append(lambda module=module, name=name, original=original: setattr(module, name, original))
        for mixer in self.mixers:
            conv = mixer["conv1d"]
            mixer["conv1d"] = _RecordingConv(conv, self)
            self._undo.append(lambda mixer=mixer, conv=conv: mixer.__setitem__("conv1d", conv))
        return self

    def __exit__(self, *exc):
        while self._undo:
            self._undo.pop()()
        return False

    def _recording_update(self, original, along, stepwise):
        import inspect

        import mlx.core as mx

        signature = inspect.signature(original)
        if not {*along, "state"}.issubset(signature.parameters):
            return original  # not the mlx-lm function this expects: its layers are not recorded

        def tokens(arguments, start, end, state):
            part = dict(arguments, state=state)
            for name in along + (("mask",) if arguments.get("mask") is not None else ()):
                part[name] = arguments[name][:, start:end]
            return part

        def update(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            before, conv, self.conv_input = arguments.get("state"), self.conv_input, None
            if before is None or conv is None or arguments.get("lengths") is not None:
                return original(*args, **kwargs)
            width = arguments[along[0]].shape[1]
            if not stepwise:
                out = original(*args, **kwargs)
                after = lambda j: original(**tokens(arguments, 0, j, before))[1]  # noqa: E731
                self.records[id(before)] = (before, conv, width, after)
                return out
            outputs, states, state = [], [], before
            for t in range(width):
                y, state = original(**tokens(arguments, t, t + 1, state))
                outputs.append(y)
                states.append(state)
            self.records[id(before)] = (before, conv, width, lambda j: states[j - 1])
            return mx.concatenate(outputs, axis=1), state

        return update

    def after(self, caches, before, wanted) -> Optional[Dict[int, List]]:
        """For each ``j`` in ``wanted`` (0 < j < the pass's width), every leaf cache's recurrent
        ``(slots, left_padding)`` after the first ``j`` tokens of the pass (None where the leaf
        is not recurrent), in the form of ``before`` (``batch_speculation._states`` taken before
        the pass); None unless every recurrent leaf was recorded."""
        import mlx.core as mx

        from mlx_lm_patches.mechanisms.caches import flat_caches

        per_leaf = []
        for c, saved in zip(flat_caches(caches), before):
            if saved is None:
                per_leaf.append(None)
                continue
            slots, _ = saved
            record = self.records.get(id(slots[1])) if len(slots) == 2 and slots[1] is not None else None
            if record is None or record[0] is not slots[1] or getattr(c, "lengths", None) is not None:
                return None
            _, conv, width, state_after = record
            keep = None if slots[0] is None else slots[0].shape[1]
            if keep is None or conv.shape[1] != keep + width or conv.shape[2] != slots[0].shape[2]:
                return None
            per_leaf.append((conv, keep, state_after))
        out = {}
        for j in wanted:
            leaves = []
            for saved, recorded in zip(before, per_leaf):
                if recorded is None:
                    leaves.append(None)
                    continue
                conv, keep, state_after = recorded
                padding = saved[1]
                leaves.append(([mx.contiguous(conv[:, j:j + keep]), state_after(j)],
                               None if padding is None else padding - j))
            out[j] = leaves
        return out
