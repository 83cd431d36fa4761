"""The action protocols behind one `ActionProtocol`: how a policy reply becomes an action in
the sandbox and an observation back (bash blocks, or tool calls with their parsers).
"""
