"""Reliability stress runs against a real server (tritonlm-stress; stress/cli.py)."""
