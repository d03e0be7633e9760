"""Rank 0's side of tensor parallelism: start the other ranks, join them in one process group,
send each step's plan, watch that they stay alive, and shut them down.

Ranks 1..N-1 run `python -m tritonlm.distributed.worker` (also the `tritonlm-worker` command,
for ranks on other hosts). Every model instance rendezvouses on a port of its own, so instances
on one host never collide; MASTER_ADDR / MASTER_PORT, when set, place the rendezvous instead.
"""
import contextlib
import json
import logging
import os
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tritonlm.distributed import parallel_state
from tritonlm.errors import EngineFatalError
from tritonlm.interpreter import python_executable
from tritonlm.ports import free_ports

logger = logging.getLogger(__name__)
# A collective that waits longer than this on a silent rank fails instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Ranks on other hosts are started by hand (`tritonlm-worker`) when this is set.
EXTERNAL_WORKERS_VARIABLE = "TRITONLM_EXTERNAL_WORKERS"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    parallel_state.set_rank(rank, world_size, connected=True)
    if device.type == "cpu":  # the ranks share this host's cores, or the OMP_NUM_THREADS given
        torch.set_num_threads(max(1, _cores() // world_size))


def _cores() -> int:
    """OMP_NUM_THREADS (its outer level, as in "4,2") where given, else the cores this process
    may run on."""
    given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))


def _rendezvous() -> str:
    address = os.environ.get("MASTER_ADDR")
    if address:
        return f"tcp://{address}:{os.environ.get('MASTER_PORT', '29500')}"
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


class RankGroup:
    """The tensor-parallel ranks of one engine, seen from rank 0."""

    def __init__(self, model_dir: Path, world_size: int, overrides: dict, device: torch.device):
        self.world_size = world_size
        self.serving = False
        init_method = _rendezvous()
        self.workers: list[subprocess.Popen] = []
        if not os.environ.get(EXTERNAL_WORKERS_VARIABLE):
            settings = json.dumps(overrides)
            self.workers = [subprocess.Popen(
                [python_executable(), "-m", "tritonlm.distributed.worker", str(model_dir), "--rank", str(rank),
                 "--world-size", str(world_size), "--init-method", init_method,
                 "--overrides", settings, "--parent-pid", str(os.getpid())])
                for rank in range(1, world_size)]
        logger.info("tensor parallel: %d ranks rendezvous at %s", world_size, init_method)
        try:
            join_process_group(0, world_size, init_method, device)
        except Exception:
            self.shutdown()
            raise

    def wait_until_loaded(self) -> None:
        """Meet every rank once its model is loaded: a rank that failed to load fails this."""
        self.check_alive()
        try:
            dist.barrier()
        except Exception as exc:
            raise self.failure("a tensor-parallel rank failed to load", exc) from exc
        self.check_alive()
        self.serving = True  # the other ranks now wait for plans

    def check_alive(self) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if code is not None:
                raise EngineFatalError(f"tensor-parallel rank {rank} exited with code {code}")

    def failure(self, what: str, exc: Exception, wait: float = 2.0) -> EngineFatalError:
        """The error for a broken collective, naming the rank that died when one did."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except EngineFatalError as lost:
                return lost
            time.sleep(0.05)
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return EngineFatalError(f"{what}: {first_line}")

    def broadcast_plan(self, plan) -> None:
        """Send the step's plan (None: shut down) to every rank."""
        self.check_alive()
        try:
            dist.broadcast_object_list([plan], src=0)
        except Exception as exc:  # a rank that died mid-step breaks the collective
            raise self.failure("tensor-parallel ranks lost", exc) from exc

    def kill(self) -> None:
        """Stop the other ranks without any collective (another thread may be inside one)."""
        for worker in self.workers:
            worker.kill()
            worker.wait()

    def shutdown(self, timeout: float = 10.0) -> None:
        if dist.is_initialized():
            if self.serving and all(w.poll() is None for w in self.workers):
                with contextlib.suppress(Exception):  # best effort: a lost rank cannot listen
                    dist.broadcast_object_list([None], src=0)
            dist.destroy_process_group()
            parallel_state.set_rank(0, 1)
        for worker in self.workers:
            try:
                worker.wait(timeout)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
