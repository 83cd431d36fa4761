"""Prefix-cache counts reach the training records (issue 23, item 8): the engine's
`meta_info.cached_tokens` / `prompt_tokens` of every policy call are summed into the record
holding its response (TokenRecord.cached_tokens / engine_prompt_tokens), which the plugin turns
into Sample.prefix_cache_info, the frameworks' `prefix_cache_hit_rate`. Real SglangPolicy and
TokenMode against the replay server, whose prefix cache model reports what an earlier call's
prompt + output shared with the new prompt."""

from __future__ import annotations

import aiohttp
from testkit.agent import TOKENIZER_DIR

from swerl.agent.config import load_config
from swerl.agent.policy.clients import SglangPolicy
from swerl.agent.policy.modes import TokenMode
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import load_tokenizer
from swerl.devservers.replay import PrefixCacheModel, ReplayPolicyServer, script_key

ISSUE = "Parsing breaks on empty sections."


async def test_every_record_carries_the_engines_cached_and_prompt_tokens() -> None:
    script = [f"Next.\n\n```bash\nls {i}\n```" for i in range(3)]
    replay = ReplayPolicyServer({script_key(ISSUE): script}, keep_requests=True)
    url = await replay.start()
    config = load_config("")
    codec = ChatCodec(load_tokenizer(TOKENIZER_DIR), config.chat_template_kwargs, TOKENIZER_DIR)
    try:
        async with aiohttp.ClientSession() as session:
            mode = TokenMode(
                SglangPolicy(session, url, {}, request_timeout_s=30),
                codec,
                max_context_tokens=32_000,
                max_new_tokens=256,
                omission_text=lambda n: f"[{n} omitted]",
            )
            await mode.open("You are an agent.", ISSUE)
            for observation in ("a.py", "b.py", "c.py"):
                await mode.respond([])
                await mode.observe(observation)
    finally:
        await replay.stop()
    seen = replay.stats.requests_seen
    turns = mode.turn_records()
    assert len(turns) == len(seen) == 3
    # Turn 0 hit nothing; turn k's prompt extends turn k-1's prompt + output, all cached.
    assert turns[0].cached_tokens == 0
    for k in (1, 2):
        prompt, output = seen[k - 1]
        assert turns[k].cached_tokens == len(prompt) + len(output) > 0
    assert [t.engine_prompt_tokens for t in turns] == [len(p) for p, _ in seen]
    (whole,) = mode.whole_records()
    assert whole.cached_tokens == sum(t.cached_tokens for t in turns)
    assert whole.engine_prompt_tokens == sum(len(p) for p, _ in seen)


def test_the_prefix_cache_model_never_reports_the_whole_prompt_cached() -> None:
    cache = PrefixCacheModel()
    assert cache.serve(list(range(40)), [7, 8]) == 0
    assert cache.serve(list(range(40)), [7, 8]) == 39, "the last prompt token is computed"
    assert cache.serve([*range(40), 7, 9, 9], []) == 41
    assert cache.serve([5, *range(40)], []) == 0, "another opening shares nothing"
