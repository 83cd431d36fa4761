"""An E2B-compatible face on a swerl fleet (`swerl e2b serve`).

Code written against the E2B SDK (slime's E2BSandbox, Harbor's e2b environment, any harness)
runs on swerl's pool and exec nodes by changing environment variables only: the control API
(REST, `E2B_API_URL`) makes each E2B sandbox a pool lease, and the sandbox API (`envd`,
`E2B_SANDBOX_URL`: Connect-protocol `process.Process` and `filesystem.Filesystem` RPCs and HTTP
`/files`) runs commands and file operations over the nodes' Exec calls. See docs/e2b.md.
"""
