"""tritonlm-convert: turn a Hugging Face checkpoint or a GGUF file into a tritonlm Triton model repository."""
from .convert import convert
from .errors import ConversionError

__all__ = ["ConversionError", "convert"]
