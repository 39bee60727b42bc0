"""What a function's code refers to, read from its code object - for probes that look at how
mlx-lm (or mlx-vlm) wrote something. An install may ship bytecode without sources, where
``inspect.getsource`` raises: a probe must decide the same there.

* :func:`names` - every name a function (and the functions, lambdas and comprehensions defined in
  it) loads, stores or reads an attribute of, plus its string constants;
* :func:`tokens` - the same, in order, with constants and comparison operators: enough to find
  ``input_ids.tolist()`` (``["input_ids", "tolist"]``) or ``pad == h.shape[1]`` (``["pad", "h",
  "shape", 1, "=="]``) on every Python this package supports (3.10-3.13).
"""

import dis
from typing import List, Set

_COMPARISONS = ("==", "!=", "<=", ">=", "<", ">")


def _codes(func):
    func = getattr(func, "__func__", func)
    func = getattr(func, "__wrapped__", func)
    stack = [func.__code__]
    while stack:
        code = stack.pop(0)
        yield code
        stack += [c for c in code.co_consts if hasattr(c, "co_code")]


def names(func) -> Set[str]:
    out: Set[str] = set()
    for code in _codes(func):
        out.update(code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
        out.update(c for c in code.co_consts if isinstance(c, str))
    return out


def class_names(cls) -> Set[str]:
    """:func:`names` of every function defined in ``cls`` (methods, static and class methods,
    property accessors), with the names of its attributes."""
    out: Set[str] = set(vars(cls))
    for value in vars(cls).values():
        funcs = [getattr(value, "fget", None), getattr(value, "fset", None)] if isinstance(value, property) else [value]
        for func in funcs:
            func = getattr(func, "__func__", func)
            if hasattr(getattr(func, "__wrapped__", func), "__code__"):
                out |= names(func)
    return out


def tokens(func) -> List[object]:
    out: List[object] = []
    for code in _codes(func):
        for ins in dis.get_instructions(code):
            value = ins.argval
            if ins.opname == "COMPARE_OP":
                out.extend([op for op in _COMPARISONS if op in str(ins.argrepr)][:1])
                continue
            if ins.opname == "KW_NAMES" or (ins.opname == "LOAD_CONST" and isinstance(value, tuple)):
                out.extend(v for v in value if isinstance(v, (str, int)))
                continue
            if not ins.opname.startswith(("LOAD_", "STORE_")):
                continue
            if isinstance(value, tuple):  # LOAD_FAST_LOAD_FAST (3.13)
                out.extend(v for v in value if isinstance(v, str))
            elif isinstance(value, (str, int)) and not isinstance(value, bool):
                out.append(value)
    return out


def contains(found: List[object], pattern: List[object]) -> bool:
    """``pattern`` occurs in ``found`` as a contiguous run; a pattern item that is a callable
    matches the tokens it returns true for."""
    n = len(pattern)
    for i in range(len(found) - n + 1):
        if all(p(t) if callable(p) else (type(t) is type(p) and t == p)
               for p, t in zip(pattern, found[i:i + n])):
            return True
    return False
