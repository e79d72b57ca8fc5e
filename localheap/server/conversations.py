"""OpenAI's Conversations API: a conversation's items kept on the server (/v1/conversations), and
a response that names one (`conversation`) reads them before its input and adds its input and
output to them. The Agents SDK's OpenAIConversationsSession keeps its history here, and its
Runner's `conversation_id` runs on it.

Items are the Responses API's input items (responses.Item), each given an id where it came
without one (a message "msg_...", a call's output "fco_..."); a message's text content becomes
its one text part. Event loop only."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from .errors import ApiError, BadRequest
from .jsonlines import FileBacked, JsonLines
from .responses import _ITEM, ID_PREFIX, MAX_METADATA, ItemReference, MessageItem, OtherItem, new_id

log = logging.getLogger("localheap.server")



class ConversationNotFound(ApiError):
    status, code = 404, "conversation_not_found"


class ItemNotFound(ApiError):
    status, code = 404, "item_not_found"


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict
    owner: Optional[str]
    items: OrderedDict = field(default_factory=OrderedDict)   # item id -> its JSON (as listed)
    chars: int = 0

    def body(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


def item_json(item: Any) -> dict:
    """An input item (or a dict of one) as a conversation lists it: with an id and a status, a
    message's text content as one text part (input_text; output_text for the assistant's)."""
    if isinstance(item, dict):
        item = _ITEM.validate_python(item)
    if isinstance(item, (ItemReference, OtherItem)):   # (an item_reference is resolved before: resolve_references)
        raise BadRequest(f"{item.type!r} items cannot be added to a conversation here (messages, function_call, "
                         f"function_call_output, custom_tool_call, custom_tool_call_output, reasoning and "
                         f"item_reference can)")
    out = item.model_dump(mode="json", by_alias=True, exclude_none=True)
    kind = out.setdefault("type", "message")
    out["id"] = out.get("id") or new_id(ID_PREFIX[kind])   # (kept responses' items have theirs: with_ids)
    out.setdefault("status", "completed")
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part = "output_text" if item.role == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item.content, **({"annotations": []} if part == "output_text" else {})}]
    return out


def _chars(items) -> int:
    return sum(len(str(i)) for i in items)


class ConversationLog(FileBacked):
    """The conversations, the least recently used dropped past `max_chars` characters of items
    (logged: a client that comes back to one gets a 404 that says so). With `path` (the sessions
    directory's conversations.jsonl, a JsonLines) they outlive a restart or a crash: each change
    is a line appended, read back at start."""

    def __init__(self, max_chars: int = 64_000_000, path: Optional[Path] = None):
        self.max_chars = max_chars
        self.chars = 0
        self._convs: OrderedDict[str, Conversation] = OrderedDict()
        self.path = path
        self._file = JsonLines(path, "conversations") if path is not None else None
        if self._file is not None:
            whole = self._file.load(self._apply)
            if not whole:
                self._file.rewrite(self._records(), now=True)
            log.info("%d conversations read from %s", len(self._convs), path)

    def __len__(self) -> int:
        return len(self._convs)

    # -- what the routes call --

    def create(self, items: list, metadata: Optional[dict], owner: Optional[str]) -> Conversation:
        conv = Conversation(new_id("conv"), int(time.time()), _metadata(metadata), owner)
        added = [item_json(i) for i in items]
        self._convs[conv.id] = conv
        self._write({"create": conv.id, "created_at": conv.created_at, "metadata": conv.metadata, "owner": owner})
        self._add(conv, added)
        return conv

    def get(self, conv_id: str, owner: Optional[str], param: str = "conversation_id") -> Conversation:
        conv = self._convs.get(conv_id)
        if conv is None or conv.owner != owner:
            raise ConversationNotFound(f"no conversation {conv_id!r} is kept here (deleted, another key's, or "
                                       f"dropped, the least recently used first, past {self.max_chars:,} "
                                       f"characters of conversations)", param)
        self._convs.move_to_end(conv_id)
        return conv

    def update(self, conv_id: str, metadata: Optional[dict], owner: Optional[str]) -> Conversation:
        conv = self.get(conv_id, owner)
        conv.metadata = _metadata(metadata)
        self._write({"meta": conv_id, "metadata": conv.metadata})
        return conv

    def delete(self, conv_id: str, owner: Optional[str]) -> None:
        self._drop(self.get(conv_id, owner))
        self._write({"delete": conv_id})

    def add_items(self, conv_id: str, items: list, owner: Optional[str]) -> list[dict]:
        """The items (input items, or their dicts) added in order, as listed (with their ids)."""
        conv = self.get(conv_id, owner)
        added = [item_json(i) for i in items]
        self._add(conv, added)
        return added

    def item(self, conv_id: str, item_id: str, owner: Optional[str]) -> dict:
        conv = self.get(conv_id, owner)
        if item_id not in conv.items:
            raise ItemNotFound(f"conversation {conv_id!r} has no item {item_id!r}", "item_id")
        return conv.items[item_id]

    def delete_item(self, conv_id: str, item_id: str, owner: Optional[str]) -> Conversation:
        self.item(conv_id, item_id, owner)
        conv = self._convs[conv_id]
        self._drop_item(conv, item_id)
        self._write({"drop": conv_id, "item": item_id})
        return conv

    def page(self, conv_id: str, owner: Optional[str], after: Optional[str], limit: int, order: str) -> dict:
        """A page of its items (cursor_page)."""
        conv = self.get(conv_id, owner)
        return cursor_page(list(conv.items.values()), after, limit, order, f"conversation {conv_id!r}")

    def find_item(self, item_id: str, owner: Optional[str]) -> Optional[dict]:
        """The item of that id in `owner`'s conversations (the latest used holding it), or None."""
        for conv in reversed(self._convs.values()):
            if conv.owner == owner and item_id in conv.items:
                return conv.items[item_id]
        return None

    def inputs(self, conv_id: str, owner: Optional[str]) -> list:
        """Its items as a response's input items, oldest first (what the prompt renders before the input)."""
        return [_ITEM.validate_python(i) for i in self.get(conv_id, owner, "conversation").items.values()]

    # -- in memory, and the file --

    def _add(self, conv: Conversation, added: list[dict]) -> None:
        self._put(conv, added)
        if added:
            self._write({"add": conv.id, "items": added})
        self._trim(keep=conv.id)

    def _put(self, conv: Conversation, added: list[dict]) -> None:
        for item in added:
            if item["id"] in conv.items:   # the same item again (a client that resends it): the latest stands
                self._drop_item(conv, item["id"])
            conv.items[item["id"]] = item
            n = _chars([item])
            conv.chars += n
            self.chars += n

    def _drop_item(self, conv: Conversation, item_id: str) -> None:
        n = _chars([conv.items.pop(item_id)])
        conv.chars -= n
        self.chars -= n

    def _drop(self, conv: Conversation) -> None:
        self._convs.pop(conv.id, None)
        self.chars -= conv.chars

    def _trim(self, keep: str) -> None:
        while self.chars > self.max_chars and len(self._convs) > 1:
            oldest = next(c for c in self._convs.values() if c.id != keep)
            log.warning("conversation %s dropped: past %d characters of conversations (the least recently used "
                        "goes first)", oldest.id, self.max_chars)
            self._drop(oldest)
            self._write({"delete": oldest.id})

    def _apply(self, r: dict) -> None:
        if "create" in r:
            self._convs[r["create"]] = Conversation(r["create"], r["created_at"], r["metadata"], r["owner"])
        elif "add" in r:
            self._put(self._convs[r["add"]], r["items"])
        elif "drop" in r:
            conv = self._convs[r["drop"]]
            if r["item"] in conv.items:
                self._drop_item(conv, r["item"])
        elif "meta" in r:
            self._convs[r["meta"]].metadata = r["metadata"]
        elif "delete" in r:
            conv = self._convs.get(r["delete"])
            if conv is not None:
                self._drop(conv)
        else:
            raise KeyError("no known record")

    def _records(self) -> list[dict]:
        out = []
        for c in self._convs.values():
            out.append({"create": c.id, "created_at": c.created_at, "metadata": c.metadata, "owner": c.owner})
            if c.items:
                out.append({"add": c.id, "items": list(c.items.values())})
        return out

    def _live(self) -> int:
        return len(self._convs) + sum(1 for c in self._convs.values() if c.items)


def cursor_page(items: list[dict], after: Optional[str], limit: int, order: str, whose: str) -> dict:
    """A list page of `items` (each with an id), oldest first (order "asc") or newest first
    ("desc"), after the item `after` (404 where `whose` has none of that id)."""
    ids = [i["id"] for i in items]
    if order != "asc":
        items, ids = items[::-1], ids[::-1]
    start = 0
    if after is not None:
        if after not in ids:
            raise ItemNotFound(f"{whose} has no item {after!r}", "after")
        start = ids.index(after) + 1
    chosen = items[start:start + limit]
    return {"object": "list", "data": chosen, "first_id": chosen[0]["id"] if chosen else None,
            "last_id": chosen[-1]["id"] if chosen else None, "has_more": start + limit < len(ids)}


def _metadata(metadata: Optional[dict]) -> dict:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise BadRequest(f"metadata is at most {MAX_METADATA} string keys with string values", "metadata")
    return dict(metadata)


def item_finders(svc: Any, owner: Optional[str]) -> list:
    """Where an item_reference of `owner`'s is looked up: the kept responses, then the conversations."""
    return [lambda i: svc.responses.find_item(i, owner), lambda i: svc.conversations.find_item(i, owner)]


def validate_items(items: Any, param: str = "items") -> list:
    """A request's items (a list of input items) checked, or a 400 naming the first that does not read."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise BadRequest("items is a list of input items", param)
    out = []
    for n, item in enumerate(items):
        try:
            out.append(_ITEM.validate_python(item))
        except ValidationError as e:
            raise BadRequest(f"item {n} does not read as an input item: {e.errors()[0]['msg']}", f"{param}.{n}") from e
    return out

