"""Argument checks of the command line (``python -m inductor_ext``), all before any work starts:
argparse ``type=`` functions whose errors name the option (argparse prints
``error: argument --seqs: must be a positive int, got '0'`` and exits 2), and the one check of an
output path, :func:`check_output_path`, run on every ``--out`` and ``--json`` right after parsing
(its ``ValueError`` is ``main``'s one ``error:`` line, exit 2).

The numeric rules are :mod:`inductor_ext.validation`'s, the ones the configuration dataclasses use.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterable

from inductor_ext import validation as v

__all__ = ["arg_type", "positive_int", "seed", "positive_float", "nonempty_path", "check_output_path"]


def arg_type(parse: Callable[[str], object], name: str | None = None) -> Callable[[str], object]:
    """An argparse ``type=`` function: ``parse(text)``, its ``ValueError`` turned into argparse's
    usage error (exit 2) carrying the message (argparse prefixes ``argument --OPTION:``)."""
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name or getattr(parse, "__name__", "value")
    return convert


def _number(rule: v.Rule, cast: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            value = cast(text)
        except ValueError:
            value = text  # the rule names the expected kind
        return rule("", value)
    return parse


def _strip(parse: Callable[[str], object]) -> Callable[[str], object]:
    def inner(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:  # the rule's message without the empty label, the raw text quoted
            raise ValueError(str(exc).strip().replace(", got str ", ", got ")) from None
    return inner


positive_int = arg_type(_strip(_number(v.integer(1), int)), "positive_int")
positive_float = arg_type(_strip(_number(v.real(gt=0), float)), "positive_float")
def _path(text: str) -> pathlib.Path:
    if not text:
        raise ValueError("must be a path, got ''")
    return pathlib.Path(text)


nonempty_path = arg_type(_path, "nonempty_path")  # a non-empty path (pathlib.Path("") would be the working directory)
# torch.manual_seed's range, non-negative, with room for seed + 2 (the mismatch rollout's generator)
seed = arg_type(_strip(_number(v.integer(0, 2**64 - 3), int)), "seed")


def _dir_problem(directory: pathlib.Path, files: Iterable[str] = (), subject: str = "") -> str | None:
    """Why ``directory`` cannot be an output directory (None: it can), ``subject`` naming it in
    the reason. Writability is probed by making and removing a directory in it or in its nearest
    existing ancestor (``os.access`` alone says yes to root on a read-only or virtual file system)."""
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir():
            return f"{subject}exists and is not a directory"
        for name in files:
            entry = directory / name
            if (entry.exists() or entry.is_symlink()) and not entry.is_file():
                return f"{entry} exists and is not a regular file"
        where = directory
    else:
        where = directory.absolute().parent
        while not where.exists():
            where = where.parent
        if not where.is_dir():
            return f"{subject}cannot be made a directory: {where} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=where))
    except OSError as exc:
        return f"cannot write in {where} ({exc.strerror or exc})"
    return None


def check_output_path(path: os.PathLike | str, option: str, *, kind: str = "dir",
                      files: Iterable[str] = ()) -> pathlib.Path:
    """Check an output path before a run: ``ValueError`` naming ``option`` and ``path`` unless it
    can be written.

    ``kind="dir"``: ``path`` is an existing directory we can write in, or can be made as one (its
    nearest existing ancestor is a directory we can write in); an existing regular file (or other
    non-directory) is refused, and so is an entry named in ``files`` (the artifacts written
    inside) that exists but is not a regular file. ``kind="file"``: ``path`` is not a directory,
    its parent passes the ``"dir"`` check, and an existing file can be opened for appending.
    Nothing is left behind (a probe directory is made and removed). Returns ``path`` as a Path."""
    if kind not in ("dir", "file"):
        raise ValueError(f"check_output_path: kind must be 'dir' or 'file', got {kind!r}")
    if str(path) == "":
        raise ValueError(f"{option}: the path is empty")
    path = pathlib.Path(path)
    if kind == "dir":
        problem = _dir_problem(path, files)
    elif path.is_dir():
        problem = "is a directory, expected a file path"
    else:
        problem = _dir_problem(path.parent, subject=f"its directory {path.parent} ")
        if problem is None and path.exists():
            try:
                with open(path, "a"):
                    pass
            except OSError as exc:
                problem = f"cannot be written ({exc.strerror or exc})"
    if problem is not None:
        raise ValueError(f"{option} {path}: {problem}")
    return path
