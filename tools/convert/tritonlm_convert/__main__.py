"""`python -m tritonlm_convert` runs the command line."""
from .cli import main

main()
