"""The model gateway: OpenAI- and Anthropic-compatible HTTP per session in front of the policy.

An unmodified agent harness talks its usual API to `<gateway>/s/<session>/v1`; each call is
rendered with the policy's chat template, extends the session's recorded token chains where
its history does (the model's own sampled ids are reused, never re-tokenized text), goes to
SGLang's `/generate` with `input_ids`, and is answered in the protocol's own shape. Closing the
session turns each root-to-leaf chain of its call tree into one token record.

Modules: `messages` (requests of both protocols to one message model), `render` (chat template
to ids, incremental), `tree` (the call tree and its records), `session` (sessions and one call's
flow), `openai_api` / `anthropic_api` (each protocol's replies, streams and errors), `http`
(the aiohttp face), `wire` (sessions as `swerl.agent.v1` protos).
"""
