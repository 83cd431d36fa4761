"""Policy.branch: a branch gets an independent copy of the exact token state and its own
sampling seed (real Qwen3 tokenizer, real SglangPolicy against the replay server)."""

from __future__ import annotations

import aiohttp
from testkit.agent import TOKENIZER_DIR

from swerl.agent.config import load_config
from swerl.agent.policy.clients import SglangPolicy
from swerl.agent.policy.modes import TokenMode
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import load_tokenizer
from swerl.devservers.replay import ReplayPolicyServer, script_key

ISSUE = "Parsing breaks on empty sections."


def _turn(command: str) -> str:
    return f"Next.\n\n```bash\n{command}\n```"


async def test_a_branch_copies_the_token_state_and_samples_with_its_own_seed() -> None:
    script = [_turn("ls"), _turn("cat setup.py"), _turn("git diff")]
    replay = ReplayPolicyServer({script_key(ISSUE): script})
    url = await replay.start()
    config = load_config("")
    codec = ChatCodec(load_tokenizer(TOKENIZER_DIR), config.chat_template_kwargs, TOKENIZER_DIR)
    try:
        async with aiohttp.ClientSession() as session:
            params = {"temperature": 1.0}
            trunk = TokenMode(
                SglangPolicy(session, url, params, request_timeout_s=30),
                codec,
                max_context_tokens=32_000,
                max_new_tokens=512,
                omission_text=lambda n: f"[{n} earlier turns omitted]",
            )
            await trunk.open("You are an agent.", ISSUE)
            for observation in ("a.py\nsetup.py", "from setuptools import setup"):
                await trunk.respond([])
                await trunk.observe(observation)
            [before] = trunk.whole_records()
            branches = [trunk.branch(seed) for seed in (11, 12)]
            for branch in branches:
                turn = await branch.respond([])
                assert "git diff" in turn.text
                await branch.observe("(no changes)")
    finally:
        await replay.stop()
    assert params == {"temperature": 1.0}  # the episode's parameters are not touched
    assert [c.sampling_seed for c in replay.stats.calls] == [None, None, 11, 12]
    # The trunk is as it was at the fork; each branch is the trunk's record and one more turn.
    assert trunk.recorded_turns == 2 and trunk.whole_records() == [before]
    for branch in branches:
        assert branch.recorded_turns == 3
        assert branch.turn_records()[:2] == trunk.turn_records()
        [whole] = branch.whole_records()
        assert whole.prompt_ids == before.prompt_ids
        n = len(before.response_ids)
        assert whole.response_ids[:n] == before.response_ids
        assert whole.loss_mask[:n] == before.loss_mask and whole.logprobs[:n] == before.logprobs
        assert len(whole.response_ids) > n
