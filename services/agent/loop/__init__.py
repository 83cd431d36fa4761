"""The episode loop and what runs it: `Episode` (lease a sandbox, policy turn -> action ->
observation under one budget, then grading and records), the runner that validates a
start and streams one episode, branching, the episode board, pacing, artifacts and the
`SandboxProvider` seam over the pool.
"""
