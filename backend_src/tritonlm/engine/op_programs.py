"""Recording a model step as an op program (csrc/op_program.cpp), the CPU's decode graphs: a
dispatch mode runs the step as usual and appends every op that computes (not views, not bare
allocations) with its arguments; a replay runs the same ops from C++ on the same tensors.

What a program cannot hold refuses the recording (`RecordingRefused`), and the caller runs that
step shape eagerly from then on: reading a tensor's value into Python (whose branch a replay
would not retake), tensors made from Python data during the step (their values would be
frozen), and ops without a dispatcher schema a replay can call. Work done outside the
dispatcher (NumPy, Triton's CPU interpreter) is invisible here: only code whose tensor work is
all torch and our C++ ops may be recorded (the model runner records only with its C++ kernels).
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Tensors made from Python data during the step (tensor values read into Python, and results
# whose shape follows tensor values, are told by their ops' tags).
_FROM_PYTHON = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# Allocations: only their storage matters (what fills it is recorded).
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}


def _storages(values) -> set[int]:
    """The storages of `values`' tensors; oneDNN's opaque weights (cpu_gemm.OneDnnWeight) have
    none, and are only ever inputs."""
    return {v.untyped_storage().data_ptr() for v in values
            if isinstance(v, torch.Tensor) and not v.is_mkldnn}


def _value_dependent(func, args) -> bool:
    if func in _FROM_PYTHON or torch.Tag.data_dependent_output in func.tags:
        return True
    if func is aten.index.Tensor:  # integer indices give a fixed shape, boolean masks do not
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return torch.Tag.dynamic_output_shape in func.tags


def _result_into_out(func, args, kwargs, out) -> dict:
    """kwargs with `out` set to the op's result where the op can write its result into an `out`
    it was not given (our kernels: `Tensor(a!)? out=None`): its replays then write straight into
    the recorded result, which later ops read, instead of a fresh tensor copied there."""
    schema = func._schema
    position = next((i for i, a in enumerate(schema.arguments)
                     if a.name == "out" and a.alias_info is not None and a.alias_info.is_write
                     and isinstance(a.type, torch.OptionalType)), None)
    if (position is None or position < len(args) or kwargs.get("out") is not None
            or not isinstance(out, torch.Tensor)):
        return kwargs
    return {**kwargs, "out": out}


class RecordingRefused(RuntimeError):
    """The step did something an op program cannot replay."""


class ProgramRecorder(TorchDispatchMode):
    """`with ProgramRecorder(program): out = step()` runs the step and records it into
    `program` (a kernels.OpProgram); `program.replay()` then redoes it, leaving its results
    in `out`."""

    def __init__(self, program):
        super().__init__()
        self.program = program
        self.result_storages: set[int] = set()  # data addresses of the program's fresh results

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _value_dependent(func, args):
            raise RecordingRefused(f"{func}'s result depends on tensor values or Python data")
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        inputs, fresh = _storages(args), _storages(results)
        # A view (or `to` returning its input; ops that may alias decide as they run): replays
        # see the same storage. Mutating ops write through theirs and are recorded.
        if func in _ALLOCATIONS or (not func._schema.is_mutable and fresh & inputs):
            return out
        if func._schema.returns and not isinstance(out, (tuple, torch.Tensor)):
            raise RecordingRefused(f"{func} returns {type(out).__name__}")
        for r in results:
            storage = isinstance(r, torch.Tensor) and not r.is_mkldnn and r.untyped_storage()
            if storage and storage.data_ptr() not in inputs:
                self.result_storages.add(storage.data_ptr())
        kwargs = _result_into_out(func, args, kwargs, out)
        try:
            self.program.add(func._schema.name, func._schema.overload_name, tuple(args), kwargs,
                             [r if isinstance(r, torch.Tensor) else None for r in results]
                             if func._schema.returns else [])
        except RuntimeError as e:
            raise RecordingRefused(str(e)) from e
        return out
