"""The prompt a request would send, without generating or recording anything: Anthropic's `count_tokens`.

The same steps as `serving.prepare` up to the prompt (the model, the session binding with its owner and policy, the
earlier call the messages extend, the forced tool-call opener), so a count is exactly the `input_tokens` the
same request then gets as a Messages call; none of the steps that act (admission, the canary's pinning, the
generation holds). A request in a session with calls is counted on its token chain, as it would be sent.
"""

from __future__ import annotations

from tracetrain.proxy.auth import Caller
from tracetrain.proxy.chain import plan_prompt
from tracetrain.proxy.gateway import Gateway
from tracetrain.proxy.render import history_hashes
from tracetrain.proxy.serving import CallSpec, call_policy, model_policy


async def prompt_ids(gw: Gateway, spec: CallSpec, *, caller: Caller) -> list[int]:
    """The exact token ids the engine would be given for `spec` now."""
    named = await model_policy(gw, spec, caller)
    session_id = spec.binding.session_id
    stored = await gw.sessions.owned(session_id, caller, must_exist=False) if session_id else None
    call_policy(caller, named, session_id or spec.completion_id, stored)
    parent = None
    if session_id is not None and stored is not None:
        parent = await gw.sessions.find_parent(session_id, history_hashes(spec.tools, spec.messages), spec.messages)
    plan = plan_prompt(gw.renderer, messages=spec.messages, tools=spec.tools, parent=parent,
                       session_has_calls=stored is not None)
    forced = spec.constraint.forced_prefix if spec.constraint else ""
    return plan.prompt_ids + gw.renderer.encode(forced) if forced else plan.prompt_ids
