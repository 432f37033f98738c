"""The versions of the libraries whose private internals the code relies on.

``workers/broker`` subclasses kombu's Redis transport and Celery's request
(private methods and attributes included); ``shared/prompting/jinja.py``
subclasses jinja2's code generator; ``api/sse.py`` overrides a private method
of sse-starlette's response; the quantized linear layers call private aten ops
of torch. Each works on the minor versions below only, which
``pyproject.toml`` pins and ``infra/requirements.lock`` locks; a module that
relies on one calls ``require`` at import, so another version fails at start
with a message naming it, instead of misbehaving while it serves.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED: dict[str, str] = {  # package -> the minor version its internals were read in
    "celery": "5.7",
    "kombu": "5.7",
    "sse-starlette": "3.7",
    "jinja2": "3.1",
    "torch": "2.13",
    "uvicorn": "0.54",
}


def unsupported(*packages: str) -> list[str]:
    """A message for each of ``packages`` (default: all) installed at an unsupported version."""
    problems = []
    for package in packages or tuple(SUPPORTED):
        try:
            installed = version(package)
        except PackageNotFoundError:
            continue  # an optional part that is not installed relies on nothing
        minor = ".".join(installed.split("+")[0].split(".")[:2])
        if minor != SUPPORTED[package]:
            problems.append(
                f"{package} {installed} is installed, but Sluice relies on internals of "
                f"{package} {SUPPORTED[package]}.x; install the version pyproject.toml pins "
                f"(pip install -e .) or infra/requirements.lock locks"
            )
    return problems


def require(*packages: str) -> None:
    """Raise ``RuntimeError`` naming every one of ``packages`` at an unsupported version."""
    problems = unsupported(*packages)
    if problems:
        raise RuntimeError("; ".join(problems))
