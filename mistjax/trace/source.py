"""The line of the user's code behind a traced equation or a failed trace, for error messages.

A jaxpr equation remembers the Python stack that created it (``eqn.source_info``), and an exception its
traceback; both run through JAX, Flax, Hugging Face and mistjax before reaching the model's own code. The
user's line is the innermost frame outside the installed packages, the standard library and mistjax itself.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import TracebackType

from jax.extend import core as jex

_MISTJAX = str(Path(__file__).resolve().parents[1])
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) for k, p in sysconfig.get_paths().items()
                           if k in ("stdlib", "platstdlib", "purelib", "platlib")})) + (_MISTJAX,)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code (not an installed package, the standard library or mistjax)."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    try:
        path = str(Path(filename).resolve())
    except OSError:
        return False
    return not path.startswith(_LIBRARIES)


def _where(filename: str, line: int, function: str) -> str:
    return f"{filename}:{line} (in {function})"


def equation_line(eqn: jex.JaxprEqn) -> str | None:
    """``file:line (in function)`` of the user's code that created ``eqn``; None when no frame is the user's."""
    tb = getattr(eqn.source_info, "traceback", None)
    if tb is None:
        return None
    for frame in tb.frames:  # innermost first
        if is_user_file(frame.file_name):
            return _where(frame.file_name, frame.line_num, frame.function_name)
    return None


def exception_line(tb: TracebackType | None) -> str | None:
    """``file:line (in function)`` of the innermost user frame of an exception's traceback."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if is_user_file(code.co_filename):
            found = _where(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


__all__ = ["equation_line", "exception_line", "is_user_file"]
