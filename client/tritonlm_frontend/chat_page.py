"""The chat page at GET / (LMDeploy's web chat role): one self-contained HTML file that streams
replies from /v1/chat/completions. Its starting settings come from here, per served model, as a
JSON blob in the page. (POST / is TGI's, in tgi_api.py.)"""
from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from tritonlm_client.chat_defaults import chat_settings

router = APIRouter()
logger = logging.getLogger("tritonlm.frontend")
PAGE = Path(__file__).parent / "static" / "chat.html"
SETTINGS_SLOT = "/*CHAT_SETTINGS*/{}"  # the placeholder chat.html holds for the blob


@lru_cache(maxsize=1)
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


def script_json(value) -> str:
    """JSON that is safe inside <script>: no '<', '>' or '&' can close the tag or start a comment
    (a model named "</script>..." stays text)."""
    # json.dumps escapes non-ASCII, so U+2028/U+2029 cannot end a line of the script either.
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page_settings(models) -> dict:
    """The starting settings of each served model, which of them the model itself gave, and the
    chat defaults for a model loaded after the page."""
    return {"fallback": chat_settings({}),
            "models": {m.name: {"settings": chat_settings(m.sampling_defaults),
                                "from_model": sorted(m.sampling_defaults)} for m in models}}


@router.get("/", response_class=HTMLResponse)
async def chat_page(request: Request):
    catalog = request.app.state.catalog
    try:
        await catalog.refresh()
    except Exception as exc:  # the page still loads; its model list will show the error
        logger.warning("chat page: cannot list models: %s", exc)
    settings = page_settings(catalog.models.values())
    return HTMLResponse(_page().replace(SETTINGS_SLOT, script_json(settings), 1),
                        headers={"Cache-Control": "no-cache"})
