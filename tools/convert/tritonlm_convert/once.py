"""A conversion several processes share (the benchmark's cached SmolLM2, the test workers' one):
the first to ask converts, the others wait for it on an flock beside the output."""
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tritonlm.config import WEIGHTS_DIR


def convert_once(output: Path, *args: str) -> Path:
    """`tritonlm-convert ARGS --output OUTPUT` unless OUTPUT holds its model already; returns the
    model directory, OUTPUT/llm."""
    model = output / "llm"
    done = model / "1" / WEIGHTS_DIR
    if done.is_dir():
        return model
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output.parent / f".{output.name}.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # one conversion at a time; freed if this process dies
        if not done.is_dir():  # nor after waiting for a process that held the lock
            # Converted aside and renamed into place: a run cut short leaves no half-written
            # repository that the check above would take as done.
            shutil.rmtree(output, ignore_errors=True)
            aside = output.parent / f".{output.name}.converting"
            shutil.rmtree(aside, ignore_errors=True)  # a run killed while converting
            converter = Path(sys.executable).parent / "tritonlm-convert"
            subprocess.run([str(converter), *args, "--output", str(aside)], check=True)
            os.rename(aside, output)
    return model
