"""Command-line settings of ``pretrain_gpt.py``, with Megatron-LM's flag names.

The flags are the fields of :mod:`megapp.training.config`'s dataclasses, one argument group
per dataclass: :func:`build_parser` makes them, :func:`parse_args` parses and builds the
checked :class:`~megapp.training.config.PretrainConfig` (for the world size torchrun
announces). Every failure is an :class:`ArgumentsError` whose message names the flags to
change; launched from the command line it becomes one ``error: ...`` line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from megapp.training.config import GROUPS, PretrainConfig
from megapp.training.flag_groups import ArgumentsError, flag_name

__all__ = [
    "ArgumentsError",
    "build_parser",
    "config_from_flags",
    "exit_after_failure",
    "exit_with_error",
    "parse_args",
    "world_size_from_env",
]


# How long a process other than its node's first waits before reporting an error itself.
ERROR_GRACE_S = 10.0


def exit_with_error(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` to stderr and exit with status 2, once per node.

    torchrun stops every process of a node as soon as one of them exits, so the node's
    other processes wait (up to ``ERROR_GRACE_S``) for its first one, which reaches the
    same error, prints it and exits, which ends them. Only a process still running after
    the grace (its first process failed otherwise, or is slow to start) prints the error
    itself, so no message is lost to a process that exited first.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        time.sleep(ERROR_GRACE_S)
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


def exit_after_failure(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` and leave at once with status 1.

    For a failed collective: each rank says what it waited on, and the process groups are
    not torn down, since that would wait on the failed peer again.
    """
    print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are printed like every other setting's: once per node, one line."""

    def error(self, message: str) -> NoReturn:
        exit_with_error(self.prog, ArgumentsError(f"{message} (see {self.prog} --help)"))


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    meta = dict(f.metadata)
    help_text = meta.pop("help", "") or None
    kind = meta.pop("kind", None)
    meta.pop("flag", None)
    if isinstance(f.default, bool):
        group.add_argument(flag_name(f), dest=f.name, action="store_true", help=help_text)
        return
    if kind is None:
        kind = str if f.default is None or meta.get("nargs") else type(f.default)
    group.add_argument(
        flag_name(f), dest=f.name, type=kind, default=f.default, help=help_text, **meta
    )


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of every config group, grouped as the dataclasses are."""
    parser = _Parser(
        prog=os.path.basename(sys.argv[0]) or "pretrain_gpt.py",
        description="Pre-train a GPT with data, tensor and pipeline parallelism.",
        allow_abbrev=False,
    )
    for name, config in GROUPS.items():
        group = parser.add_argument_group(name, (config.__doc__ or "").split("\n")[0])
        for f in dataclasses.fields(config):
            _add_flag(group, f)
    return parser


def world_size_from_env() -> int:
    """The world size torchrun announces (1 when launched as a plain script)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def config_from_flags(
    argv: Sequence[str] | None = None, world_size: int | None = None
) -> PretrainConfig:
    """Parse ``argv`` and build the checked config; raises :class:`ArgumentsError`."""
    namespace = build_parser().parse_args(argv)
    world = world_size_from_env() if world_size is None else world_size
    if world < 1:
        raise ArgumentsError(f"world size must be >= 1, got {world}")
    return PretrainConfig.from_flags(vars(namespace), world)


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> PretrainConfig:
    """:func:`config_from_flags`; on an invalid setting print ``error: ...`` and exit with
    status 2 (once per node, see :func:`exit_with_error`)."""
    try:
        return config_from_flags(argv, world_size)
    except ArgumentsError as error:
        exit_with_error(build_parser().prog, error)
