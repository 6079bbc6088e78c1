"""Loading a checkpoint never runs code, and a hostile or corrupt one fails naming the file.

Every payload below is a live exploit: plain ``pickle.loads`` runs it (it creates a marker
file), which the test checks first so that a refusal is not vacuous. The restricted
reader must refuse each, in every pickle protocol, and leave no marker behind.
"""

from __future__ import annotations

import functools
import operator
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from megapp.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from megapp.checkpointing.safe_reader import read_metadata_file
from megapp.distributed import DistributedDataParallel
from megapp.models import build_gpt_chunks
from megapp.optimizer import Optimizer
from megapp.training import TrainGroups
from tests.support import (
    SEED,
    dotted_system_payload,
    gpt_config,
    pickle_call,
    pickle_global,
    pickle_of,
    pickle_text,
)

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


# --- hand-made pickles: globals by any name, in any protocol --------------------------------


def _dotted_open(marker: Path, protocol: int) -> bytes:
    opener = pickle_global("torch.distributed.checkpoint.planner", "io.open", protocol)
    return pickle_of(
        pickle_call(opener, [pickle_text(str(marker), protocol), pickle_text("w", protocol)]),
        protocol,
    )


def _attrgetter_chain(marker: Path, protocol: int) -> bytes:
    """attrgetter("os.system")(<the metadata module>)("touch marker"): no dotted global."""
    getter = pickle_call(
        pickle_global("operator", "attrgetter", protocol), [pickle_text("os.system", protocol)]
    )
    module = pickle_global("torch.distributed.checkpoint", "metadata", protocol)
    system = getter + pickle.MARK + module + pickle.TUPLE + pickle.REDUCE
    return pickle_of(pickle_call(system, [pickle_text(f"touch {marker}", protocol)]), protocol)


def _getattr_chain(marker: Path, protocol: int) -> bytes:
    module = pickle_global("torch.distributed.checkpoint", "metadata", protocol)
    os_module = pickle_global("builtins", "getattr", protocol) + pickle.MARK + module
    os_module += pickle_text("os", protocol) + pickle.TUPLE + pickle.REDUCE
    system = pickle_global("builtins", "getattr", protocol) + pickle.MARK + os_module
    system += pickle_text("system", protocol) + pickle.TUPLE + pickle.REDUCE
    return pickle_of(pickle_call(system, [pickle_text(f"touch {marker}", protocol)]), protocol)


class _Reduce:
    """An object that pickles as ``func(*args)``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _builtin_exec(marker: Path, protocol: int) -> bytes:
    return pickle.dumps(_Reduce(exec, f"open({str(marker)!r}, 'w').close()"), protocol)


def _os_system(marker: Path, protocol: int) -> bytes:
    return pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol)


def _partial(marker: Path, protocol: int) -> bytes:
    return pickle.dumps(_Reduce(functools.partial(os.system, f"touch {marker}")), protocol)


def _methodcaller(marker: Path, protocol: int) -> bytes:
    call = operator.methodcaller("touch")
    return pickle.dumps(_Reduce(call, marker), protocol)


def _nested(marker: Path, protocol: int) -> bytes:
    """A well-formed Metadata whose one entry is a reduce deep inside."""
    inner = _Reduce(os.system, f"touch {marker}")
    return pickle.dumps(Metadata(state_dict_metadata={"x": [{"y": inner}]}), protocol)


PAYLOADS = {
    "dotted os.system": (dotted_system_payload, range(4, pickle.HIGHEST_PROTOCOL + 1)),
    "dotted io.open": (_dotted_open, range(4, pickle.HIGHEST_PROTOCOL + 1)),
    "operator.attrgetter": (_attrgetter_chain, PROTOCOLS),
    "builtins.getattr": (_getattr_chain, PROTOCOLS),
    "builtins.exec": (_builtin_exec, PROTOCOLS),
    "os.system": (_os_system, PROTOCOLS),
    "functools.partial": (_partial, PROTOCOLS),
    "operator.methodcaller": (_methodcaller, PROTOCOLS),
    "nested reduce": (_nested, PROTOCOLS),
}
CASES = [(name, p) for name, (_, protocols) in PAYLOADS.items() for p in protocols]


@pytest.mark.parametrize("name, protocol", CASES)
def test_a_hostile_metadata_file_is_refused_and_runs_nothing(tmp_path, name, protocol):
    make = PAYLOADS[name][0]
    marker = tmp_path / "ran"
    data = make(marker, protocol)
    pickle.loads(data)  # the payload is live: plain pickle runs it
    assert marker.exists(), f"{name} did not run under plain pickle"
    marker.unlink()

    file = tmp_path / ".metadata"
    file.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{file}: (names|sets the state)"):
        read_metadata_file(file)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_dotted_names_are_refused_even_at_old_protocols(tmp_path, protocol):
    file = tmp_path / ".metadata"
    file.write_bytes(dotted_system_payload(tmp_path / "ran", protocol))
    with pytest.raises(CheckpointError, match="dotted global"):
        read_metadata_file(file)


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_state_is_never_set_on_a_class(tmp_path, protocol):
    """BUILD on an allowed class would rewrite it for the whole process."""
    klass = pickle_global(Metadata.__module__, "Metadata", protocol)
    state = pickle.NONE + pickle.EMPTY_DICT + pickle_text("__repr__", protocol)
    state += pickle_global("torch", "Size", protocol) + pickle.SETITEM + pickle.TUPLE2
    file = tmp_path / ".metadata"
    file.write_bytes(pickle_of(klass + state + pickle.BUILD, protocol))
    before = dict(vars(Metadata))
    with pytest.raises(CheckpointError, match="sets the state of a type"):
        read_metadata_file(file)
    assert dict(vars(Metadata)) == before


# --- a real checkpoint, broken in each way -------------------------------------------------


def _single(seed=SEED):
    (chunk,) = build_gpt_chunks(gpt_config(num_layers=2), seed=seed)
    ddp = DistributedDataParallel(chunk)
    return [ddp], Optimizer([ddp], lr=1e-2), TrainGroups()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    chunks, optimizer, groups = _single()
    save_checkpoint(root, 1, chunks, optimizer, groups=groups)
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_the_real_metadata_reads(saved):
    metadata = read_metadata_file(saved / "iter_0000001" / ".metadata")
    assert any(k.startswith("model.decoder.layers.1.") for k in metadata.state_dict_metadata)
    chunks, optimizer, groups = _single(seed=SEED + 1)
    assert load_checkpoint(saved, chunks, optimizer, groups=groups).iteration == 1


def _break_metadata(path: Path, edit) -> None:
    metadata = read_metadata_file(path)
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _outside(metadata):
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../../etc/passwd"


def _negative(metadata):
    next(iter(metadata.storage_data.values())).offset = -5


def _transform(metadata):
    next(iter(metadata.storage_data.values())).transform_descriptors = ["stream.zstd"]


def _not_a_tensor(metadata):
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = "hello"


BROKEN = {
    "truncated shard": (
        lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:999]),
        r"__0_0.distcp: truncated \(999 bytes; the checkpoint's index needs \d+\)",
    ),
    "missing shard": (lambda d: (d / "__0_0.distcp").unlink(), r"__0_0.distcp: missing"),
    "garbled shard": (
        lambda d: (d / "__0_0.distcp").write_bytes(os.urandom((d / "__0_0.distcp").stat().st_size)),
        r"iter_0000001: its tensors cannot be read \(.+\); the checkpoint is corrupt",
    ),
    "truncated metadata": (
        lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:100]),
        r"\.metadata: unreadable \(.+\); the checkpoint is corrupt",
    ),
    "path outside": (
        lambda d: _break_metadata(d / ".metadata", _outside),
        "points outside the checkpoint directory",
    ),
    "negative offset": (
        lambda d: _break_metadata(d / ".metadata", _negative),
        "negative or non-integer byte range",
    ),
    "stream transform": (
        lambda d: _break_metadata(d / ".metadata", _transform),
        "asks for stream transforms",
    ),
    "entry not a tensor": (
        lambda d: _break_metadata(d / ".metadata", _not_a_tensor),
        "is a str; it is not DCP metadata",
    ),
    "common not json": (
        lambda d: (d / "common.json").write_text("{'iteration': 1"),
        r"common.json: unreadable .*; the checkpoint is corrupt",
    ),
    "common field": (
        lambda d: (d / "common.json").write_text(
            (d / "common.json").read_text().replace('"iteration": 1', '"iteration": "one"')
        ),
        r"common.json: iteration is 'one'; the checkpoint is corrupt",
    ),
    "bad marker": (
        lambda d: (d.parent / "latest_checkpointed_iteration.txt").write_text("latest\n"),
        "should hold an iteration number, found 'latest'",
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_corrupt_checkpoint_fails_naming_the_file(saved, tmp_path, name):
    root = _copy(saved, tmp_path)
    breaks, message = BROKEN[name]
    breaks(root / "iter_0000001")
    chunks, optimizer, groups = _single(seed=SEED + 1)
    before = [p.detach().clone() for p in chunks[0].module.parameters()]
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(root, chunks, optimizer, groups=groups)
    if name != "garbled shard":  # refused before any tensor is read: nothing changed
        after = list(chunks[0].module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
