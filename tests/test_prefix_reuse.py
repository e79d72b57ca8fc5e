"""Prefix reuse that survives re-tokenization: the longest common token prefix of a session
and a prompt, rolled back to where exact, else a checkpoint (pure matching, fake sessions)."""

from __future__ import annotations

import pytest

from localheap.heap import HeapConfig
from localheap.sessions import Prompt, Session, match_session
from localheap.sessions.checkpoints import Checkpoint
from localheap.sessions.match import common_prefix
from localheap.sessions.session import token_array

encode = lambda text: [ord(c) for c in text]  # noqa: E731
decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
CFG = HeapConfig(budget=64, slack=16, recent=8)


def session(history: str, floor=0, reply_start=None) -> Session:
    s = Session(id=f"s-{history[:8]}", cfg=CFG, fed=token_array(encode(history)))
    s.rollback_floor, s.reply_start = floor, reply_start
    return s


def prompt(text: str) -> Prompt:
    return Prompt(encode(text), text)


def test_common_prefix_of_arrays_and_lists():
    assert common_prefix(token_array([1, 2, 3, 4]), [1, 2, 9]) == 2
    assert common_prefix([1, 2], token_array([1, 2, 3])) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_a_reply_rendered_differently_rolls_back_to_the_common_prefix():
    # the session read "Q1" and generated "A1"; the template renders the past turn as "<m>A1"
    s = session("<s>user Q1 asst A1", reply_start=len("<s>user Q1 asst "))
    m = match_session([s], prompt("<s>user Q1 asst <m>A1 user Q2 asst "), encode, decode)
    assert m.session is s and m.rollback == m.cached == len("<s>user Q1 asst ")
    assert decode(m.new_tokens) == "<m>A1 user Q2 asst "


def test_rollback_stops_at_the_floor_and_at_the_shared_share():
    s = session("<s>user Q1 asst A1", floor=len("<s>user Q1 asst A"), reply_start=16)
    assert match_session([s], prompt("<s>user Q1 asst <m>A1 user Q2"), encode, decode) is None   # evicted since
    s.rollback_floor = None   # unknown (e.g. loaded from disk): never rolled back
    assert match_session([s], prompt("<s>user Q1 asst <m>A1 user Q2"), encode, decode) is None
    # another conversation that shares only the system prompt does not roll this one back
    # once its history is more than twice that prompt
    history = "<sys>be brief</sys> user: tides? asst: moon. user: and waves? asst: wind."
    other = session(history, reply_start=len(history) - 5)
    assert match_session([other], prompt("<sys>be brief</sys> user: what is rust?"), encode, decode) is None
    short = session("<sys>be brief</sys> user: tides? asst: moon.", reply_start=36)
    assert match_session([short], prompt("<sys>be brief</sys> user: what is rust?"), encode, decode).rollback == 26
    short.addressed = True   # a client holds it by id: another request never rolls it back
    assert match_session([short], prompt("<sys>be brief</sys> user: what is rust?"), encode, decode) is None


def test_regenerating_the_same_prompt_feeds_its_last_token_again():
    s = session("<s>user Q1 asst A1", reply_start=len("<s>user Q1 asst "))
    m = match_session([s], prompt("<s>user Q1 asst "), encode, decode)
    assert m.rollback == m.cached == len("<s>user Q1 asst ") - 1 and decode(m.new_tokens) == " "


def test_whole_session_prefix_beats_a_rollback_and_a_checkpoint_beats_nothing(tmp_path):
    whole = session("<s>doc Q")
    longer = session("<s>doc Q then X", reply_start=10)
    m = match_session([longer, whole], prompt("<s>doc Q then Y"), encode, decode)
    assert m.session is longer and m.rollback == len("<s>doc Q then ")
    m = match_session([whole, longer], prompt("<s>doc Q!"), encode, decode)
    assert m.session is whole and m.rollback is None and m.cached == len("<s>doc Q")
    ckpt = Checkpoint("s-x", token_array(encode("<s>doc")), tmp_path / "6.safetensors")
    evicted = session("<s>doc Q1 asst A1", floor=12, reply_start=14)
    m = match_session([evicted], prompt("<s>doc Q2"), encode, decode, [ckpt])
    assert m.session is None and m.checkpoint is ckpt and m.cached == 6 and decode(m.new_tokens) == " Q2"
    busy = session("<s>doc Q2 and more")
    busy.busy = True
    assert match_session([busy], prompt("<s>doc Q2 and more!"), encode, decode, [ckpt]).checkpoint is ckpt


def test_checkpoints_keep_the_first_and_newest_cap_the_total_and_survive_a_restart(tmp_path):
    from test_engine import FakeBackend, FakeCache

    from localheap.sessions.checkpoints import Checkpoints

    backend = FakeBackend()
    store = Checkpoints(tmp_path, backend, per_session=3, max_total=4)

    def resident(name, text):
        s = session(text)
        s.id, s.cache = name, FakeCache(CFG)
        s.cache.tokens = encode(text)
        return s

    a = resident("a", "doc")
    for more in ("", " q1", " q1 a1", " q1 a1 q2"):
        a.fed, a.cache.tokens = token_array(encode("doc" + more)), encode("doc" + more)
        store.save(a)
    assert a.checkpoints == [3, 9, 12]                  # the first (the document) and the newest
    assert store.save(a).n == 12 and a.checkpoints == [3, 9, 12]   # same tokens: not saved twice
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["12.safetensors", "12.tokens", "3.safetensors",
                                                                  "3.tokens", "9.safetensors", "9.tokens"]
    fork = session("")
    fork.id = "f"
    store.inherit(store.nearest("a", 10), fork)        # a fork at 9 tokens owns links to 3 and 9
    assert fork.checkpoints == [3, 9] and store.load(store.nearest("f", 9), CFG).tokens == encode("doc q1 a1")
    assert len(store.all()) == 4                       # the cap: the oldest (a's 3) went
    assert a.checkpoints == [9, 12] and fork.checkpoints == [3, 9]
    restarted = Checkpoints(tmp_path, backend)
    assert restarted.load_persisted([a]) == 2 and a.checkpoints == [9, 12]
    assert not (tmp_path / "f").exists()               # an unknown session's checkpoints are removed
    restarted.drop("a")
    assert not (tmp_path / "a").exists() and restarted.all() == []

    def full(cache, path, snapshot=False):   # a heap file half written, then the disk is full
        path.with_suffix(".pages").mkdir()
        path.write_text("partial")
        raise OSError(28, "No space left on device")

    backend.save_cache = full
    a.fed = token_array(encode("doc q1 a1 q2 a2"))
    with pytest.raises(OSError):
        store.save(a)
    assert a.checkpoints == [9, 12] and sorted(p.name for p in (tmp_path / "a").iterdir()) == []


def test_checkpoints_a_start_cannot_list_are_left_as_they_are_and_the_start_goes_on(tmp_path, monkeypatch):
    """A session's checkpoint folder, or the whole checkpoints folder, that cannot be listed (mode
    000 where the server lacks CAP_DAC_OVERRIDE) stopped the server's start with a PermissionError:
    now those checkpoints are not read (nor removed) and the others are."""
    from pathlib import Path

    from test_engine import FakeBackend, FakeCache

    from localheap.sessions.checkpoints import Checkpoints

    store = Checkpoints(tmp_path, FakeBackend())
    sessions = []
    for name in ("a", "b"):
        s = session("doc")
        s.id, s.cache = name, FakeCache(CFG)
        s.fed = token_array(encode("doc"))
        s.cache.tokens = encode("doc")
        store.save(s)
        sessions.append(s)
    listed = Path.iterdir

    def refusing(names):
        def iterdir(self):
            if self.name in names:
                raise PermissionError(13, "Permission denied", str(self))
            return listed(self)
        return iterdir

    monkeypatch.setattr(Path, "iterdir", refusing({"a"}))
    restarted = Checkpoints(tmp_path, FakeBackend())
    assert restarted.load_persisted(sessions) == 1 and restarted.of("a") == [] and len(restarted.of("b")) == 1
    assert sorted(p.name for p in listed(tmp_path / "a")) == ["3.safetensors", "3.tokens"]
    monkeypatch.setattr(Path, "iterdir", refusing({tmp_path.name}))
    assert Checkpoints(tmp_path, FakeBackend()).load_persisted(sessions) == 0
    monkeypatch.undo()
    assert Checkpoints(tmp_path, FakeBackend()).load_persisted(sessions) == 2


def test_a_forks_copy_refused_is_told_from_a_checkpoint_that_cannot_be_read(tmp_path):
    """branching._refused_write: the disk refusing the fork's own copy (full, read-only, its folder
    gone) keeps the checkpoint; a read error is the checkpoint's, though a copy names both paths."""
    import errno

    from localheap.engine.branching import _refused_write

    fork, ckpt = tmp_path / "sess_b.pages", tmp_path / "checkpoints" / "sess_a" / "9.pages"
    src, dst = str(ckpt / "layer000.pages"), str(fork / "layer000.pages")
    assert _refused_write(OSError(errno.ENOSPC, "No space left on device", src, None, dst), fork)
    assert _refused_write(OSError(errno.EROFS, "Read-only file system", dst), fork)
    assert _refused_write(OSError(errno.ENOENT, "No such file or directory", dst), fork)
    assert not _refused_write(OSError(errno.EIO, "Input/output error", src, None, dst), fork)   # a bad sector
    assert not _refused_write(OSError(errno.ENOENT, "No such file or directory", src, None, dst), fork)
    assert not _refused_write(ValueError("not a heap file"), fork)
