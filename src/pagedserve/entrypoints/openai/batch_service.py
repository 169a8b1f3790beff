"""What the OpenAI and Anthropic batch routes share: the store and runner, whose files and
batches a request may touch, and cancelling."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...http.errors import APIError
from ...http.tenants import current_tenant
from .batch_runner import BatchRunner
from .batch_store import BatchRow, BatchStore


@dataclass
class Batches:
    """What the batch routes share: the store, the runner, the limits."""

    store: BatchStore
    runner: BatchRunner | None  # made when the server starts (it needs the running loop)
    max_file_size: int
    storage_quota: int | None  # bytes of files one owner may keep

    def wake(self) -> None:
        if self.runner is not None:
            self.runner.wake()


def owner() -> str:
    """Whose files and batches the request may touch: its tenant's (everyone's one owner without tenants)."""
    tenant = current_tenant()
    return "" if tenant is None else tenant.tenant.name


def find_batch(store: BatchStore, batch_id: str, api: str, missing: Callable[[str], APIError]) -> BatchRow:
    batch = store.get_batch(batch_id, owner())
    if batch is None or batch.api != api:
        raise missing(batch_id)
    return batch


def cancel(batches: Batches, batch: BatchRow) -> None:
    """Ask the runner to stop the batch; cancelling one already cancelling or cancelled is a no-op,
    one that has ended otherwise a 409."""
    if batch.status in ("cancelling", "cancelled"):
        return
    if not batches.store.set_status(batch.id, "cancelling", only_from=("validating", "in_progress")):
        raise APIError(409, f"batch {batch.id} is {batch.status} and can no longer be cancelled", code="conflict")
    batches.wake()
