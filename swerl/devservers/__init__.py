"""Development servers, tools for demos, tests and benchmarks rather than parts of a
service: the replay policy server, the scripted PRM judge model and the simulated pool
nodes.
"""
