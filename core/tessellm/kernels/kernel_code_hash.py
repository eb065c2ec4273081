"""What identifies a kernel's behaviour across processes, for the profile cache key: a hash of
its code (bytecode, names, constants, simple closure values, the text of the file that defines
it, a `code_hash` a C kernel declares) and of its weight layout's prepare. Never an id or an
address, so a restart finds its decisions and an edited kernel is profiled again."""
from __future__ import annotations

import functools
import hashlib
import inspect
from pathlib import Path
from typing import Any

from tessellm.kernels.registry import Kernel


def _const_text(c: Any) -> str:
    """A process-independent text of a code constant (nested code, frozensets sorted)."""
    if inspect.iscode(c):
        return _code_text(c)
    if isinstance(c, (frozenset, set)):
        return "{" + ",".join(sorted(_const_text(x) for x in c)) + "}"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_text(x) for x in c) + ")"
    return f"{type(c).__name__}:{c!r}"


def _code_text(code: Any) -> str:
    return "|".join([code.co_code.hex(), ",".join(code.co_names),
                     ",".join(_const_text(c) for c in code.co_consts)])


@functools.lru_cache(maxsize=None)
def _file_hash(filename: str) -> str:
    try:
        return hashlib.sha256(Path(filename).read_bytes()).hexdigest()
    except OSError:
        return ""


def _source_file(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None


def _callable_text(fn: Any, depth: int = 0) -> str:
    """What identifies a callable's behaviour across processes (never an id or address):
    a `code_hash` it declares (the C kernels: source, flags, compiler, CPU); for Python code
    its bytecode, names and constants, simple closure values, and the text of the file that
    defines it (so an edited helper it calls counts too); for a callable object the same for
    its class's `__call__`; a builtin by its qualified name."""
    parts = []
    declared = getattr(fn, "code_hash", None)
    if isinstance(declared, str):
        parts.append(f"declared:{declared}")
    if isinstance(fn, functools.partial) and depth < 3:
        keywords = tuple(sorted((fn.keywords or {}).items()))
        parts.append("partial:" + _callable_text(fn.func, depth + 1)
                     + _const_text(tuple(fn.args)) + _const_text(keywords))
    code = getattr(fn, "__code__", None)
    target = fn
    if code is None and not inspect.isroutine(fn) and not inspect.isclass(fn):
        call = getattr(type(fn), "__call__", None)
        code, target = getattr(call, "__code__", None), type(fn)
        if depth < 3:   # callables it holds (a wrapper's inner fn); never counters or buffers
            for attr, value in sorted(getattr(fn, "__dict__", {}).items()):
                if callable(value) and not inspect.isclass(value):
                    parts.append(f"{attr}=" + _callable_text(value, depth + 1))
    if code is not None:
        parts.append(_code_text(code))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:    # an empty cell
                continue
            if isinstance(value, (int, float, str, bytes, bool, type(None))):
                parts.append(_const_text(value))
            elif callable(value) and depth < 3:
                parts.append(_callable_text(value, depth + 1))
        parts.append(_file_hash(code.co_filename))
    else:
        source = _source_file(target)
        if source:
            parts.append(_file_hash(source))
    qualname = getattr(target, "__qualname__", type(fn).__qualname__)
    parts.append(f"{getattr(target, '__module__', '')}.{qualname}")
    return "\n".join(parts)


def kernel_code_hash(kernel: Kernel) -> str:
    """A short hash of a kernel's code (its fn, and its weight layout's prepare), stable
    across processes: the profile cache key changes when the code does."""
    try:
        text = _callable_text(kernel.fn)
        if kernel.weight_layout is not None:
            text += ("\nlayout:" + kernel.weight_layout.name
                     + _callable_text(kernel.weight_layout.prepare))
    except Exception as e:  # an odd callable costs the hash its precision, never a failure
        text = (f"unhashable:{type(kernel.fn).__module__}.{type(kernel.fn).__qualname__}:"
                f"{type(e).__name__}")
    return hashlib.sha256(text.encode()).hexdigest()[:12]
