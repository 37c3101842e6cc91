"""The console at /ui in a real browser (Debian's chromium, headless, driven by Playwright) against a real
gateway with keys: log in, filter sessions, open one, see its sampled tokens highlighted, override its
reward and exclude it, and see the trainer skip it; clear an override; see a call's tool calls and tool
results as their own items; bad rewards in the form change nothing; an agent key sees only its own
sessions and corrects nothing; the policy selector narrows the sessions, the charts and the cards to one
policy, kept in the link, and a key bound to a policy is offered only its own. Screenshots go to
tests/e2e/screenshots/ (git-ignored)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from sqlmodel import Session

from tests.support.recording import RecordingEngine
from tests.support.servers import RunningGateway, start_gateway
from tests.support.sessions import add_session
from tests.support.setup_steps import CHROMIUM_MISSING, PLAYWRIGHT_MISSING
from tests.support.tool_model import ADD_TOOL
from tracetrain.config import TrainConfig
from tracetrain.engines.transformers_engine import TransformersEngine
from tracetrain.engines.transformers_publish import InProcessPublisher
from tracetrain.proxy.auth import fingerprint
from tracetrain.store import leases
from tracetrain.store.db import open_db
from tracetrain.store.models import Policy, utcnow
from tracetrain.trainer.loop import Trainer

pytestmark = pytest.mark.slow

MODEL = "tiny"
ADMIN_KEY, AGENT_A, AGENT_B = "admin-secret", "agent-a", "agent-b"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).with_name("screenshots")
TIMEOUT_MS = 20_000

if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
    pytest.skip(CHROMIUM_MISSING, allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason=PLAYWRIGHT_MISSING)
sync_api.expect.set_options(timeout=TIMEOUT_MS)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Console:
    gw: RunningGateway
    trainer: Trainer

    def get(self, path: str, key: str = ADMIN_KEY, **params: Any) -> Any:
        response = httpx.get(self.gw.url + path, headers=_auth(key), params=params, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: Any, key: str = ADMIN_KEY) -> httpx.Response:
        return httpx.post(self.gw.url + path, json=body, headers=_auth(key), timeout=30)

    def chat(self, key: str, session: str, group: str, *turns: str) -> None:
        """One session through the OpenAI SDK: each turn extends the conversation (one token chain)."""
        client = OpenAI(base_url=self.gw.v1(session, group), api_key=key, max_retries=0)
        history: list[Any] = []
        for text in turns:
            history.append({"role": "user", "content": text})
            reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=1.0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

    def episode(self, key: str, session: str, group: str, reward: float, *turns: str) -> None:
        self.chat(key, session, group, *turns)
        posted = self.post("/v1/rewards", {"session_id": session, "reward": reward, "final": True}, key)
        assert posted.status_code == 200, posted.text

    def train_round(self, rewards: list[float]) -> None:
        """A group of fresh episodes, then one trainer step on them (the trainer publishes over HTTP)."""
        group = f"round-{uuid.uuid4().hex[:6]}"
        for i, reward in enumerate(rewards):
            self.episode(AGENT_A, f"{group}-{i}", group, reward, f"Practice question {i}: what is {i} + {i}?")
        assert self.trainer.step_once(), "the trainer found the round's sessions"


@pytest.fixture(scope="module")
def console(tiny_engine: TransformersEngine, tiny_model_path: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """A gateway with an admin and two agent keys, a trainer on its store, and recorded sessions."""
    tmp = tmp_path_factory.mktemp("console")
    gw = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp / 'console.db'}",
                       publisher=InProcessPublisher(tiny_engine),
                       gateway={"api_keys": [AGENT_A, AGENT_B], "admin_key": ADMIN_KEY})

    # as a trainer in its own process does (its weights cannot cross processes)
    def publish(version: int, path: Path, kind: str, *, weights: object = None) -> None:
        response = httpx.post(f"{gw.url}/v1/policies", headers=_auth(ADMIN_KEY), timeout=120,
                              json={"version": version, "checkpoint": str(path), "kind": kind})
        response.raise_for_status()

    cfg = TrainConfig(lora=False, lr=1e-3, batch_sessions=8, min_sessions=1, max_staleness=100, replay_successes=4,
                      checkpoint_dir=tmp / "ckpt")
    trainer = Trainer(cfg, open_db(gw.gateway.config.store.url), tiny_model_path, publish=publish)
    console = Console(gw, trainer)
    # agent-a: a group of arithmetic episodes (one of them two turns long), one about zebras, one still open
    console.episode(AGENT_A, "sum-1", "sums", 1.0, "What is 2 + 3?", "And 4 + 4?")
    console.episode(AGENT_A, "sum-2", "sums", 0.0, "What is 7 + 1?")
    console.episode(AGENT_A, "sum-3", "sums", 0.5, "What is 9 + 9?")
    console.episode(AGENT_A, "zoo-1", "animals", 1.0, "Describe a zebra in one line.")
    console.chat(AGENT_A, "open-1", "animals", "Name a bird.")
    console.episode(AGENT_B, "b-secret", "other", 1.0, "This one belongs to agent b.")
    yield console
    trainer.close()
    gw.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], f"JavaScript errors in the console: {errors}"


def _shot(page: Any, name: str, selector: str | None = None) -> Path:
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    if selector:
        # A live page redraws every few seconds; an element redrawn during its screenshot is taken again.
        for attempt in range(3):
            try:
                page.locator(selector).screenshot(path=str(path))
                break
            except sync_api.Error as error:
                if "not attached to the DOM" not in str(error) or attempt == 2:
                    raise
    else:
        page.screenshot(path=str(path), full_page=True)
    return path


def _login(page: Any, gw: RunningGateway, key: str) -> None:
    page.goto(f"{gw.url}/ui")
    sync_api.expect(page.locator("#login")).to_be_visible()
    page.fill("#login-key", key)
    page.click("#login-form button[type=submit]")
    sync_api.expect(page.locator("#nav")).to_be_visible()


def _listed(page: Any) -> list[str]:
    page.wait_for_selector("#sessions tbody")
    return list(page.locator("#sessions tbody tr").evaluate_all("rows => rows.map(r => r.dataset.id)"))


def _apply_filters(page: Any, **fields: str) -> None:
    for name, value in fields.items():
        target = page.locator(f"#filters [name={name}]")
        if target.evaluate("node => node.tagName") == "SELECT":
            target.select_option(value)
        else:
            target.fill(value)
    page.click("#filters button[type=submit]")


def test_admin_filters_opens_corrects_a_session_and_the_trainer_skips_it(console: Console, page: Any) -> None:
    gw = console.gw
    page.goto(f"{gw.url}/ui")
    sync_api.expect(page.locator("#login")).to_be_visible()
    page.fill("#login-key", "wrong-key")
    page.click("#login-form button[type=submit]")
    sync_api.expect(page.locator("#login-error")).to_contain_text("Incorrect API key")
    page.fill("#login-key", ADMIN_KEY)
    page.click("#login-form button[type=submit]")
    sync_api.expect(page.locator("#trainer-state .value")).to_have_text("waiting")
    _shot(page, "overview")

    page.click("#nav >> text=Sessions")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 6")
    assert set(_listed(page)) == {"sum-1", "sum-2", "sum-3", "zoo-1", "open-1", "b-secret"}, "the admin sees all"
    _apply_filters(page, q="ZEBRA")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 1")
    assert _listed(page) == ["zoo-1"]
    _apply_filters(page, q="", group="sums", status="final", reward_min="0.5")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 2")
    assert sorted(_listed(page)) == ["sum-1", "sum-3"]
    page.locator("#sessions th[data-sort=reward]").click()  # reward, high to low
    sync_api.expect(page.locator("#sessions th[data-sort=reward]")).to_contain_text("▼")
    assert _listed(page) == ["sum-1", "sum-3"]
    _apply_filters(page, reward_min="lots")
    sync_api.expect(page.locator("#view-error")).to_contain_text("not a finite number")

    page.click("#sessions a >> text=sum-1")
    sync_api.expect(page.locator("main h1")).to_have_text("Session sum-1")
    sync_api.expect(page.locator("#facts")).to_be_visible()
    assert page.locator("#view-error").text_content() == ""
    trajectory = console.get("/v1/sessions/sum-1/trajectory", text="true")
    segments = [seg for t in trajectory["trajectories"] for seg in t["segments"]]
    assert len(segments) == 1, "two turns that extend each other are one segment"
    sampled = page.locator(".tok.sampled")
    sync_api.expect(sampled).to_have_count(sum(segments[0]["loss_mask"]))
    sync_api.expect(page.locator(".tok.prompt")).to_have_count(len(segments[0]["loss_mask"]) - sum(
        segments[0]["loss_mask"]))
    colours = sampled.evaluate_all("spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    plain = page.locator(".tok.prompt").first.evaluate("span => getComputedStyle(span).backgroundColor")
    assert all(c != plain for c in colours), "every sampled token has a logprob heat; prompt tokens have none"
    assert "logprob" in (sampled.first.get_attribute("title") or "")
    sync_api.expect(page.locator(".tokens .ver").first).to_have_text("v0")
    sync_api.expect(page.locator("#call-tree li")).to_have_count(2)
    sync_api.expect(page.locator("#timeline li.reward")).to_have_count(1)

    page.fill("#override-reward", "0")
    page.fill("#action-note", "the second answer was wrong")
    page.click("#override")
    sync_api.expect(page.locator("#action-ok")).to_have_text("Saved: reward override.")
    sync_api.expect(page.locator("[data-fact='override']")).to_have_text("0")
    page.fill("#action-note", "leaked the answer")
    page.click("#exclude")
    sync_api.expect(page.locator("#include")).to_be_visible()
    sync_api.expect(page.locator("#action-ok")).to_have_text("Saved: exclude.")
    sync_api.expect(page.locator("#timeline li.action")).to_have_count(2)
    _shot(page, "session")

    session = console.get("/v1/sessions/sum-1")
    assert (session["reward"], session["reward_override"], session["excluded"]) == (0.0, 0.0, True)
    actions = console.get("/v1/sessions/sum-1/actions")["data"]
    assert [(a["action"], a["actor"], a["note"]) for a in actions] == [
        ("reward_override", fingerprint(ADMIN_KEY), "the second answer was wrong"),
        ("exclude", fingerprint(ADMIN_KEY), "leaked the answer")]

    # the trainer honours it: it trains on the rest of the group, never on sum-1
    assert console.trainer.step_once()
    trained = {s["id"]: s for s in console.get("/v1/sessions", limit=100)["data"]}
    assert trained["sum-1"]["trained_version"] is None and trained["sum-1"]["excluded"] is True
    assert trained["sum-2"]["trained_version"] == trained["sum-3"]["trained_version"] == console.trainer.version
    assert console.get("/v1/policies")["sessions"]["set_aside"].get("excluded") == 1
    page.click("#nav >> text=Sessions")
    _apply_filters(page, excluded="true")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 1")
    assert _listed(page) == ["sum-1"]
    sync_api.expect(page.locator("#sessions tbody tr").first).to_contain_text("excluded")


@pytest.mark.parametrize("typed", ["abc", "NaN", "nan", "Infinity", "1e999", "", "1,5", "0x10"])
def test_bad_rewards_in_the_form_show_an_error_and_change_nothing(console: Console, page: Any, typed: str) -> None:
    before = console.get("/v1/sessions/sum-2")
    _login(page, console.gw, ADMIN_KEY)
    page.goto(f"{console.gw.url}/ui/#/session/sum-2")
    page.fill("#override-reward", typed)
    page.fill("#action-note", "should not be stored")
    page.click("#override")
    sync_api.expect(page.locator("#action-error")).to_contain_text("must be a finite number")
    sync_api.expect(page.locator("#action-ok")).to_have_text("")
    assert console.get("/v1/sessions/sum-2/actions")["data"] == []
    after = console.get("/v1/sessions/sum-2")
    assert (after["reward"], after["reward_override"], after["excluded"]) == (
        before["reward"], before["reward_override"], before["excluded"])


def test_an_agent_key_sees_only_its_own_sessions_and_corrects_nothing(console: Console, page: Any) -> None:
    _login(page, console.gw, AGENT_B)
    sync_api.expect(page.locator("#nav a[href='#/overview']")).to_be_hidden()
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 1")
    assert _listed(page) == ["b-secret"]
    page.goto(f"{console.gw.url}/ui/#/session/zoo-1")  # agent a's session
    sync_api.expect(page.locator("#view-error")).to_contain_text("belongs to another API key")
    page.goto(f"{console.gw.url}/ui/#/session/b-secret")
    sync_api.expect(page.locator(".tok.sampled").first).to_be_visible()
    sync_api.expect(page.locator("#actions")).to_have_count(0)
    # what the buttons would send, sent from the page with the agent's key from the cookie: refused
    statuses = page.evaluate("""async () => {
        const key = decodeURIComponent(document.cookie.split('; ').find(c => c.startsWith('tt_console_key='))
                                       .split('=')[1]);
        const post = (path, body) => fetch(path, {method: 'POST', body: JSON.stringify(body),
            headers: {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json'}}).then(r => r.status);
        const clear = (path) => fetch(path, {method: 'DELETE', headers: {'Authorization': 'Bearer ' + key}})
            .then(r => r.status);
        return [await post('/v1/sessions/b-secret/exclude', {note: 'x'}),
                await post('/v1/sessions/b-secret/reward_override', {reward: 0, note: 'x'}),
                await post('/v1/sessions/zoo-1/exclude', {note: 'x'}),
                await clear('/v1/sessions/b-secret/reward_override')];
    }""")
    assert statuses == [403, 403, 403, 403]
    for sid in ("b-secret", "zoo-1"):
        assert console.get(f"/v1/sessions/{sid}/actions")["data"] == []
        assert console.get(f"/v1/sessions/{sid}")["excluded"] is False
    page.goto(f"{console.gw.url}/ui/#/overview")
    sync_api.expect(page.locator("#view-error")).to_contain_text("needs the admin key")
    page.click("#logout")
    sync_api.expect(page.locator("#login")).to_be_visible()
    page.reload()
    sync_api.expect(page.locator("#login")).to_be_visible()  # the cookie is gone


def test_policies_overview_and_capture_pages_show_the_api_figures(console: Console, page: Any) -> None:
    for rewards in ([1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]):
        console.train_round(rewards)
    listed = console.get("/v1/policies")
    trained = [p for p in listed["data"] if p["version"] > 0]
    assert len(trained) >= 3 and listed["served_version"] == trained[-1]["version"]
    _login(page, console.gw, ADMIN_KEY)
    page.goto(f"{console.gw.url}/ui/#/policies")
    sync_api.expect(page.locator("#chart-version canvas")).to_have_count(1)
    sync_api.expect(page.locator("#chart-time canvas")).to_have_count(1)
    sync_api.expect(page.locator("#policies tbody tr")).to_have_count(len(listed["data"]))
    figures = trained[-1]["metrics"]
    assert {"reward_mean", "advantage_std", "loss", "kl", "entropy", "clip_fraction", "samples", "set_aside",
            "staleness", "publish_seconds", "time_s"} <= figures.keys()
    newest = page.locator(f"#policies tr[data-version='{trained[-1]['version']}']")
    for part in ("wait", "fwd/bwd", "ckpt", "publish"):  # where the step's time went
        sync_api.expect(newest.locator(".step-time")).to_contain_text(part)
    assert trained[-1]["promotion"] == "immediate"
    sync_api.expect(newest.locator(".promotion")).to_have_text("immediate")
    for name in ("reward_mean", "advantage_std", "clip_fraction"):
        value = figures[name]  # shown as the console's fmt() does: a whole number without decimals
        sync_api.expect(newest).to_contain_text(str(int(value)) if float(value).is_integer() else f"{value:.3f}")
    replayed = figures["replayed"]  # earlier rounds' successes trained on again (train.replay_successes)
    assert replayed > 0
    sync_api.expect(newest.locator(".samples")).to_have_text(f"{figures['samples']} + {replayed} replayed")
    _shot(page, "policies")
    _shot(page, "policies_chart", ".charts")

    page.goto(f"{console.gw.url}/ui/#/overview")
    overview = console.get("/v1/overview")
    sync_api.expect(page.locator(".card", has_text="serving policy")).to_contain_text(f"v{overview['served_version']}")
    sync_api.expect(page.locator(".card", has_text="last publish")).to_contain_text(
        f"v{overview['last_publish']['version']}")
    sync_api.expect(page.locator(".card", has_text="requests/s")).not_to_contain_text("—")  # a rate after 2 reads

    page.goto(f"{console.gw.url}/ui/#/capture")
    stats = console.get("/v1/stats/capture")
    sync_api.expect(page.locator("#capture tbody tr")).to_have_count(len(stats["data"]) + 1)
    sync_api.expect(page.locator("#capture tbody tr").last).to_contain_text(str(stats["total"]["calls"]))
    _shot(page, "capture")


def test_tool_calls_and_results_are_items_and_an_override_can_be_cleared(console: Console, page: Any) -> None:
    # A client that ran a tool sends its call and result; the tiny model only has to answer in text.
    client = OpenAI(base_url=console.gw.v1("tool-1", "tools"), api_key=AGENT_A, max_retries=0)
    client.chat.completions.create(model=MODEL, max_tokens=4, tools=[ADD_TOOL], tool_choice="none", messages=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "5 (from the calculator)"}])
    assert console.post("/v1/rewards", {"session_id": "tool-1", "reward": 1.0, "final": True}, AGENT_A).is_success
    _login(page, console.gw, ADMIN_KEY)
    page.goto(f"{console.gw.url}/ui/#/session/tool-1")
    tree = page.locator("#call-tree")
    sync_api.expect(tree.locator(".item.tool-call")).to_contain_text('add({"a": 2, "b": 3})')
    sync_api.expect(tree.locator(".item.tool-result")).to_contain_text("5 (from the calculator)")
    sync_api.expect(tree.locator(".item.tool-result")).to_contain_text("add (call_7)")
    sync_api.expect(tree.locator(".item.message.reply")).to_have_count(1)
    _shot(page, "session_tools", "#call-tree")

    sync_api.expect(page.locator("#clear-override")).to_have_count(0)  # nothing to clear yet
    page.fill("#override-reward", "0")
    page.click("#override")
    sync_api.expect(page.locator("[data-fact='override']")).to_have_text("0")
    page.fill("#action-note", "the judge was right")
    page.click("#clear-override")
    sync_api.expect(page.locator("#action-ok")).to_have_text("Cleared: reward override.")
    sync_api.expect(page.locator("[data-fact='override']")).to_have_text("—")
    sync_api.expect(page.locator("[data-fact='reward (for training)']")).to_have_text("1")
    sync_api.expect(page.locator("#clear-override")).to_have_count(0)
    sync_api.expect(page.locator("#timeline li.action")).to_have_count(2)
    actions = console.get("/v1/sessions/tool-1/actions")["data"]
    assert [(a["action"], a["note"]) for a in actions] == [("reward_override", ""),
                                                           ("clear_reward_override", "the judge was right")]


def test_a_gateway_without_keys_opens_the_console_directly(gateway: RunningGateway, page: Any) -> None:
    OpenAI(base_url=gateway.v1("loop-1"), api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    page.goto(f"{gateway.url}/ui")
    sync_api.expect(page.locator("#who")).to_have_text("no keys (loopback)")
    sync_api.expect(page.locator("#login")).to_be_hidden()
    page.click("#nav >> text=Sessions")
    assert _listed(page) == ["loop-1"]


def test_the_policies_page_says_why_sessions_go_stale(gateway: RunningGateway, page: Any) -> None:
    with Session(gateway.gateway.db) as s:
        for i in range(40):  # rewarded after the trainer moved on two versions
            add_session(s, f"late-{i}", f"g-{i // 8}", float(i % 2), version=0)
        s.commit()
        leases.set_aside_stale(s, min_version=1)
    page.goto(f"{gateway.url}/ui/#/policies")
    hint = page.locator("#policy-hints .hint")
    sync_api.expect(hint).to_have_count(1)
    sync_api.expect(hint).to_contain_text("40 finished sessions were set aside as stale")
    sync_api.expect(hint).to_contain_text("train.max_staleness (1)")
    _shot(page, "policies_stale_hint", "#policy-hints")


def test_an_admin_marks_a_session_never_to_be_trained_and_sees_purged_ones(console: Console, page: Any) -> None:
    console.episode(AGENT_A, "consent-1", "consent", 1.0, "Keep this between us.")
    console.episode(AGENT_A, "erased-1", "consent", 1.0, "Forget me, please.")
    erased = httpx.request("DELETE", f"{console.gw.url}/v1/sessions/erased-1", headers=_auth(ADMIN_KEY),
                           json={"reason": "erasure request"}, timeout=30)
    assert erased.status_code == 200, erased.text
    _login(page, console.gw, ADMIN_KEY)
    page.goto(f"{console.gw.url}/ui/#/session/consent-1")
    sync_api.expect(page.locator("[data-fact='training']")).to_have_text("not yet")
    sync_api.expect(page.locator("[data-fact='content']")).to_have_text("kept")
    page.fill("#action-note", "the user withdrew consent")
    page.once("dialog", lambda dialog: dialog.accept())  # it cannot be undone: the console asks first
    page.click("#no-train")
    sync_api.expect(page.locator("#action-ok")).to_have_text("Saved: no train.")
    sync_api.expect(page.locator("[data-fact='training']")).to_have_text("not for training (an admin)")
    sync_api.expect(page.locator("#no-train")).to_have_count(0)
    sync_api.expect(page.locator("#exclude")).to_have_count(0)  # nor can it be included again
    sync_api.expect(page.locator("#timeline li.action")).to_contain_text("the user withdrew consent")
    assert console.get("/v1/sessions/consent-1")["skip_reason"] == "no_train_admin"

    page.goto(f"{console.gw.url}/ui/#/session/erased-1")
    sync_api.expect(page.locator("[data-fact='content']")).to_contain_text("content deleted")
    sync_api.expect(page.locator("[data-fact='training']")).to_have_text("never (content deleted)")
    page.goto(f"{console.gw.url}/ui/#/sessions")
    _apply_filters(page, group="consent")
    sync_api.expect(page.locator("#sessions tbody tr[data-id='consent-1']")).to_contain_text("not for training")
    sync_api.expect(page.locator("#sessions tbody tr[data-id='erased-1']")).to_contain_text("content deleted")
    _shot(page, "sessions_consent", "#sessions")
    audit = console.get("/v1/audit", session_id="consent-1")["data"]
    assert [(e["action"], e["detail"]["note"]) for e in audit] == [("no_train", "the user withdrew consent")]


# --- policies ----------------------------------------------------------------------------------------------

SUPPORT_KEY = "sk-support"
POLICY_SESSIONS = {"default": ["d-1", "d-2"], "support": ["s-1", "s-2", "s-3"], "coding": ["c-1"]}


@pytest.fixture(scope="module")
def policies_gw(tiny_engine: TransformersEngine, tiny_model_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """A gateway with two named policies (room for one more) and a key bound to one: sessions and rewards in
    each policy, and versions in the store for each named line (support v1 and v2, coding v1), none for the
    default line."""
    tmp = tmp_path_factory.mktemp("policies")
    gw = start_gateway(RecordingEngine(tiny_engine), tiny_model_path, f"sqlite:///{tmp / 'policies.db'}",
                       engine={"max_loras": 4},
                       gateway={"admin_key": ADMIN_KEY, "policies": [{"name": "support"}, {"name": "coding"}],
                                "api_keys": [AGENT_A, {"key": SUPPORT_KEY, "policy": "support"}]})
    keys = {"default": AGENT_A, "support": SUPPORT_KEY, "coding": AGENT_A}
    for policy, sessions in POLICY_SESSIONS.items():
        for i, sid in enumerate(sessions):
            # The default policy by an unbound key, support by its key, coding by its model name.
            client = OpenAI(base_url=gw.v1(sid, f"{policy}-group"), api_key=keys[policy], max_retries=0)
            client.chat.completions.create(model="coding" if policy == "coding" else MODEL, max_tokens=4,
                                           messages=[{"role": "user", "content": f"A question for {policy}."}])
            if i < len(sessions) - 1 or policy == "coding":  # each line's last one stays open, but coding's
                posted = httpx.post(f"{gw.url}/v1/rewards", headers=_auth(keys[policy]), timeout=30,
                                    json={"session_id": sid, "reward": 0.5 * i, "final": True})
                assert posted.status_code == 200, posted.text
    with Session(gw.gateway.db) as db:  # as the trainer records a named policy's versions
        for line, version, reward in (("support", 1, 0.25), ("support", 2, 0.75), ("coding", 1, 0.5)):
            db.add(Policy(line=line, version=version, checkpoint=f"/ckpt/{line}/{version}", kind="lora",
                          published_at=utcnow(), promotion="immediate", metrics={"reward_mean": reward}))
        db.commit()
    yield gw
    gw.stop()


def _legend(page: Any, chart: str) -> list[str]:
    """The series of a chart, by name (uPlot's legend, the x series left out)."""
    labels = page.locator(f"#{chart} .u-legend .u-series .u-label").all_text_contents()
    return [label for label in labels if label not in ("version", "time")]


def test_the_policy_selector_narrows_sessions_charts_and_cards(policies_gw: RunningGateway, page: Any) -> None:
    gw = policies_gw
    _login(page, gw, ADMIN_KEY)
    page.click("#nav >> text=Sessions")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 6")
    select = page.locator("#policy")
    assert select.locator("option").all_text_contents() == ["all policies", "default", "support", "coding"]

    select.select_option("support")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 3")
    assert sorted(_listed(page)) == POLICY_SESSIONS["support"]
    assert set(page.locator("#sessions td.policy").all_text_contents()) == {"support"}
    assert "policy=support" in page.url, "the selection is in the link"
    _apply_filters(page, status="final")  # the other filters keep the policy
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 2")
    assert sorted(_listed(page)) == ["s-1", "s-2"]
    _shot(page, "sessions_policy")

    page.click("#nav >> text=Policies")  # the nav links carry the selection
    sync_api.expect(page.locator("#scope")).to_contain_text("policy support")
    sync_api.expect(page.locator("#policies tbody tr")).to_have_count(2)
    rows = page.locator("#policies tbody tr").evaluate_all("rows => rows.map(r => r.dataset.line + r.dataset.version)")
    assert rows == ["support2", "support1"]
    sync_api.expect(page.locator("#chart-version canvas")).to_have_count(1)
    assert _legend(page, "chart-version") == ["support"]
    sync_api.expect(page.locator("#policy-sessions")).to_contain_text("Serving support v0")
    _shot(page, "policies_support", ".charts")

    page.click("#nav >> text=Overview")
    sync_api.expect(page.locator("#serving .sub")).to_have_text("policy support")
    sync_api.expect(page.locator("#last-publish .value")).to_have_text("v2")
    sync_api.expect(page.locator("#sessions-open .value")).to_have_text("1")
    sync_api.expect(page.locator("#sessions-final .value")).to_have_text("2")
    overview = httpx.get(f"{gw.url}/v1/overview", params={"policy": "support"}, headers=_auth(ADMIN_KEY)).json()
    sync_api.expect(page.locator("#serving .value")).to_have_text(f"v{overview['served_version']}")

    # A link opens the same view: a fresh page at another policy's sessions.
    page.goto(f"{gw.url}/ui/#/sessions?policy=coding")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 1")
    assert _listed(page) == ["c-1"] and select.input_value() == "coding"
    page.click("#nav >> text=Overview")
    sync_api.expect(page.locator("#last-publish .value")).to_have_text("v1")
    sync_api.expect(page.locator("#sessions-final .value")).to_have_text("1")

    select.select_option("")  # every policy: the default line's versions on the cards, a series per line
    sync_api.expect(page.locator("#scope")).to_contain_text("all policies")
    sync_api.expect(page.locator("#last-publish .value")).to_have_text("—")
    sync_api.expect(page.locator("#serving .sub")).to_contain_text("default policy; coding v0; support v0")
    sync_api.expect(page.locator("#sessions-open .value")).to_have_text("2")
    page.click("#nav >> text=Policies")
    sync_api.expect(page.locator("#policies tbody tr")).to_have_count(4)  # default's v0 and the three above
    created = httpx.post(f"{gw.url}/v1/policies", headers=_auth(ADMIN_KEY), json={"name": "later"}, timeout=30)
    assert created.status_code == 200, created.text
    sync_api.expect(select.locator("option[value=later]")).to_have_count(1)  # the page's refresh offers it
    sync_api.expect(page.locator("#chart-version canvas")).to_have_count(1)
    assert sorted(_legend(page, "chart-version")) == ["coding", "support"]
    page.click("#nav >> text=Sessions")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 6")

    page.goto(f"{gw.url}/ui/#/overview?policy=nowhere")  # an unknown policy: the API's 404, shown
    sync_api.expect(page.locator("#view-error")).to_contain_text("does not exist")


def test_a_key_bound_to_a_policy_is_offered_only_its_own(policies_gw: RunningGateway, page: Any) -> None:
    _login(page, policies_gw, SUPPORT_KEY)
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 3")
    assert sorted(_listed(page)) == POLICY_SESSIONS["support"]
    select = page.locator("#policy")
    assert select.locator("option").all_text_contents() == ["support"]
    sync_api.expect(select).to_be_disabled()
    sync_api.expect(page.locator("#who")).to_contain_text("policy support")
    page.goto(f"{policies_gw.url}/ui/#/sessions?policy=coding")  # a link to another policy: still its own
    sync_api.expect(page.locator("#scope")).to_contain_text("policy support")
    sync_api.expect(page.locator("#page-info")).to_contain_text("of 3")
    assert sorted(_listed(page)) == POLICY_SESSIONS["support"]
    assert page.locator("#view-error").text_content() == ""
