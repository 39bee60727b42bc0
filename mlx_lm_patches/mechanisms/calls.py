"""Reading a wrapped call's arguments by name, whatever way the caller passed them."""

import inspect


def bind_arguments(function, args, kwargs):
    """``inspect.signature(function).bind`` with defaults applied, as an editable mapping."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound
