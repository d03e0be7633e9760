"""A tensor-parallel rank other than 0: loads its shard, then runs every step rank 0 sends.

    tritonlm-worker MODEL_DIR --rank R --world-size N --init-method tcp://HOST:PORT
"""
import argparse
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist


def _exit_when_orphaned(parent_pid: int) -> None:
    """Rank 0's process gone (killed, crashed): leave no orphan behind."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="tritonlm-orphan-watch").start()


def _load_runner(model_dir: str, rank: int, world_size: int, init_method: str, **settings):
    """Rank `rank`'s runner for a model version directory, joined with the other ranks;
    `settings` are rank 0's effective engine settings."""
    from tritonlm.config import WEIGHTS_DIR, EngineConfig
    from tritonlm.distributed.ranks import join_process_group
    from tritonlm.engine.model_runner import ModelRunner, resolve_device
    from tritonlm.models.loader import load_config
    config = EngineConfig.load(model_dir, **settings)
    join_process_group(rank, world_size, init_method, resolve_device(config.device, rank))
    weights_dir = Path(model_dir) / WEIGHTS_DIR
    return ModelRunner(config, load_config(weights_dir), weights_dir)


def _leave(code: int, message: str | None = None) -> NoReturn:
    """End the process without tearing gloo down: its threads' teardown, racing rank 0's closing
    of the group or the interpreter's finalizing, aborted a worker once ('terminate called
    without an active exception', after every step was served). The OS closes the sockets."""
    # A closed stream must not stop the exit.
    if message:
        with contextlib.suppress(OSError, ValueError):
            print(message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv=None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="tritonlm-worker", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--overrides", default="{}", help="engine settings, as JSON")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a native crash (abort, segfault) still names where it happened
    if args.parent_pid:
        _exit_when_orphaned(args.parent_pid)
    runner = _load_runner(args.model_dir, args.rank, args.world_size, args.init_method,
                          **json.loads(args.overrides))
    dist.barrier()  # loaded: rank 0 starts serving once every rank is here
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0)
        except RuntimeError as e:  # rank 0 closed the group without a word: it is gone
            _leave(1, f"tritonlm-worker rank {args.rank}: rank 0 left ({e}); exiting")
        if message[0] is None:  # shut down
            _leave(0)
        runner.execute(message[0])


if __name__ == "__main__":
    main()
