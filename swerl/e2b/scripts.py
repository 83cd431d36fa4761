"""The bash the face runs on a sandbox's node for its E2B processes (launch, poll, kill, stdin,
cleanup), each one short command over the sandbox's ExecCommands call.

A process runs detached from the node's command queue, as a job of its own in the sandbox (its
own process group, stdout/stderr/exit status in files, stdin through a FIFO). Every report
command answers on its stdout a first line (`E <status>`: the process has ended; `R`: it runs;
`K`: it was just killed; `G`: its job's shell is gone without a status, i.e. it was killed
inside the sandbox, e.g. `kill -9 $$`), then the process's stdout from the offset the face has
seen, and on its stderr the process's stderr from its offset; each stream at most `cap` bytes
per report, so a report never meets the node's output cap of a command (which would drop its
middle). A process whose report came back full is reported again before its end is told.

On the path of a quick command (`echo hi`, which ends within the launch's grace) the launch
forks once, for the job, and runs nothing else: the output is read back with bash builtins, and
the files of ended processes are removed later, in batches (`cleanup_command`, or appended to a
poll or kill), off that path. A fork+exec costs a millisecond or more on a busy host, several
times the rest of the round trip.

The files live on the container's /dev/shm (a tmpfs Docker gives every container), not on its
overlay filesystem: writing a new file there cost 0.5 to 2 ms in the base image (a quick
command writes three), against a few microseconds on tmpfs. tmpfs is memory, and Docker's is
64 MiB by default: so a running process's output is freed as the face reads it (`poll_command`
punches the part already read out of its files), and a process's files go once it has ended and
been read. A container started again (after every process in it was killed) has an empty
/dev/shm: its processes were killed with it, and a poll tells them so.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

# Where a process's files live in the sandbox: RECORD_DIR/<rec>.out/.err (its output), .rc (its
# exit status), .in (its stdin FIFO), .hold (the pid of what keeps that FIFO open), .pgid.
RECORD_DIR = "/dev/shm/.swerl-e2b"
# How long the launching command waits for a short process to end, so that a quick command
# (`echo hi`) comes back with its output in one round trip instead of being polled.
LAUNCH_GRACE_S = 0.1
# The sandbox's one FIFO on which every ended process writes `<pid> <status>` (made by the first
# launch, kept until the sandbox ends), so a launch can wait for its process without a timer.
DONE_FIFO = f"{RECORD_DIR}/done"
# The most a launch reads back of each stream with bash builtins (byte by byte, cheap for a
# quick command's few lines); a process that wrote more is read on by a poll (`tail`).
INLINE_READ_BYTES = 8192


@dataclass
class JobSpec:
    """What a launch runs: the job's bash source and how it must be wrapped."""

    source: str  # bash source of the job
    in_group_shell: bool  # CMD may run in the group's own shell (no subshell fork)
    # CMD names its shell's pid (`$$`): the group's shell is a bash of its own (one exec), so
    # that `$$` is the process's pid, as on E2B, not the node's shell's (which a `kill -9 $$`
    # would end)
    own_shell: bool = False


def files(rec: str) -> str:
    return f"{RECORD_DIR}/{rec}"


# A bash function that copies at most $2 bytes of file $1 to stdout with builtins only (no
# fork): NUL-delimited reads in the C locale, so every byte, NULs included, comes back exact.
_CAT = (
    "__e2b_cat() { local LC_ALL=C __x __n=0 __k; while ((__n < $2)); do __k=$(($2 - __n)); "
    "if IFS= read -r -d '' -n $__k __x; then printf '%s' \"$__x\"; __n=$((__n + ${#__x})); "
    "if ((${#__x} < __k)); then printf '\\0'; __n=$((__n + 1)); fi; "
    'else printf \'%s\' "$__x"; break; fi; done <"$1"; return 0; }; '
)

# Words with which CMD could replace the shell that records its status, or that shell's EXIT
# trap: such a CMD runs in a subshell of its own (one more fork).
_REPLACES_SHELL = re.compile(r"\b(exec|trap|source)\b|(^|[;&|(\s])\.\s")
# `$$` or `${$}`: a CMD that names its shell's pid.
_NAMES_OWN_PID = re.compile(r"\$(\$|\{\$\})")


def job_spec(cmd: str, args: list[str], user: str | None) -> JobSpec:
    """The bash source of the job itself.

    E2B runs `/bin/bash -l -c CMD`. The node's shell is a login shell already, with the
    profile's environment, so as root CMD runs in a subshell of it (`eval` keeps a syntax error
    of CMD inside the job): no exec, no profile read per command, which are most of a short
    command's cost (a CMD that names `$$` pays one exec: `JobSpec.own_shell`). Any other
    process, or another user, runs as its own argv.
    """
    argv = [cmd, *args]
    if not (user and user != "root") and len(argv) == 4 and argv[:3] == ["/bin/bash", "-l", "-c"]:
        source, replaces = f"eval {shlex.quote(argv[3])}", _REPLACES_SHELL.search(argv[3])
        return JobSpec(source, not replaces, bool(_NAMES_OWN_PID.search(argv[3])))
    if argv[:2] == ["/bin/bash", "-l"]:
        argv = ["/bin/bash", *argv[2:]]
    if user and user != "root":
        argv = ["runuser", "-u", user, "--", *argv]
    return JobSpec(shlex.join(argv), False)


def _tail(path: str, offset: int, cap: int, stream: str) -> str:
    """Bash that writes at most `cap` bytes of `path` from `offset` on (`stream`: `` or `>&2`):
    one read by one `dd` (GNU), or `tail | head` where its byte-offset skip is missing."""
    return (
        f"[ -s {path} ] && {{ dd if={path} bs={cap} skip={offset} count=1 iflag=skip_bytes"
        f" status=none 2>/dev/null || {{ tail -c +{offset + 1} {path} 2>/dev/null |"
        f" head -c {cap}; }}; }}{stream}; "
    )


# Every file a process can have (named, not globbed: a glob reads /tmp once per pattern).
_SUFFIXES = (".out", ".err", ".rc", ".pgid", ".in", ".hold")


def _remove(ended: Iterable[str]) -> str:
    names = " ".join(files(rec) + suffix for rec in ended for suffix in _SUFFIXES)
    return f"rm -f {names}; " if names else ""


def launch_command(job: JobSpec, rec: str, stdin: bool, cap: int) -> str:
    """The bash source that starts an E2B process detached from the node's command queue.

    The process runs as a job of its own (`set -m`: its own process group, which a kill ends
    whole; disowned, so that the launching shell never reports its end, e.g. `Killed`, on the
    launch's stderr, which is the process's), with its stdout/stderr in files, its stdin
    through a FIFO held open until CloseStdin (or /dev/null), and its exit status written to a
    file and to DONE_FIFO when it ends. The launching command holds DONE_FIFO open from before
    the fork (so the line of a process that ends at once is not lost with the FIFO's last
    reader) and waits up to LAUNCH_GRACE_S for it: a process that ends by then is reported at
    once (`E <status>`, then up to INLINE_READ_BYTES of each stream, read with builtins); one
    that does not answers `R` and is followed by `poll_command`.
    """
    f, done = files(rec), DONE_FIFO
    inline = min(INLINE_READ_BYTES, cap)
    if stdin:
        fifo = f"mkfifo {f}.in; "
        hold = f"sleep infinity >{f}.in 2>/dev/null & __e2b_h=$!; echo $__e2b_h >{f}.hold; "
        job_in, unhold = f"<{f}.in", "kill $__e2b_h 2>/dev/null; "
    else:
        fifo, hold, job_in, unhold = "", "", "</dev/null", ""
    record = f"echo $__e2b_rc >{f}.rc; echo {rec} $__e2b_rc 1<>{done}"
    if job.in_group_shell:
        # CMD runs in the group's own shell (no subshell fork); its status is recorded by an
        # EXIT trap, which an `exit` in CMD runs too.
        body = f"{hold}trap '__e2b_rc=$?; {unhold}{record}' EXIT; {job.source} {job_in}"
        redirects = f">{f}.out 2>{f}.err 4<&-"
    else:
        # CMD might replace the shell or its EXIT trap (exec, trap, source): a subshell of its
        # own, whose status the group records.
        body = f"{hold}( {job.source} ) {job_in} >{f}.out 2>{f}.err; __e2b_rc=$?; {unhold}{record}"
        redirects = "4<&-"
    if job.own_shell:
        body = f"exec /bin/bash -c {shlex.quote(body)}"
    # The group's shell (its pid is the group's id, in .pgid) records the status: a poll that
    # finds it gone without one tells a process killed inside the sandbox (`poll_command`).
    group = f"{{ {body}; }} {redirects} &"
    return (
        f"[ -p {done} ] || {{ mkdir -p {RECORD_DIR} && mkfifo {done}; }}; exec 4<>{done}; "
        f"{fifo}set -m; {group} "
        f"echo $! >{f}.pgid; disown; set +m; __e2b_rc=; "
        f"while read -r -t {LAUNCH_GRACE_S} -u 4 __e2b_p __e2b_s; do "
        f'[ "$__e2b_p" = {rec} ] && {{ __e2b_rc=$__e2b_s; break; }}; done; exec 4<&-; '
        f"if [ -n \"$__e2b_rc\" ]; then printf 'E %s\\n' $__e2b_rc; {_CAT}"
        f"[ -s {f}.out ] && __e2b_cat {f}.out {inline}; "
        f"[ -s {f}.err ] && __e2b_cat {f}.err {inline} >&2; else printf 'R\\n'; fi"
    )


def poll_command(
    rec: str,
    out_from: int,
    err_from: int,
    cap: int,
    ended: Iterable[str],
    *,
    free_out: int = 0,
    free_err: int = 0,
) -> str:
    """Bash that reports a detached process: `E <status>` (it has ended), `R` (it runs) or `G`
    (killed inside the sandbox), then at most `cap` bytes of each stream from the offsets seen;
    the files of `ended` are removed, and the first `free_out`/`free_err` bytes of the process's
    output files (read already) are punched out of them, so that their memory is freed while the
    process runs on (where `fallocate` is missing they stay until the process's files go).

    The status file counts once it holds its line (`-s`): it is created empty and then written,
    and a poll in between read an empty status (told as exit code 1). Without one, the process
    runs while the group's shell (which writes it, and whose pid is in .pgid) lives: neither a
    zombie nor gone, by /proc (builtins only). A shell gone without a status was killed (a
    SIGKILL runs no EXIT trap), unless it wrote the file just before it ended: the file is read
    once more after the shell is seen gone, and only then is `G` told; the stdin FIFO's holder,
    left behind in its group, is ended with it. A process whose files are gone (its container
    was started again, which empties /dev/shm) was killed with the container: `G` too."""
    f = files(rec)
    status = f"read -r __e2b_rc <{f}.rc; printf 'E %s\\n' $__e2b_rc"
    alive = (
        "{ read -r __e2b_x __e2b_x __e2b_st __e2b_x </proc/$__e2b_pg/stat && "
        "[[ $__e2b_st != [ZX] ]]; } 2>/dev/null"
    )
    return (
        _remove(ended)
        + _punch(f"{f}.out", free_out)
        + _punch(f"{f}.err", free_err)
        + f"__e2b_pg=; read -r __e2b_pg <{f}.pgid 2>/dev/null; "
        f"if [ -s {f}.rc ]; then {status}; "
        f"elif [ -n \"$__e2b_pg\" ] && {alive}; then printf 'R\\n'; "
        f"elif [ -s {f}.rc ]; then {status}; "
        f"else printf 'G\\n'; [ -s {f}.hold ] && read -r __e2b_h <{f}.hold && "
        "kill $__e2b_h 2>/dev/null; fi; "
        + _tail(f"{f}.out", out_from, cap, "")
        + _tail(f"{f}.err", err_from, cap, " >&2")
        + "true"
    )


def _punch(path: str, upto: int) -> str:
    """Bash that frees the first `upto` bytes of `path` (a hole reads as zeros; the file keeps
    its size, so the offsets the face has seen stay true)."""
    if upto <= 0:
        return ""
    return f"fallocate -p -o 0 -l {upto} {path} 2>/dev/null; "


def kill_command(rec: str, out_from: int, err_from: int, cap: int, ended: Iterable[str]) -> str:
    """Bash that kills a detached process's whole group (its stdin holder with it), then
    reports `K` and at most `cap` bytes of each stream it wrote from the offsets seen."""
    f = files(rec)
    return (
        _remove(ended)
        + f"[ -s {f}.pgid ] && kill -KILL -- -$(<{f}.pgid) 2>/dev/null; printf 'K\\n'; "
        + _tail(f"{f}.out", out_from, cap, "")
        + _tail(f"{f}.err", err_from, cap, " >&2")
        + "true"
    )


def cleanup_command(ended: Iterable[str]) -> str:
    """Bash that removes the files of processes that have ended and been read."""
    return _remove(ended) + "true"


def stdin_command(rec: str, close: bool) -> str:
    """Bash that copies the command's own stdin into the process's FIFO (opened read-write, so
    it never blocks on a process that has ended), and ends the FIFO's holder on close."""
    f = files(rec)
    source = f"[ -p {f}.in ] && cat 1<>{f}.in || cat >/dev/null"
    if close:
        source += f"; [ -s {f}.hold ] && kill $(<{f}.hold) 2>/dev/null; true"
    return source
