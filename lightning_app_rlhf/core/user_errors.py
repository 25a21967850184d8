"""What an error a user caused prints on the command line: one line naming the fix, and, for an error in the user's
own code (a reward function, a prompts function, a callback), that code's frames and exception, without the
framework's frames around them.

- :func:`one_line`: jsonargparse's nested, many-line refusal of a value ("Does not validate against any of the Union
  subtypes ...", 8 to 20 lines) as one sentence naming the option and what it expects;
- :func:`missing_package`: the ``ImportError`` of an optional package that is not installed (a logger's), and the
  ``pip install`` that fixes it;
- :func:`user_frames`: the frames of the user's own code in an error's traceback, as Python prints them;
- :func:`first_report`: whether this rank is the first of its job to report an error (the others, which hit the
  same error or stopped because of it, then print nothing).

Plain standard library: the command line (``cli.py``) decides when to print what (``--debug`` prints everything).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
"""This package's source directory: frames in it are the framework's, not the user's."""

_NESTED_VALUE = re.compile(r"Given value: NestedArg\(key='([^']*)', val=(.*)\)\s*$", re.MULTILINE)
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_EXPECTED = re.compile(r"Expected an? (?:<class '([\w.]+)'>|(.+))$")
_NOT_ACCEPTED = re.compile(r"(?:Option|Key) '([\w.]+)' is not accepted")
_CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")
_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value type:",
          "Given value:")
_PIP_NAMES = {"tensorboard": "tensorboard", "tensorboardX": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow",
              "comet_ml": "comet-ml", "neptune": "neptune", "yaml": "pyyaml", "sklearn": "scikit-learn",
              "deepspeed": "deepspeed", "peft": "peft", "vllm": "vllm"}
"""Import names whose ``pip install`` name differs, or that an error message names without a module attribute."""


def causes(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``, else ``__context__``), innermost last."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def one_line(message: str) -> str:
    """A many-line jsonargparse refusal as one sentence; any other message unchanged.

    ``--trainer.strategy.max_stalenes 1`` gives "--trainer.strategy.max_stalenes is not an option of
    lightning_app_rlhf.strategies.separation.SeparationStrategy", ``--trainer.strategy.max_staleness abc`` gives
    "--trainer.strategy.max_staleness 'abc': expected int or None"; a refusal of another shape keeps its specific
    lines, joined with "; ".
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    keys = _PARSER_KEY.findall(message)
    nested = _NESTED_VALUE.search(message)
    option = f"--{keys[0]}" if keys else ""
    value = None
    if nested:
        option, value = f"{option}.{nested.group(1)}", nested.group(2).strip()
    elif keys and (given := re.search(r"^\s*Given value: (.*)$", message, re.MULTILINE)) and len(keys) == 1:
        value = repr(given.group(1).strip())
    classes = _CLASS_PATH.findall(message)
    rejected = _NOT_ACCEPTED.findall(message)
    if rejected and option:
        owner = f" of {classes[-1]}" if classes else ""
        name = option if nested else f"{option}.{rejected[-1]}"
        return f"{name} is not an option{owner}"
    expected = _expected_types(lines, skip_str=bool(nested and classes))
    if expected and option:
        return f"{option} {value or ''}: expected {' or '.join(expected)}".replace(" :", ":")
    specific = [line.lstrip("- ") for line in lines if not line.startswith(_NOISE) and not _PARSER_KEY.match(line)
                and not line.lstrip("- ").startswith("Expected a")]
    head = f"{option}: " if option else ""
    return head + "; ".join(dict.fromkeys(line.rstrip(":") for line in specific if line)) if specific else lines[0]


def _expected_types(lines: list[str], skip_str: bool) -> list[str]:
    """The types of the innermost "Expected a <class 'T'>" lines (of the deepest option that has them); without the
    ``str`` of a ``str | Strategy`` union when the value was an option of the class (``skip_str``)."""
    found: list[str] = []
    for line in lines:
        if _PARSER_KEY.match(line):
            found = []  # a deeper option: its own expectations replace the outer ones
        match = _EXPECTED.match(line.lstrip("- "))
        if match:
            name = match.group(1) or match.group(2)
            name = {"NoneType": "None"}.get(name.rsplit(".", 1)[-1], name.rsplit(".", 1)[-1])
            if not (skip_str and name == "str"):
                found.append(name)
    return list(dict.fromkeys(found))


def missing_package(error: BaseException) -> tuple[str, str] | None:
    """``(what is missing, the fix)`` when ``error`` is, or was caused by, an ``ImportError`` of a package that is
    not installed (``ModuleNotFoundError``, or a library's own ``ModuleNotFoundError`` naming the package, as
    Lightning's TensorBoardLogger raises); None otherwise."""
    for cause in causes(error):
        if not isinstance(cause, ImportError):
            continue
        name = getattr(cause, "name", None)
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if not name:
            named = re.findall(r"`([\w.-]+)`", text) or re.findall(r"'([\w.-]+)'", text)
            name = next((n for n in named if n.split(".")[0] in _PIP_NAMES or n.isidentifier()), None)
        if not name:
            continue
        top = name.split(".")[0]
        sentences = [part for part in re.split(r"(?<=\.)\s+", text) if "pip install" not in part]
        return " ".join(sentences) or text, f"pip install {_PIP_NAMES.get(top, top)}"
    return None


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not this package, not the standard library, not an installed
    package (site-packages), not Python's frozen modules."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    installed = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    installed |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return not (path.is_relative_to(PACKAGE) or any(path.is_relative_to(Path(p).resolve()) for p in installed if p))


def user_frames(error: BaseException) -> tuple[BaseException, list[str]] | None:
    """The innermost error in ``error``'s chain that was raised in the user's own code, and its traceback from the
    user's code on, formatted as Python prints them (frames and the exception's line, without the ``Traceback``
    heading); None when no error of the chain was. Raised in the user's code: the innermost frames of the user's
    files come after every frame of this package (a library the user's code called may follow them); the frames
    printed start with the user's block of frames that ends there (not with a script of the user's that called this
    package, which then raised on its own)."""
    for cause in reversed(list(causes(error))):
        frames = traceback.extract_tb(cause.__traceback__)
        users = [i for i, frame in enumerate(frames) if is_user_file(frame.filename)]
        if not users or any(_in_package(frame.filename) for frame in frames[users[-1]:]):
            continue
        first = users[-1]
        while first > 0 and is_user_file(frames[first - 1].filename):
            first -= 1
        return cause, [*traceback.format_list(frames[first:]), *traceback.format_exception_only(cause)]
    return None


def _in_package(filename: str) -> bool:
    return not filename.startswith("<") and Path(filename).resolve().is_relative_to(PACKAGE)


REPORTS = Path(tempfile.gettempdir(), "lightning_app_rlhf-errors")
"""Where the ranks of a job on one machine note that one of them reported an error."""
REPORT_STALE_S = 600.0
"""A note older than this is another job's (same port, same process group), not this one's."""


def first_report(wait_s: float = 0.0, claim: bool = True) -> bool:
    """Whether this process is the first rank of its job (on this machine) to report an error: always outside a
    multi-process job (no ``MASTER_PORT``). The ranks hit the same error together (a reward
    that raises on every rank) or stop because another rank failed; one report says it once.

    Args:
        wait_s: Wait this long for another rank to claim the report first: for an error that is the consequence of
            another rank's (a collective that failed because that rank died), whose own report names the cause.
        claim: Claim the report (the others then stay silent). False for a consequence: where no rank reported a
            cause (a rank was killed, or ran out of memory), every survivor prints its own line, each naming the
            collective it waited in and the rank that stopped answering.
    """
    port = os.environ.get("MASTER_PORT")  # not WORLD_SIZE: Lightning's teardown unsets it before the error gets here
    if not port:
        return True
    note = REPORTS / f"{os.environ.get('MASTER_ADDR', 'localhost')}-{port}-{os.getpgid(0)}"
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if time.time() - note.stat().st_mtime < REPORT_STALE_S:
                return False  # another rank of this job reported
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not claim:
        return True
    try:
        REPORTS.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            if time.time() - note.stat().st_mtime >= REPORT_STALE_S:
                note.unlink()  # an earlier job's
        os.close(os.open(note, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # another rank claimed it just now
    except OSError:
        return True  # no shared directory: every rank reports
    return True
