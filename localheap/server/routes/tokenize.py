"""POST /v1/tokenize: count a text's tokens with the served model's tokenizer (the web UI's
document dialog shows it before a document is read; characters / 4 is off by 2x on code)."""

from __future__ import annotations

from fastapi import Depends

from ..prompts import tokenize as bounded
from ..tokens import encode_bounded
from ..schemas import TokenizeRequest
from ..services import Services, services
from . import api_router

router = api_router()


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, svc: Services = Depends(services)) -> dict:
    """{"text"} -> {"count", "model"}: the text alone, without the chat template around it."""
    ids = await bounded(encode_bounded, svc.tokenizer, body.text, None)   # in pieces: bounded memory
    return {"object": "tokenize", "model": svc.model_id, "count": len(ids)}
