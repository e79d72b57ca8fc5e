"""OpenAI's Conversations API (/v1/conversations): conversations and their items, kept with the
sessions (conversations.ConversationLog). A response names one by `conversation`."""

from __future__ import annotations

from typing import Any, Literal, Optional

from fastapi import Depends, Query

from ..conversations import item_finders, validate_items
from ..responses import resolve_references
from ..schemas import Strict
from ..services import Services, owner, services
from . import api_router

router = api_router(prefix="/v1/conversations")

# A conversation is visible only to the API key that created it (another key's answers 404
# exactly like a missing one), as sessions and kept responses are.


class ConversationCreate(Strict):
    items: Optional[list[Any]] = None
    metadata: Optional[dict[str, Any]] = None


class ConversationUpdate(Strict):
    metadata: Optional[dict[str, Any]]


class ItemsCreate(Strict):
    items: list[Any]


@router.post("")
async def create_conversation(body: Optional[ConversationCreate] = None, who: Optional[str] = Depends(owner),
                              svc: Services = Depends(services)) -> dict:
    body = body or ConversationCreate()
    items = resolve_references(validate_items(body.items), item_finders(svc, who), "items")
    return svc.conversations.create(items, body.metadata, who).body()


@router.get("/{conversation_id}")
async def get_conversation(conversation_id: str, who: Optional[str] = Depends(owner),
                           svc: Services = Depends(services)) -> dict:
    return svc.conversations.get(conversation_id, who).body()


@router.post("/{conversation_id}")
async def update_conversation(conversation_id: str, body: ConversationUpdate, who: Optional[str] = Depends(owner),
                              svc: Services = Depends(services)) -> dict:
    return svc.conversations.update(conversation_id, body.metadata, who).body()


@router.delete("/{conversation_id}")
async def delete_conversation(conversation_id: str, who: Optional[str] = Depends(owner),
                              svc: Services = Depends(services)) -> dict:
    """Forget the conversation (the sessions its responses ran in stay: DELETE /v1/sessions/{id})."""
    svc.conversations.delete(conversation_id, who)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.post("/{conversation_id}/items")
async def add_items(conversation_id: str, body: ItemsCreate, who: Optional[str] = Depends(owner),
                    svc: Services = Depends(services)) -> dict:
    svc.conversations.get(conversation_id, who)   # 404 first
    items = resolve_references(validate_items(body.items), item_finders(svc, who), "items")
    added = svc.conversations.add_items(conversation_id, items, who)
    return {"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
            "last_id": added[-1]["id"] if added else None, "has_more": False}


@router.get("/{conversation_id}/items")
async def list_items(conversation_id: str, after: Optional[str] = None, limit: int = Query(20, ge=1, le=100),
                     order: Literal["asc", "desc"] = "desc", who: Optional[str] = Depends(owner),
                     svc: Services = Depends(services)) -> dict:
    """A page of its items (`include` is accepted: nothing here is left out of an item)."""
    return svc.conversations.page(conversation_id, who, after, limit, order)


@router.get("/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, who: Optional[str] = Depends(owner),
                   svc: Services = Depends(services)) -> dict:
    return svc.conversations.item(conversation_id, item_id, who)


@router.delete("/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, who: Optional[str] = Depends(owner),
                      svc: Services = Depends(services)) -> dict:
    return svc.conversations.delete_item(conversation_id, item_id, who).body()
