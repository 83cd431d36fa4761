"""Policy and tokens: the clients of the policy servers (SGLang `/generate`, OpenAI-style
chat), the per-episode `Policy` modes over them, the token-exact conversation and the
context budget.
"""
