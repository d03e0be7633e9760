"""tritonlm: LLM serving engine behind a Triton Python-backend model.

`from tritonlm import LLM, SamplingParams` is the offline API. Imports are lazy so the torch-free
engine core (sequence, block manager, scheduler) can be imported without torch.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from tritonlm.offline import LLM
        return LLM
    if name == "SamplingParams":
        from tritonlm.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
