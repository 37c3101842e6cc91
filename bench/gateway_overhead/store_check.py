"""The durability check: every completion id the gateway answered with must be in its store's `calls`
(the gateway answers only after the commit), with the answer's token count."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StoreCheck:
    received: int
    stored: int
    missing: int
    wrong_tokens: int | None
    links: str
    """How the received calls joined their sessions, e.g. `start 170, extend 850`."""

    def record(self) -> dict[str, Any]:
        return asdict(self)


def check_store(db_url: str, received: set[str], expected_tokens: int | None) -> StoreCheck:
    from sqlalchemy import create_engine, text

    db = create_engine(db_url)
    try:
        with db.connect() as conn:
            rows = conn.execute(text("SELECT completion_id, completion_tokens, link FROM calls")).all()
    finally:
        db.dispose()
    stored = {row[0] for row in rows}
    wrong = None
    if expected_tokens is not None:
        wrong = sum(1 for cid, tokens, _ in rows if cid in received and tokens != expected_tokens)
    links = Counter(link for cid, _, link in rows if cid in received)
    described = ", ".join(f"{link} {count}" for link, count in links.most_common())
    return StoreCheck(len(received), len(stored & received), len(received - stored), wrong, described)


def check_stores(db_urls: dict[str, str], received: dict[str, set[str]], expected_tokens: int | None) -> StoreCheck:
    """`check_store` for each gateway (by meter) on its own store, added up."""
    checks = [check_store(url, received.get(meter, set()), expected_tokens) for meter, url in db_urls.items()]
    wrong = None if expected_tokens is None else sum(c.wrong_tokens or 0 for c in checks)
    links = "; ".join(f"{meter}: {c.links}" for meter, c in zip(db_urls, checks, strict=True)) if len(checks) > 1 \
        else checks[0].links
    return StoreCheck(sum(c.received for c in checks), sum(c.stored for c in checks),
                      sum(c.missing for c in checks), wrong, links)
