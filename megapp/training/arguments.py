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
import tempfile
import time
from collections.abc import Sequence
from typing import NoReturn

from megapp.training.config import GROUPS, PretrainConfig
from megapp.training.flag_groups import ArgumentsError, flag_name

__all__ = [
    "ArgumentsError",
    "build_parser",
    "check_outputs",
    "config_from_flags",
    "exit_after_failure",
    "exit_with_error",
    "metrics_path",
    "parse_args",
    "world_size_from_env",
]


# How long a process that cannot tell whether another reported first waits before it does.
ERROR_GRACE_S = 10.0
# How long a rank whose collective failed looks for its node's report of the error that
# stopped the peer (which reaches it as the failure: a reset connection) before its own.
FAILURE_GRACE_S = 1.0


def _report_marker() -> str | None:
    """A path this torchrun attempt's processes on this node share (in torchrun's own
    per-attempt directory, removed with it); None outside torchrun."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    rank_dir = os.path.dirname(error_file)
    if not error_file or os.path.basename(rank_dir) != os.environ.get("LOCAL_RANK"):
        return None
    return os.path.join(os.path.dirname(rank_dir), "megapp-error-reported")


def _claim_report() -> bool | None:
    """Whether this process is its node's first to report an error (None: cannot tell)."""
    marker = _report_marker()
    if marker is None:
        return None
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return None
    return True


def exit_with_error(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` to stderr and exit with status 2, once per node.

    torchrun stops every process of a node as soon as one of them exits. Under torchrun
    the node's first process to reach an error says it and exits at once, which ends the
    others; a later one stays silent (its error is the same, or a consequence). Where
    that cannot be told, the node's processes other than its first wait (up to
    ``ERROR_GRACE_S``) for the first one, which reaches the same error; only one still
    running after the grace prints the error itself, so no message is lost.
    """
    first = _claim_report()
    if first is False or (first is None and int(os.environ.get("LOCAL_RANK", "0")) != 0):
        time.sleep(ERROR_GRACE_S)
    if first is not False:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


def exit_after_failure(prog: str, error: Exception) -> NoReturn:
    """Print ``prog: error: <error>`` and leave at once with status 1.

    For a failed collective: each rank says what it waited on (unless its node reports the
    error that stopped a peer: a peer that gives up closes its connections before it
    reports, so the node's report is looked for during ``FAILURE_GRACE_S``), and the
    process groups are not torn down, since that would wait on the failed peer again.
    """
    marker = _report_marker()
    deadline = time.monotonic() + FAILURE_GRACE_S
    while marker is not None and not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if marker is None or not os.path.exists(marker):
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
        # a switch that is on unless turned off takes --name and --no-name
        action = argparse.BooleanOptionalAction if f.default else "store_true"
        group.add_argument(
            flag_name(f), dest=f.name, action=action, default=f.default, help=help_text
        )
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


def _writable_place(flag: str, path: str) -> None:
    """Whether ``path`` (absent) could be created: its nearest existing ancestor must be a
    directory in which a directory can be made (tried, and removed again)."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ArgumentsError(f"{flag} {path}: {ancestor} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megapp-probe-", dir=ancestor))
    except OSError as error:
        raise ArgumentsError(
            f"{flag} {path}: cannot create it in {ancestor} ({error.strerror})"
        ) from None


def _check_directory(flag: str, path: str) -> None:
    if not os.path.lexists(path):
        _writable_place(flag, path)
    elif not os.path.isdir(path):
        raise ArgumentsError(f"{flag} {path}: is a file; {flag} names a directory")
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".megapp-probe-", dir=path))
        except OSError as error:
            raise ArgumentsError(f"{flag} {path}: cannot write there ({error.strerror})") from None


def _check_file(flag: str, path: str) -> None:
    if not os.path.lexists(path):
        _writable_place(flag, path)
    elif os.path.isdir(path):
        raise ArgumentsError(f"{flag} {path}: is a directory; {flag} names a file")
    elif not os.access(path, os.W_OK):
        raise ArgumentsError(f"{flag} {path}: cannot append to it (no write permission)")


def metrics_path(config: PretrainConfig) -> str:
    """The metrics file: ``--metrics-path``, else metrics.jsonl in ``--save`` or here."""
    given = config.logging.metrics_path
    return given or os.path.join(config.checkpoint.save or ".", "metrics.jsonl")


def check_outputs(config: PretrainConfig) -> None:
    """Every place the run writes (checkpoints, metrics, TensorBoard, the Hugging Face
    export, the data caches) can be written, before any rank starts; raises
    :class:`ArgumentsError` naming the flag. Nothing is left behind."""
    ckpt, logging = config.checkpoint, config.logging
    directories = (
        ("--save", ckpt.save),
        ("--save-hf", ckpt.save_hf),
        ("--tensorboard-dir", logging.tensorboard_dir),
        ("--data-cache-path", config.data.data_cache_path),
    )
    for flag, path in directories:
        if path is not None:
            _check_directory(flag, path)
    _check_file("--metrics-path", metrics_path(config))


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> PretrainConfig:
    """:func:`config_from_flags` and :func:`check_outputs`; on an invalid setting print
    ``error: ...`` and exit with status 2 (once per node, see :func:`exit_with_error`)."""
    try:
        config = config_from_flags(argv, world_size)
        check_outputs(config)
    except ArgumentsError as error:
        exit_with_error(build_parser().prog, error)
    return config
