"""Head checkpoints on the Hugging Face Hub: resolve an id to a local folder, upload a folder.

A checkpoint on the Hub is exactly the folder :meth:`DraftHeads.save_pretrained` writes
(``config.json``, ``model.safetensors``, ``README.md``), so loading goes through
``snapshot_download`` (which keeps the Hub cache layout, honours ``HF_HUB_OFFLINE``,
``revision``, ``cache_dir`` and ``token``) and uploading through ``HfApi.upload_folder``.
"""
from __future__ import annotations

from pathlib import Path

from .config import CONFIG_NAME, WEIGHTS_NAME, CheckpointError


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` (what the Hub accepts), not a filesystem path such as ``./x`` or ``/a/b``."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None, cache_dir: str | Path | None = None,
                       token: str | bool | None = None, local_files_only: bool = False) -> Path:
    """A local folder as is; a Hub id (``org/name``) through ``snapshot_download`` into the Hub
    cache, from the cache alone when offline (``HF_HUB_OFFLINE=1`` or ``local_files_only``).
    Anything else comes back unchanged, for :func:`read_config` to report as missing."""
    path = Path(name_or_path)
    if path.is_dir() or not looks_like_repo_id(str(name_or_path)):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = (f"{name_or_path!r}" + (f" (revision {revision!r})" if revision else "")
             + " is no local folder, and as a Hub id it")
    try:
        return Path(snapshot_download(str(name_or_path), revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=local_files_only))
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "local_files_only=True"
        raise CheckpointError(
            f"Head checkpoint {where} is not in the local Hugging Face cache "
            f"({cache_dir or constants.HF_HUB_CACHE}) and the Hub may not be contacted ({offline}): download it once "
            f"with network (`hf download {name_or_path}`), or pass a local checkpoint folder.") from None
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise CheckpointError(f"Head checkpoint {where} is not on the Hub or not accessible with this token "
                              f"({type(err).__name__}); check the path or id, or log in (`hf auth login`).") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"Head checkpoint {name_or_path!r} has no revision {revision!r} on the Hub.") from None


def check_checkpoint_folder(folder: Path) -> None:
    """Refuse to publish a folder that would not load: it needs both checkpoint files."""
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a head checkpoint (missing {missing}): write it with "
                              "heads.save_pretrained(folder) first.")


def upload_checkpoint(folder: str | Path, repo_id: str, token: str | bool | None = None, private: bool | None = None,
                      revision: str | None = None, commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload every file of ``folder`` (a saved checkpoint) in
    one commit; returns the commit URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    check_checkpoint_folder(folder)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                             commit_message=commit_message or "Upload draftheads head checkpoint")
    return str(getattr(info, "commit_url", info))
