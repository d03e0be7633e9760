"""The chat page (placeholder until written)."""
from fastapi import APIRouter

router = APIRouter()
