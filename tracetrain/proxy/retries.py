"""A retried request takes the place of the recorded call it repeats, never a second one beside it.

A request is a retry when the client says so (`Binding.retry`, the SDKs' retry header) or when it
repeats the request whose stream this process saw the client leave after recording it (a reconnect).
It then replaces the recorded call (store/retries.py): same parent, same link, same place in the
trajectory. A retry after a failure needs nothing: a failed call is never recorded.

Replace, not replay: the retry is generated and served like any call, so every API and streaming work
unchanged, and the stored reply (with redaction, placeholders) is never what a client is served. The
client saw only the retry's reply, so that is the one its next request extends.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.proxy.chain import PromptPlan
from tracetrain.proxy.gateway import Gateway
from tracetrain.store import retries
from tracetrain.store.models import CHAINED_LINKS


@dataclass
class Retried:
    """The recorded request a retry replaces."""

    completion_id: str
    state_hashes: list[str]


async def find_retried(gw: Gateway, *, session_id: str, retry: bool, messages: list[dict[str, object]],
                       plan: PromptPlan) -> Retried | None:
    """The recorded request that this one (`messages` as stored, planned as `plan`) repeats, with `plan`
    moved to its place; None when it is not a retry, or its prompt was not built the same way."""
    reconnect = gw.sessions.undelivered(session_id)
    if not retry and reconnect is None:
        return None
    calls = await gw.read(lambda db: retries.retried_calls(db, session_id=session_id, messages=messages))
    if not calls or (not retry and calls[0].completion_id != reconnect):
        return None
    old = calls[0]
    if old.link in CHAINED_LINKS:
        # The same parent's chain: the plan saw the recorded call as the parent's child and branched.
        if plan.parent_id != old.parent_id or plan.link not in CHAINED_LINKS:
            return None
        plan.link = old.link
    else:
        if plan.prefix_len:
            return None
        plan.parent_id, plan.link = old.parent_id, old.link
    return Retried(old.completion_id, [c.state_hash for c in calls])
