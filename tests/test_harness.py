"""The distributed test harness itself: results, tracebacks, hangs and recovery."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from megapp.testing import DistributedTestError, World, distributed, get_world


def _rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), os.getpid(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        print("rank one was here", flush=True)
        raise ValueError("rank one says no")
    return "fine"


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(60)


def _die_on_rank_zero():
    if dist.get_rank() == 0:
        os._exit(3)


def test_results_come_back_by_rank_from_the_same_processes():
    world = get_world(4)
    first = world.run(_rank_and_sum)
    second = world.run(_rank_and_sum)
    assert [r for r, _, _ in first] == [0, 1, 2, 3]
    assert all(total == 10.0 for _, _, total in first)
    assert [pid for _, pid, _ in first] == [pid for _, pid, _ in second]  # processes reused


def test_a_failing_rank_fails_with_its_traceback():
    world = get_world(2)
    with pytest.raises(DistributedTestError) as info:
        world.run(_fail_on_rank_one)
    message = str(info.value)
    assert "rank 1 (error)" in message and "ValueError: rank one says no" in message
    assert "rank 1 output ---\nrank one was here" in message  # what the rank printed
    assert "rank 0" not in message  # rank 0 succeeded and is not blamed
    assert world.alive  # nothing hung, so the world is kept
    assert [r for r, _, _ in world.run(_rank_and_sum)] == [0, 1]


@pytest.mark.slow  # a stuck rank: waits out its timeout, then restarts the world
def test_a_hung_rank_times_out_with_its_stack_and_the_world_restarts():
    world = get_world(2)
    with pytest.raises(DistributedTestError) as info:  # the hung rank never answers
        world.run(_hang_on_rank_one, timeout=2)
    message = str(info.value)
    assert "ranks [1] did not finish within 2 s" in message
    assert "_hang_on_rank_one" in message  # the hung rank's stack is in the report
    assert not world.alive
    assert world.run(_rank_and_sum)[1][2] == 3.0  # a fresh world serves the next call


def test_a_dead_rank_is_reported():
    world = get_world(2)
    with pytest.raises(DistributedTestError, match=r"(?s)rank 0 \(died\).*exit code 3"):
        world.run(_die_on_rank_zero, timeout=10)
    assert world.run(_rank_and_sum)[0][2] == 3.0


@pytest.mark.parametrize("world_size", [1, 2])
@distributed()
def test_decorator_takes_world_size_from_parameters(world_size):
    assert dist.get_world_size() == world_size


DRIVER = """
import torch.distributed as dist

from megapp.testing import World


def rank():
    return dist.get_rank()


if __name__ == "__main__":  # the forkserver imports this module in every worker
    world = World(2)
    print(world.run(rank), world._logdir is not None)
    world.close()
    print(world._logdir)
"""


@pytest.mark.slow  # a fresh interpreter starts its own world
def test_a_driver_script_runs_a_world_and_leaves_no_files(tmp_path):
    """A plain script (its own __main__, no PYTHONPATH) starts a world, and close() removes
    the world's log folder."""
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "driver.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[0, 1] True", "None"]
    world = World(1)
    world.start()
    logdir = world._logdir
    assert os.path.isdir(logdir)
    world.close()
    assert not os.path.exists(logdir)


@pytest.mark.slow  # starts worlds of its own
def test_a_world_listens_on_the_port_or_range_it_is_given():
    """Rank 0 listens on the first free port of the range; a range with none free, or one
    that names no valid port, fails with a message saying so."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"no free port in {port}\.\.{port} "):
            World(1, port=port).start()
        world = World(2, port=range(port, port + 20))
        try:
            world.start()
            assert port < world.port < port + 20  # the taken one is passed over
            assert [r for r, _, _ in world.run(_rank_and_sum)] == [0, 1]
        finally:
            world.close()
    for bad in (range(5, 5), 0, 70000, range(65530, 65540)):
        with pytest.raises(ValueError, match=r"non-empty range of ports in 1\.\.65535"):
            World(1, port=bad)
    with pytest.raises(TypeError, match="an int, a range or None"):
        World(1, port="29500")
