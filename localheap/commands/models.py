"""`localheap models`: the models `--model` can name and the copies of them on this machine (the
Hugging Face hub cache, where `serve` downloads them): list them, download one ahead of time with
its progress shown, remove one to free its disk."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..models import ModelNotFound, demo_model_dir, download, presets


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the model aliases and the downloaded models; pull or remove one",
                       description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="the aliases, whether each is downloaded (its size), and the other downloaded "
                                    "models (the default action)")
    pull = actions.add_parser("pull", help="download a model ahead of time, its progress shown (done already: "
                                           "checked, nothing fetched again)")
    pull.add_argument("model", help="an alias (`localheap models`) or a hub repo id (org/name)")
    rm = actions.add_parser("rm", help="remove a downloaded model from this machine")
    rm.add_argument("model", help="an alias or a hub repo id")
    p.set_defaults(func=run, action=None)


def run(args) -> int:
    if args.action == "pull":
        repo = repo_of(args.model)
        print(f"pulling {args.model}" + (f" ({repo})" if repo != args.model else ""), flush=True)
        path = download(repo, progress=True)
        print(f"{args.model}: {_size(_cached(repo))} in {path}")
        return 0
    if args.action == "rm":
        return remove(args.model)
    list_models()
    return 0


def repo_of(spec: str) -> str:
    """The hub repo an alias or a repo id names; ModelNotFound for anything else."""
    if spec == "demo":
        raise ModelNotFound("the demo model is part of the package: there is nothing to download or remove")
    preset = presets().get(spec)
    if preset is not None:
        return preset.repo
    if spec.count("/") == 1 and not Path(spec).expanduser().exists():
        return spec
    known = ", ".join(sorted(presets()))
    raise ModelNotFound(f"unknown model {spec!r}: not an alias ({known}) or a hub repo id (org/name)")


def _cache():
    """The hub cache's contents (huggingface_hub.HFCacheInfo); None where there is no cache yet."""
    from huggingface_hub import scan_cache_dir

    try:
        return scan_cache_dir()
    except Exception:   # noqa: BLE001 - CacheNotFound (nothing downloaded yet), or an unreadable directory
        return None


def _cached(repo: str, cache=None):
    cache = cache if cache is not None else _cache()
    return next((r for r in (cache.repos if cache is not None else ()) if r.repo_type == "model" and
                 r.repo_id.lower() == repo.lower()), None)


def _size(entry) -> str:
    return _human(entry.size_on_disk) if entry is not None else "-"


def _human(n: int) -> str:
    units = ("B", "KB", "MB", "GB", "TB")
    step = 0
    while n >= 1000 and step < len(units) - 1:
        n /= 1000
        step += 1
    return f"{n:.0f} B" if step == 0 else f"{n:.1f} {units[step]}"


def list_models() -> None:
    from huggingface_hub import constants

    cache = _cache()
    rows = [("MODEL", "REPO", "FAMILY", "CONTEXT", "ON THIS MACHINE")]
    demo = demo_model_dir()
    if demo is not None:
        config = json.loads((demo / "config.json").read_text())
        rows.append(("demo", "(in the package)", config.get("model_type", "-"),
                     str(config.get("max_position_embeddings", "-")), "yes"))
    named = set()
    for alias, preset in sorted(presets().items()):
        entry = _cached(preset.repo, cache)
        named.add(preset.repo.lower())
        rows.append((alias, preset.repo, preset.family, str(preset.context), _local(entry)))
    others = [r for r in (cache.repos if cache is not None else ()) if r.repo_type == "model" and
              r.repo_id.lower() not in named and (r.repo_path / "snapshots").is_dir()]
    for r in sorted(others, key=lambda r: r.repo_id.lower()):
        rows.append((r.repo_id, r.repo_id, "-", "-", _local(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\ndownloads go to {constants.HF_HUB_CACHE} (HF_HUB_CACHE); `localheap models pull MODEL` fetches one "
          f"ahead of time, `localheap models rm MODEL` frees its disk")


def _local(entry) -> str:
    if entry is None:
        return "-"
    when = time.strftime("%Y-%m-%d", time.localtime(entry.last_modified))
    return f"{_size(entry)} ({when})"


def remove(spec: str) -> int:
    repo = repo_of(spec)
    cache = _cache()
    entry = _cached(repo, cache)
    if entry is None:
        raise ModelNotFound(f"{spec} ({repo}) is not downloaded: nothing to remove")
    # The plan drawn over this repo alone: hub revisions are looked up by hash over the whole cache, and a
    # copy of a repo (a mirror, a re-upload with its history) shares its hashes, so a plan over the cache
    # could take the other repo's directory instead. Blobs it shares with others still count as the hub
    # counts them (cache_dir kept).
    strategy = dataclasses.replace(cache, repos=frozenset({entry})).delete_revisions(
        *[r.commit_hash for r in entry.revisions])
    freed = strategy.expected_freed_size
    strategy.execute()   # (every revision: the repo's whole directory)
    print(f"removed {spec} ({repo}): {_human(freed)} freed")
    return 0
