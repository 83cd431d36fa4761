"""PolicyConfig.lora_path: every policy call of the episode names the adapter (issue 23, item
1). SGLang samples from the base model when a `/generate` names none, so a LoRA run whose calls
lacked it would be sampled from the wrong policy. Real SglangPolicy against the replay server."""

from __future__ import annotations

import aiohttp
import pytest
from testkit.agent import TOKENIZER_DIR

from swerl.agent.config import load_config
from swerl.agent.policy.clients import SglangPolicy
from swerl.agent.policy.modes import TokenMode
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import load_tokenizer
from swerl.devservers.replay import ReplayPolicyServer, script_key

ISSUE = "Parsing breaks on empty sections."


@pytest.mark.parametrize("lora_path", ["miles_lora", "__miles_slot_3", ""])
async def test_every_policy_call_of_a_lora_episode_names_its_adapter(lora_path: str) -> None:
    script = [f"Next.\n\n```bash\nls {i}\n```" for i in range(3)]
    replay = ReplayPolicyServer({script_key(ISSUE): script})
    url = await replay.start()
    config = load_config("")
    codec = ChatCodec(load_tokenizer(TOKENIZER_DIR), config.chat_template_kwargs, TOKENIZER_DIR)
    try:
        async with aiohttp.ClientSession() as session:
            mode = TokenMode(
                SglangPolicy(session, url, {}, request_timeout_s=30, lora_path=lora_path),
                codec,
                max_context_tokens=32_000,
                max_new_tokens=256,
                omission_text=lambda n: f"[{n} omitted]",
            )
            await mode.open("You are an agent.", ISSUE)
            for observation in ("a.py", "b.py", "c.py"):
                await mode.respond([])
                await mode.observe(observation)
            branch = mode.branch(7)
            await branch.respond([])
    finally:
        await replay.stop()
    assert len(replay.stats.calls) == 4
    assert [c.lora_path for c in replay.stats.calls] == [lora_path or None] * 4
