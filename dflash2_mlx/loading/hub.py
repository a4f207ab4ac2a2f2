"""Hugging Face Hub downloads by id, into huggingface_hub's own cache ($HF_HOME), with one-line
errors that name the id and the fix (`HubError`).

`snapshot` and `file` ask the Hub about the repository first, with a timeout
($HF_HUB_ETAG_TIMEOUT seconds; huggingface_hub's own first calls have none), so a wrong id, a gated repository or a
Hub that does not answer is told apart before any file moves. When the Hub cannot be asked
(offline, unreachable) a complete cached copy is used. Progress bars follow `log.progress`:
on a terminal only.
"""

from __future__ import annotations

from pathlib import Path

from .. import log

_log = log.get(__name__)
LOGIN = "set HF_TOKEN to an access token or run `hf auth login` (`huggingface-cli login` " \
        "with older huggingface_hub)"


class HubError(OSError):
    """A repository that could not be had from the Hub (nor its cache); the message is one line
    naming the id and what to do."""


def _progress_class():
    """huggingface_hub's tqdm, quiet where `log.progress` is (stderr not a terminal, or the
    package not logging at INFO): its file-count bar would print regardless."""
    from huggingface_hub.utils import tqdm

    class Progress(tqdm):
        def __init__(self, *args, **kwargs):
            if not log.progress_shown():
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Progress


def snapshot(repo_id: str, what: str, allow_patterns: list[str] | None = None) -> Path:
    """The local folder of Hub repository `repo_id` (the files matching `allow_patterns`),
    downloaded on first use; `what` names it in errors ("target model", "draft model")."""
    from huggingface_hub import constants, snapshot_download

    def get(cached: bool) -> Path:
        if not cached:
            _log.info(f"fetching {what} {repo_id} from {constants.ENDPOINT} into "
                      f"{constants.HF_HUB_CACHE} (files already there are not fetched again) ...")
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns,
                                      local_files_only=cached, tqdm_class=_progress_class()))

    return _fetch(repo_id, what, get)


def file(repo_id: str, filename: str, what: str) -> Path:
    """One file of Hub repository `repo_id` (e.g. its config.json), downloaded on first use."""
    from huggingface_hub import hf_hub_download

    return _fetch(repo_id, what, lambda cached: Path(hf_hub_download(
        repo_id, filename, local_files_only=cached, tqdm_class=_progress_class())), filename)


def _fetch(repo_id: str, what: str, get, filename: str | None = None) -> Path:
    """`get(cached=False)` after asking the Hub about `repo_id` within $HF_HUB_ETAG_TIMEOUT
    seconds (huggingface_hub's own first calls wait without limit, and retry a HEAD that timed
    out with a minute's timeout); when it cannot be asked, `get(cached=True)`, the cache only.
    Failures come out explained (`explain`)."""
    from huggingface_hub import HfApi, constants

    try:
        HfApi().model_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as asked:  # noqa: BLE001 - the cache may still serve; else explained
        try:
            path = get(True)
        except Exception:  # noqa: BLE001 - the Hub's answer is the error worth reporting
            raise explain(asked, repo_id, what, filename) from asked
        if not constants.HF_HUB_OFFLINE:
            log.notice(f"{what} '{repo_id}': the Hub could not be asked "
                       f"({_reason(asked)}); using the cached copy in {path}")
        return path
    try:
        return get(False)
    except Exception as e:  # noqa: BLE001 - explained in one line, the cause chained
        raise explain(e, repo_id, what, filename) from e


def explain(error: Exception, repo_id: str, what: str, filename: str | None = None) -> HubError:
    """huggingface_hub's exception as one line naming the id and the fix."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError)

    name = f"{what} '{repo_id}'"
    hub, cache = constants.ENDPOINT, constants.HF_HUB_CACHE
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, GatedRepoError):
        return HubError(f"{name} is a gated repository: accept its conditions at "
                        f"{hub}/{repo_id} with your account, then {LOGIN}")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"{name}: no such repository on the Hugging Face Hub ({hub}); check the "
                        f"id (organization/name), or, if it is private, {LOGIN}")
    if isinstance(error, RemoteEntryNotFoundError):
        return HubError(f"{name}: the repository has no file '{filename or '?'}'; is it the "
                        "right repository?")
    if isinstance(error, HfHubHTTPError) and status in (401, 403):
        return HubError(f"{name}: the Hub refused access ({status}); {LOGIN}")
    if isinstance(error, HfHubHTTPError):
        return HubError(f"{name}: the Hugging Face Hub ({hub}) answered {status or 'an error'} "
                        f"({_reason(error)}); try again later, or pass a local folder")
    offline = constants.HF_HUB_OFFLINE or isinstance(error, OfflineModeIsEnabled)
    if offline and isinstance(error, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        partly = "only partly" if type(error).__name__ == "IncompleteSnapshotError" else "not"
        return HubError(f"{name} is {partly} in the Hugging Face cache ({cache}) and "
                        "HF_HUB_OFFLINE is set: run once without it to download, or pass a "
                        "local folder")
    cause = error.__cause__ if isinstance(error, LocalEntryNotFoundError) and \
        error.__cause__ is not None else error
    if isinstance(cause, HfHubHTTPError):
        return explain(cause, repo_id, what, filename)
    return HubError(f"{name}: the Hugging Face Hub ({hub}) could not be reached "
                    f"({_reason(cause)}) and it is not in the cache ({cache}); check the "
                    "network (HF_ENDPOINT, a proxy), raise HF_HUB_ETAG_TIMEOUT / "
                    "HF_HUB_DOWNLOAD_TIMEOUT (seconds) on a slow link, or pass a local folder")


def _reason(error: BaseException) -> str:
    """The error's type and the first line of its message (httpx and huggingface_hub errors
    run to several lines)."""
    kind = type(error).__name__
    if "Timeout" in kind or isinstance(error, TimeoutError):
        return f"no answer in time: {kind}"
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{kind}: {first}" if first else kind
