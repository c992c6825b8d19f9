"""What a failed shard or run tells its operator, and which failures are worth a retry."""

from __future__ import annotations

from typing import Any

# Not worth a retry: the same call would fail the same way.
PERMANENT_OS_ERRORS = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
)


class RunFailed(RuntimeError):
    """A run (or a batch of shards) that did not end with every shard committed and intact.
    Its message names the shards and why; what was committed is kept."""


class InputChanged(RunFailed):
    """An input file changed after the run planned it: its shards' byte ranges no longer hold
    the records the plan counted, so the run fails rather than lose or repeat some."""


class EngineLoadError(RuntimeError):
    """The target or draft model could not be loaded: a config or install problem, not I/O."""


def is_transient(error: BaseException) -> bool:
    """Storage hiccups (dropped connections, timeouts, throttling, 5xx: OSError from s3fs) are
    transient; missing files, denied access, bad data, engine errors and out-of-memory are not."""
    if isinstance(error, PERMANENT_OS_ERRORS):
        return False
    return isinstance(error, OSError | TimeoutError)


def is_io_error(task, task_run, state) -> bool:
    """A Prefect retry condition: retry storage hiccups, not bad data, a bad model path or
    engine bugs."""
    try:
        state.result()
    except Exception as error:
        return is_transient(error)
    return False


def describe(error: BaseException, limit: int = 300) -> str:
    """One line: the error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def state_failure(state: Any) -> str:
    """Why a failed Prefect task or flow-run state failed, in one line."""
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, BaseException):
        return describe(outcome)
    return state.message or state.name


def run_failure_message(run_id: str, failed: dict[str, str], kind: str) -> str:
    """`failed`: shard id -> reason. Names up to three shards with their reasons."""
    shown = "; ".join(f"{shard_id}: {reason}" for shard_id, reason in list(failed.items())[:3])
    more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    return (
        f"run {run_id}: {len(failed)} shard(s) {kind}: {shown}{more}. Committed shards are "
        "kept; fix the cause and rerun the same config to finish the run"
    )
