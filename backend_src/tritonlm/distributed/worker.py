"""A tensor-parallel rank other than 0: loads its shard, then runs every step rank 0 sends.

    tritonlm-worker MODEL_DIR --rank R --world-size N --init-method tcp://HOST:PORT
"""
import argparse
import json
import os
import threading
import time

import torch.distributed as dist

from tritonlm.distributed import parallel_state


def _exit_when_orphaned(parent_pid: int) -> None:
    """Rank 0's process gone (killed, crashed): leave no orphan behind."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="tritonlm-orphan-watch").start()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tritonlm-worker", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--overrides", default="{}", help="engine settings, as JSON")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _exit_when_orphaned(args.parent_pid)
    from tritonlm.engine.model_runner import load_runner
    runner = load_runner(args.model_dir, rank=args.rank, world_size=args.world_size,
                         init_method=args.init_method, **json.loads(args.overrides))
    dist.barrier()  # loaded: rank 0 starts serving once every rank is here
    while True:
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0)
        except RuntimeError as e:  # rank 0 closed the group without a word: it is gone
            print(f"tritonlm-worker rank {args.rank}: rank 0 left ({e}); exiting", flush=True)
            return 1
        plan = message[0]
        if plan is None:
            break
        runner.execute(plan)
    dist.destroy_process_group()
    parallel_state.set_rank(0, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
