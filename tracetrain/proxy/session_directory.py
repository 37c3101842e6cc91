"""Where a request's session stands: who owns it, and which earlier call its messages extend.

Every route that names a session asks `owned` first: one access check, one wording of its 403 and 404.
What never changes about a stored session (owner, group, first version) and the token chains of recent
calls are kept in LRU caches, so a call in a known session reads nothing from the store; a miss reads
it once (store/queries.py) and remembers it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache
from sqlalchemy.engine import Engine as DBEngine
from sqlmodel import Session

from tracetrain.proxy.auth import Caller
from tracetrain.proxy.chain import ChainNode
from tracetrain.proxy.errors import APIError
from tracetrain.store import queries
from tracetrain.store.messages import full_messages
from tracetrain.store.models import DEFAULT_POLICY
from tracetrain.store.trajectory import chain_redacted, full_ids

SESSIONS = 100_000
CHAINS = 4096
LATEST = "latest"
"""Chain-cache key of a session's latest text-completion call (other keys are 64-hex state hashes)."""


@dataclass
class SessionState:
    """What never changes about a stored session: safe to cache in every gateway process."""

    owner: str | None
    group_id: str
    version: int | None = None
    """The policy version its first call was served by (canary promotion keeps the session on it)."""
    policy: str = DEFAULT_POLICY
    """The named policy it belongs to, for good."""


def forbidden_policy(session_id: str, policy: str, asked: str | None) -> APIError:
    """403 for a request confined to (or naming) policy `asked` on a session of `policy`."""
    return APIError(403, f"Session '{session_id}' belongs to policy '{policy}', not '{asked}'; a session never "
                    "changes policy.", code="policy_forbidden")


class SessionDirectory:
    def __init__(self, db: DBEngine, *, inline_reads: bool) -> None:
        self.db = db
        self._inline_reads = inline_reads
        """Point lookups on the event loop: a local SQLite primary-key read (never blocked by a writer
        in WAL mode) costs less than the hop to a worker thread and back (two context switches); a
        PostgreSQL read is a network round trip and takes the thread."""
        self._sessions: LRUCache[str, SessionState] = LRUCache(SESSIONS)
        self._chains: LRUCache[tuple[str, str], ChainNode] = LRUCache(CHAINS)
        self._undelivered: LRUCache[str, str] = LRUCache(CHAINS)
        """Session → the request whose stream the client left after it was recorded: the client's next
        request with the same messages is a reconnect, and replaces it (store/retries.py)."""

    # --- sessions ---------------------------------------------------------------------------------

    async def lookup(self, session_id: str) -> SessionState | None:
        """Owner and group of a stored session, or None if it does not exist yet."""
        state = self._sessions.get(session_id)
        if state is None:
            state = (self._load_session(session_id) if self._inline_reads
                     else await asyncio.to_thread(self._load_session, session_id))
            if state is not None:
                self._sessions[session_id] = state
        return state

    async def owned(self, session_id: str, caller: Caller, *, must_exist: bool = True) -> SessionState | None:
        """The session if `caller` may use it: 404 when it does not exist (unless `must_exist` is false, for
        a call that creates it), 403 when it belongs to another policy than the one the caller is confined
        to (`policy_forbidden`: a session never changes policy) or to another API key."""
        state = await self.lookup(session_id)
        if state is None:
            if must_exist:
                raise APIError(404, f"Session '{session_id}' does not exist.", code="session_not_found")
            return None
        if caller.confined_elsewhere(state.policy):
            raise forbidden_policy(session_id, state.policy, caller.policy)
        if not caller.may_access(state.owner):
            raise APIError(403, f"Session '{session_id}' belongs to another API key.", code="session_forbidden")
        return state

    def new(self, session_id: str, owner: str | None, group: str, version: int | None,
            policy: str = DEFAULT_POLICY) -> SessionState:
        """The state of a session this process is about to create; a concurrent first call finds it."""
        state = self._sessions.get(session_id) or SessionState(owner, group, version, policy)
        self._sessions[session_id] = state
        return state

    def _load_session(self, session_id: str) -> SessionState | None:
        with self.db.connect() as conn:
            row = queries.session_owner_group(conn, session_id=session_id)
        return None if row is None else SessionState(*row)

    # --- token chains -----------------------------------------------------------------------------

    async def find_parent(self, session_id: str, hashes: list[str], messages: list[dict[str, Any]]) -> ChainNode | None:
        """The latest call whose request + reply the messages start with (longest history first)."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1]["role"] != "assistant":
                continue
            node = self._chains.get((session_id, hashes[k])) or await asyncio.to_thread(
                self._load_node, session_id, hashes[k], k)
            if node is not None:
                return node
        return None

    async def latest_node(self, session_id: str) -> ChainNode | None:
        """The session's latest call with its whole chain (text completions extend it by token prefix)."""
        return self._chains.get((session_id, LATEST)) or await asyncio.to_thread(self._load_latest, session_id)

    def remember_latest(self, session_id: str, node: ChainNode) -> None:
        self._chains[(session_id, LATEST)] = node

    def remember_calls(self, session_id: str, calls: list[tuple[str, str]], chains: list[list[int]],
                       message_count: int, request_messages: list[dict[str, Any]], *,
                       real_states: list[str | None] | None = None) -> None:
        """Cache the chains of calls just recorded, by (call id, state hash as stored); `real_states`: the
        hashes of the original messages where redaction changed them (proxy/redact.py)."""
        for i, ((call_id, state_hash), chain) in enumerate(zip(calls, chains, strict=True)):
            self._chains[(session_id, state_hash)] = ChainNode(
                call_id, chain, message_count, request_messages=request_messages,
                real_state=real_states[i] if real_states else None)

    def forget_calls(self, session_id: str, state_hashes: list[str]) -> None:
        """Drop the cached chains of calls a retry replaced: nothing may extend them any more."""
        for state_hash in state_hashes:
            self._chains.pop((session_id, state_hash), None)

    def forget_session(self, session_id: str) -> None:
        """Drop every cached chain of a session whose content was cleared: its calls have no ids to extend."""
        for key in [k for k in self._chains if k[0] == session_id]:
            self._chains.pop(key, None)
        self._undelivered.pop(session_id, None)

    def mark_undelivered(self, session_id: str, completion_id: str) -> None:
        self._undelivered[session_id] = completion_id

    def undelivered(self, session_id: str) -> str | None:
        """The session's latest recorded request if its client left the stream before it ended."""
        return self._undelivered.get(session_id)

    def delivered(self, session_id: str, completion_id: str) -> None:
        """A new request was recorded: an earlier one left undelivered is no longer the latest (a stream
        left while its own record was being written stays marked)."""
        if self._undelivered.get(session_id) not in (None, completion_id):
            del self._undelivered[session_id]

    def _load_node(self, session_id: str, state_hash: str, message_count: int) -> ChainNode | None:
        with Session(self.db) as db:
            call = queries.call_by_state(db, session_id=session_id, state_hash=state_hash)
            if call is None:
                return None
            by_id = {c.id: c for c in queries.session_calls(db, session_id=session_id)}
            node = ChainNode(call_id=call.id, full_ids=full_ids(call, by_id), message_count=message_count,
                             has_child=queries.has_chained_child(db, call_id=call.id, session_id=session_id),
                             request_messages=full_messages(call, by_id), redacted=chain_redacted(call, by_id))
        self._chains[(session_id, state_hash)] = node
        return node

    def _load_latest(self, session_id: str) -> ChainNode | None:
        with Session(self.db) as db:
            call_id = queries.latest_call_id(db, session_id=session_id)
            if call_id is None:
                return None
            by_id = {c.id: c for c in queries.session_calls(db, session_id=session_id)}
            node = ChainNode(call_id, full_ids(by_id[call_id], by_id), 0,
                             has_child=queries.has_chained_child(db, call_id=call_id, session_id=session_id))
        self._chains[(session_id, LATEST)] = node
        return node
