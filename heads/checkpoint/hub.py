"""Head checkpoints on the Hugging Face Hub: resolve an id to a local folder, upload a folder.

A checkpoint on the Hub is exactly the folder :meth:`DraftHeads.save_pretrained` writes
(``config.json``, ``model.safetensors``, ``README.md``), so loading goes through
``snapshot_download`` (which keeps the Hub cache layout, honours ``HF_HUB_OFFLINE``,
``revision``, ``cache_dir`` and ``token``) and uploading through ``HfApi.upload_folder``.
"""
from __future__ import annotations

from pathlib import Path

from ..head_config import CONFIG_NAME, WEIGHTS_NAME, read_config
from ...core.errors import CheckpointError


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
    """Refuse to publish a folder that would not load: it needs both checkpoint files and a
    config.json that is a head config (a base model's folder has both files too)."""
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a head checkpoint (missing {missing}): write it with "
                              "heads.save_pretrained(folder) first.")
    read_config(folder)


#: the Hub's rule for a model repository id, said once for every message that needs it
REPO_ID_RULE = ("a repo id is 'namespace/name' (your user or organization, then the model name) of letters, digits, "
                "'-', '_' and '.', not starting or ending with '-' or '.', at most 96 characters")


def check_repo_id(repo_id: str) -> None:
    """A repo id the Hub accepts, checked before any request."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    problem = None if isinstance(repo_id, str) and repo_id.count("/") == 1 else "it needs exactly one '/'"
    if problem is None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            problem = "it has characters or a form the Hub refuses"
    if problem:
        raise CheckpointError(f"repo id {repo_id!r} is invalid ({problem}): {REPO_ID_RULE}.")


def hub_failure(err: Exception, repo_id: str) -> CheckpointError:
    """A Hub client failure during an upload as one line naming the fix."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return CheckpointError("uploading needs the Hub but HF_HUB_OFFLINE is set: unset it (or HF_HUB_OFFLINE=0) "
                               "and try again.")
    if isinstance(err, LocalTokenNotFoundError):
        return CheckpointError(f"uploading to {repo_id!r} needs a Hugging Face token: log in with `hf auth login` "
                               "(or `huggingface-cli login`), or set HF_TOKEN.")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return CheckpointError(f"the Hub refused the upload to {repo_id!r} (HTTP {status}): log in with a token that "
                               "may write there (`hf auth login` or `huggingface-cli login`), or push to your own "
                               "namespace.")
    if isinstance(err, HfHubHTTPError):
        return CheckpointError(f"the Hub refused the upload to {repo_id!r} (HTTP {status}: "
                               f"{str(err).splitlines()[0] if str(err) else type(err).__name__}); {REPO_ID_RULE}.")
    return CheckpointError(f"cannot reach the Hugging Face Hub to upload to {repo_id!r} ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else 'no detail'}): check the network connection "
                           "(or HF_ENDPOINT) and try again.")


def upload_checkpoint(folder: str | Path, repo_id: str, token: str | bool | None = None, private: bool | None = None,
                      revision: str | None = None, commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload every file of ``folder`` (a saved checkpoint) in
    one commit; returns the commit URL. Everything that can be checked here is, before any
    request (the folder, the repo id, offline mode); a Hub failure is one line naming the fix."""
    import huggingface_hub
    from huggingface_hub import constants

    folder = Path(folder)
    check_checkpoint_folder(folder)
    check_repo_id(repo_id)
    if constants.HF_HUB_OFFLINE:
        raise hub_failure(huggingface_hub.errors.OfflineModeIsEnabled("offline"), repo_id)
    api = huggingface_hub.HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                                 commit_message=commit_message or "Upload draftheads head checkpoint")
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - every Hub client failure becomes one line naming the fix
        raise hub_failure(err, repo_id) from None
    return str(getattr(info, "commit_url", info))
