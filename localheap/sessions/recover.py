"""Startup: the sessions a previous run left in its directory, whatever state it died in.

The index names the generation in force for each session; files of other generations are
a turn that was in flight (removed), files of sessions the index does not name are adopted
(the index was lost), temp files are removed, and anything unreadable is moved aside with a
log line. A session's page store keeps only the state its generation names (a newer one was
never committed); the page store of a session with no saved turn, or of no session, goes.
A session whose token file is intact but whose heap file is missing comes back and is rebuilt
from its tokens when first used (store.restore). Nothing here raises on the directory's
content: a bad file costs its session only.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Optional

import shutil

from ..heap import HeapConfig, HeapStats
from ..heap.pages import prune_store
from .disk import INDEX, SessionDir, valid_id
from .session import ORIGINS, Session

log = logging.getLogger("localheap.sessions")
BOTH = {"safetensors", "tokens"}


def recover_sessions(d: SessionDir, model_id: str, cfg: HeapConfig, skip: set[str],
                     lost: Optional[dict[str, str]] = None, model_key: Optional[str] = None) -> list[Session]:
    """The sessions saved in d (heaps not loaded), minus the ids in skip; `lost` gets the ids
    of sessions whose files could not be read, with why (their clients are told: 410). Sessions
    another model saved (its name, or, where both are known, its checkpoint's fingerprint) are
    moved aside: two checkpoints in folders of one name share a default directory."""
    lost = {} if lost is None else lost
    try:
        index = d.read_index()
        files = d.scan()
    except OSError as e:
        log.error("cannot read the sessions directory %s: %s; starting without saved sessions", d.root, e)
        return []
    entries: dict[str, dict] = {}
    if index is not None:
        key = index.get("model_key")
        if index.get("model") != model_id or (key and model_key and key != model_key):
            foreign = [d.root / INDEX] + [p for sid in files for p in d.root.glob(f"{sid}.*")]
            other = "another checkpoint named" if index.get("model") == model_id else "model"
            d.move_aside(foreign, f"sessions in {d.root} belong to {other} {index.get('model')!r}, not this "
                                  f"{model_id!r} (pass --sessions-dir to keep each model's apart)")
            return []
        for e in index.get("sessions", []):
            if isinstance(e, dict) and valid_id(e.get("id")):
                entries[e["id"]] = e
            else:
                log.warning("session index %s: ignoring a malformed entry", d.root / INDEX)
    found = []
    for sid in sorted(set(entries) | set(files)):
        if sid in skip:
            continue
        try:
            s = _recover_one(d, sid, entries.get(sid), files.get(sid, {}), cfg)
        except Exception as e:   # one unreadable session never stops the others
            d.move_aside(sorted(d.root.glob(f"{sid}.*")), f"session {sid}: {type(e).__name__}: {e}")
            lost[sid], s = "saved files missing" if isinstance(e, LookupError) else "unreadable token file", None
        if s is not None:
            found.append(s)
    _prune_page_stores(d, {s.id: s for s in found}, skip)
    return found


def _prune_page_stores(d: SessionDir, sessions: dict, skip: set[str]) -> None:
    """Each session's page store at its committed state; the stores of no session removed."""
    for entry in sorted(d.root.glob("sess_*.pages")):
        sid = entry.name[: -len(".pages")]
        if sid in skip or not valid_id(sid):
            continue
        s = sessions.get(sid)
        try:
            if s is None:
                log.info("removing the page store %s: it belongs to no session", entry)
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            else:
                prune_store(entry, s.saved_gen)
        except OSError as e:
            log.warning("page store %s not pruned: %s", entry, e)


def _recover_one(d: SessionDir, sid: str, entry: Optional[dict], gens: dict[int, set[str]],
                 cfg: HeapConfig) -> Optional[Session]:
    complete = sorted(g for g, kinds in gens.items() if kinds == BOTH)
    if entry is not None:
        gen = entry.get("gen", 0 if entry.get("file") else None)   # "file": the layout before generations
        if gen is None:   # committed as a session never fed: later files are an uncommitted turn
            d.remove(sid)
            return _session(d, sid, cfg, entry, None, None)
        # the tokens are the truth: a missing heap file is rebuilt from them (store.restore)
        if not isinstance(gen, int) or "tokens" not in gens.get(gen, ()):
            raise LookupError("its saved token file is missing")
        if gen not in complete:
            log.warning("session %s: heap file of generation %d missing; rebuilt from its tokens when used", sid, gen)
    elif complete:
        gen = complete[-1]
        log.info("session %s: not in the index; adopted from its files (generation %d)", sid, gen)
    else:
        log.info("session %s: removing incomplete files of an interrupted save", sid)
        d.remove(sid)
        return None
    tokens = d.read_tokens(sid, gen)
    if entry is not None and (len(tokens) != entry.get("tokens")
                              or entry.get("crc", zlib.crc32(tokens.tobytes())) != zlib.crc32(tokens.tobytes())):
        raise ValueError(f"token file ({len(tokens)} tokens) does not match the index ({entry.get('tokens')})")
    d.remove(sid, keep_gen=gen)
    return _session(d, sid, cfg, entry or {}, gen, tokens)


def _session(d: SessionDir, sid: str, cfg: HeapConfig, entry: dict, gen: Optional[int], tokens) -> Session:
    def number(key, default):
        v = entry.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    now = time.time()
    origin = entry.get("origin") if entry.get("origin") in ORIGINS else "api"   # older indexes have none
    title = entry.get("title") if isinstance(entry.get("title"), str) else None
    owner = entry.get("owner") if isinstance(entry.get("owner"), str) else None   # an API key's digest
    s = Session(id=sid, cfg=cfg, created=number("created", now), last_used=number("last_used", now),
                turns=int(number("turns", 0)), origin=origin, title=title, owner=owner)
    s.saved_turns = s.turns
    if gen is not None:
        s.fed, s.spill_path, s.saved_gen, s.saved_tokens = tokens, d.heap_path(sid, gen), gen, len(tokens)
        unfed = entry.get("unfed")   # (the reply max_tokens cut: its last tokens, sent and never read)
        if isinstance(unfed, list) and len(unfed) <= 16 and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 and t >= 0 for t in unfed):
            s.unfed_reply = s.saved_unfed = tuple(unfed)
        s.ends_in_reply = s.saved_ends_in_reply = entry.get("ends_in_reply") is True
        s.saved_crc = zlib.crc32(tokens.tobytes())
        floor, start = entry.get("rollback_floor"), entry.get("reply_start")
        ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= len(tokens)   # noqa: E731
        s.rollback_floor = floor if ok(floor) else None
        s.reply_start = start if ok(start) else None
        s.cuttable = entry.get("cuttable") is True
        s.saved_points = (s.rollback_floor, s.reply_start, s.cuttable)
        crc = entry.get("heap_crc")
        s.heap_crc = crc if isinstance(crc, int) and not isinstance(crc, bool) else None
        s.stats = stats_entry(entry.get("stats"), len(tokens))
        s.saved_stats = entry.get("stats") if s.stats is not None else None
    s.refresh()
    return s


PAGE_COUNTS = ("pages", "pages_dropped", "disk_bytes", "summary_bytes", "recalls", "recalled_tokens", "tokens_on_disk")


def stats_entry(d, tokens: int) -> Optional[HeapStats]:
    """The saved copy's heap totals from its index entry (listed, and counted by /metrics, before the
    session is used again), or None where they are missing or malformed."""
    if not isinstance(d, dict):
        return None
    try:
        counts = {k: d[k] for k in ("tokens_seen", "resident", "evicted", "capacity", "kv_bytes", "evictions")}
        recalled, pages = d.get("recalled", 0), d.get("pages")
        count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0   # noqa: E731
        if not all(map(count, [*counts.values(), recalled])) or counts["tokens_seen"] > tokens:
            return None
        if pages is not None and not (isinstance(pages, dict) and all(count(pages.get(k)) for k in PAGE_COUNTS)):
            pages = None   # (what /metrics sums must be there)
        return HeapStats(**counts, recalled=recalled, pages=pages)
    except KeyError:
        return None
