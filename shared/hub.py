"""Checkpoints named by hub id (``org/name``, ``org/name@revision``), as vLLM takes them.

The local hub cache is looked at first, so a model downloaded once serves
offline (``HF_HUB_OFFLINE=1`` needs nothing else); otherwise the files a
checkpoint needs are downloaded into that cache, with huggingface_hub's
progress bars. Only what serving reads is fetched: the weights as safetensors,
the configs, the tokenizer and the chat template.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import huggingface_hub
from huggingface_hub import errors

HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
SERVING_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


class HubCheckpointError(ValueError):
    """A hub id that names no checkpoint this machine has or can download."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled as a hub id (it may still name nothing)."""
    return HUB_ID.match(name) is not None and not name.startswith((".", "/", "~"))


@lru_cache(maxsize=16)
def hub_checkpoint(name: str) -> Path:
    """The snapshot directory of the hub id ``name``, from the cache or downloaded.

    Raises ``HubCheckpointError`` with the reason: not cached while offline,
    no such repository or revision, a gated repository, no safetensors.
    """
    match = HUB_ID.match(name)
    if match is None:
        raise HubCheckpointError(f"{name!r} is not a hub id (org/name or org/name@revision)")
    repo, revision = match["repo"], match["revision"]
    try:
        path = _snapshot(repo, revision, local_files_only=True)
    except errors.LocalEntryNotFoundError:
        path = _download(name, repo, revision)
    if not any(path.glob("*.safetensors")) or not (path / "config.json").is_file():
        raise HubCheckpointError(
            f"{name}: the snapshot at {path} has no config.json and safetensors weights; "
            "a GGUF file is served by its path"
        )
    return path


def _download(name: str, repo: str, revision: str | None) -> Path:
    try:
        return _snapshot(repo, revision, local_files_only=False)
    except errors.LocalEntryNotFoundError as exc:  # offline (HF_HUB_OFFLINE=1), not cached
        raise HubCheckpointError(
            f"{name} is not in the local hub cache and downloads are off: {exc}"
        ) from None
    except errors.GatedRepoError:
        raise HubCheckpointError(
            f"{name} is gated: accept its terms on the hub and set HF_TOKEN"
        ) from None
    except errors.RevisionNotFoundError:
        raise HubCheckpointError(f"{name}: no revision {revision!r} on the hub") from None
    except errors.RepositoryNotFoundError:
        raise HubCheckpointError(
            f"{name}: no such model on the hub (or it is private: set HF_TOKEN)"
        ) from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise HubCheckpointError(f"{name}: the download failed: {exc}") from None


def _snapshot(repo: str, revision: str | None, *, local_files_only: bool) -> Path:
    path = huggingface_hub.snapshot_download(
        repo,
        revision=revision,
        allow_patterns=SERVING_FILES,
        local_files_only=local_files_only,
    )
    return Path(path)
