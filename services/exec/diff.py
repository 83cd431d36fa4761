"""A sandbox's changes as one git patch (GetDiff), computed inside the sandbox by one script.

The script stages the work tree into a private index (GIT_INDEX_FILE), so the agent's own staging
area is untouched, and prints the base commit, the changed paths and the binary-safe patch; its
exit code says what went wrong (no directory, not a work tree, unknown base ref, git failing).
"""

from __future__ import annotations

from dataclasses import dataclass

from swerl.exec.errors import DiffTooLarge, NotAGitRepository, UnknownBaseRef
from swerl.exec.settings import DIFF_TIMEOUT_S
from swerl.exec.shell import SandboxShell, bash_quote

_GIT = (
    "git -c core.quotepath=false -c diff.noprefix=false -c diff.mnemonicPrefix=false"
    " -c color.ui=false"
)


@dataclass(frozen=True)
class DiffResult:
    patch: bytes
    files: list[str]
    base_commit: str


def diff_script(repo: str, base: str, include_untracked: bool) -> str:
    """The script: prints `base\\n`, the changed paths (NUL-separated), `\\0`, the patch."""
    add = "add -A" if include_untracked else "add -u"
    return f"""
cd -- {bash_quote(repo).decode()} 2>/dev/null || {{ echo "no such directory" >&2; exit 90; }}
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || exit 91
base=$(git rev-parse --verify -q {bash_quote(base + "^{commit}").decode()}) || exit 92
idx=$(mktemp) || exit 93
trap 'rm -f "$idx"' EXIT
export GIT_INDEX_FILE="$idx"
{_GIT} read-tree "$base" && {_GIT} {add} >/dev/null || exit 94
printf '%s\\n' "$base"
{_GIT} diff --cached --name-only -z "$base" || exit 95
printf '\\0'
{_GIT} diff --cached --binary --no-ext-diff --no-textconv "$base" || exit 96
"""


async def git_diff(
    shell: SandboxShell,
    sandbox_id: str,
    repo: str,
    base_ref: str,
    include_untracked: bool,
    max_diff_bytes: int,
) -> DiffResult:
    """The diff of `repo` in the sandbox against `base_ref` (HEAD when empty)."""
    base = base_ref or "HEAD"
    code, out, err, truncated = await shell.run_capture(
        diff_script(repo, base, include_untracked),
        timeout_s=DIFF_TIMEOUT_S,
        max_output_bytes=max_diff_bytes,
    )
    if code == 90 or code == 91:
        raise NotAGitRepository(f"{repo!r} is not a git work tree in sandbox {sandbox_id}")
    if code == 92:
        raise UnknownBaseRef(f"base ref {base!r} is not a commit in {repo!r}")
    if truncated:
        raise DiffTooLarge(f"diff exceeds {max_diff_bytes} bytes")
    if code != 0:
        message = err.decode(errors="replace")[-500:]
        raise NotAGitRepository(f"git failed ({code}): {message}")
    head, _, rest = out.partition(b"\n")
    names, _, patch = rest.partition(b"\0\0")
    if not names and rest.startswith(b"\0"):
        patch = rest[1:]
    files = [n.decode("utf-8", "surrogateescape") for n in names.split(b"\0") if n]
    return DiffResult(patch=patch, files=files, base_commit=head.decode().strip())
