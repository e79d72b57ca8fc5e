"""POST /v1/embeddings (OpenAI's): each input's vector, pooled from the served model's last
hidden states (--embed-pooling: mean by default) and scaled to unit length (embeddings.py)."""

from __future__ import annotations

import json

from fastapi import Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...embedding import as_base64, finish
from ..embeddings import check_backend, embed, embedding_prompt, input_limit
from ..errors import BadRequest
from ..prompts import tokenize
from ..schemas import EmbeddingRequest
from ..services import Services, services
from . import api_router

router = api_router()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, svc: Services = Depends(services)) -> Response:
    svc.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise BadRequest(bad[1], bad[0])
    check_backend(svc)
    hidden = svc.backend.model_shapes().hidden
    if body.dimensions is not None and body.dimensions > hidden:
        raise BadRequest(f"dimensions must be at most {hidden} for this model (its hidden size)", "dimensions")
    limit = input_limit(svc)
    prompts = [await tokenize(embedding_prompt, svc.tokenizer, item, i, limit)   # off the event loop
               for i, item in enumerate(body.inputs())]
    vectors = await embed(svc, request, prompts)
    used = sum(len(p.tokens) for p in prompts)

    def answer() -> bytes:   # off the event loop: 2,048 vectors of 4,096 floats take seconds to write
        data = []
        for i, v in enumerate(vectors):
            v = finish(v, body.dimensions)
            data.append({"object": "embedding", "index": i,
                         "embedding": as_base64(v) if body.encoding_format == "base64" else v.tolist()})
        return json.dumps({"object": "list", "data": data, "model": svc.model_id,
                           "usage": {"prompt_tokens": used, "total_tokens": used}}).encode()

    return Response(await run_in_threadpool(answer), media_type="application/json")
