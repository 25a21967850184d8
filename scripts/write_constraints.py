"""Write the known-good set: the installed version of every package that ``lightning-app-rlhf[dev]`` pulls in.

Usage: ``python scripts/write_constraints.py constraints.txt``, in an environment where the suite has just passed
(``scripts/check_latest.sh`` runs it with ``WRITE_CONSTRAINTS=1``). It walks the installed distributions' own
requirements from ``lightning-app-rlhf[dev]`` down, so packages that merely happen to be installed are left out.
torch is left out too: ``scripts/setup.sh`` installs it first (a GPU machine keeps its own build).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# The known-good set: the exact versions the test suite last passed with (CPU, Python {python}, torch {torch}, which
# scripts/setup.sh installs first and so is not listed here: a GPU machine keeps its own torch build).
# scripts/setup.sh installs through this file (pip install -c constraints.txt -e ".[dev]"). To move it forward:
# `bash scripts/check_latest.sh` tests the newest releases; WRITE_CONSTRAINTS=1 rewrites this file after a green run.
"""
LEFT_OUT = {"torch", "lightning-app-rlhf", "pip", "setuptools"}


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """``{name: version}`` of ``root`` and every installed distribution its requirements (with ``extras``) reach."""
    versions: dict[str, str] = {}
    pending = [(root, extras)]
    while pending:
        name, wanted = pending.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional requirement whose marker matched but that is not installed
        key = canonicalize_name(name)
        seen_before = key in versions
        versions[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            if canonicalize_name(req.name) not in versions or (req.extras and not seen_before):
                pending.append((req.name, tuple(req.extras)))
    return versions


def main(path: str) -> None:
    import platform

    versions = closure("lightning-app-rlhf", ("dev",))
    lines = [f"{name}=={version}" for name, version in sorted(versions.items()) if name not in LEFT_OUT]
    header = HEADER.format(python=".".join(platform.python_version_tuple()[:2]), torch=versions.get("torch", "?"))
    with open(path, "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pins to {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "constraints.txt")
