"""TGI's API (placeholder until written)."""
from fastapi import APIRouter

from .errors import APIError

router = APIRouter()


def error_type(error: APIError) -> str:
    return "validation" if error.status in (400, 422) else "generation"
