# swerl in-container supervisor.
#
# The exec node bind-mounts a per-sandbox I/O directory (FIFOs it created) at /.swerl-io and
# starts `bash --login -s` with stdin/stdout/stderr on those FIFOs, so the image's profile and
# ~/.bashrc run as for `bash -lc`. It then feeds this file, and after it one line per command.
# Commands and output go through the FIFOs directly, not through dockerd, which is what makes a
# round trip about a millisecond.
#
# The supervisor never runs a command in its own context. It keeps a *worker* forked ahead of
# time: a job-control subshell (its own process group) holding the supervisor's clean state,
# blocked reading the next command line from the shared stdin. So the fork (the dominant cost,
# ~0.5 ms) happens while the previous command runs instead of on the critical path. The worker
# arms the watchdog, runs the command, and exits; the supervisor then kills whatever is left of
# the worker's process group, reports, and forks another worker. One watchdog job per supervisor
# enforces timeouts inside the container without a fork per command.
#
# Framing: NUL-delimited markers on stdout carrying a per-supervisor token chosen by the node
# (commands never see it; they run strictly one after another):
#   \0SWERL:<token>:S:<pgid>\0   the command started (only when the node asked for it)
#   \0SWERL:<token>:T\0          the in-container timeout fired and killed the process group
#   \0SWERL:<token>:E:<rc>\0     the command finished and every survivor of its group is dead
# stderr carries no markers: when E arrives, everything the command wrote to stderr is already
# in the stderr FIFO, so the node drains it. "<nonce> <pgid>" of the running command is written
# to $__swerl_io/pgid for signals. Everything else is the command's own output, byte for byte.
#
# Variables set by the node before this file: __swerl_io (the I/O directory in the container),
# __swerl_ctl, __swerl_baton and __swerl_who (FIFOs in it for the watchdog, the workers' turn to
# read, and the pid of the worker that took a command) and __swerl_token.

set +o history +o errexit +o nounset +o pipefail 2>/dev/null
__swerl_dir=/tmp/.swerl
command mkdir -p "$__swerl_dir" 2>/dev/null
__swerl_session="$__swerl_dir/session.sh"

# The watchdog reads "arm NONCE PGID SECONDS" / "disarm" lines. While armed, a read that times
# out means the command overran: it leaves a flag file for the supervisor, then kills the whole
# process group. It holds none of the supervisor's output FIFOs (so a dead supervisor's output
# ends at once), and exits when the supervisor is gone.
__swerl_watchdog() {
  local verb n pgid t boss=$$
  exec 8<>"$__swerl_ctl" </dev/null >/dev/null 2>&1
  while :; do
    if ! read -r -t 5 verb n pgid t <&8; then
      kill -0 "$boss" 2>/dev/null || exit 0
      continue
    fi
    [ "$verb" = arm ] || continue
    if ! read -r -t "$t" verb <&8; then
      : >"$__swerl_io/timeout"
      kill -KILL -- "-$pgid" 2>/dev/null
      read -r verb <&8
    fi
  done
}

# SESSION mode: persist variables, functions, aliases and cwd for the next SESSION command.
# Shell-internal and read-only variables are skipped: restoring them would fail or misbehave.
# The restore runs inside a function, so every `declare` is rewritten to `declare -g`: without
# it the restored variables would be local to that function and gone before the next save.
__swerl_save_session() {
  {
    local __v
    for __v in $(compgen -v); do
      case $__v in
        BASH | BASH[_A-Z]* | EUID | PPID | UID | SHELLOPTS | FUNCNAME | GROUPS | HISTCMD | LINENO | \
          RANDOM | SECONDS | SRANDOM | EPOCHREALTIME | EPOCHSECONDS | PIPESTATUS | DIRSTACK | \
          COMP_* | _ | __*) continue ;;
      esac
      declare -p "$__v" 2>/dev/null
    done | command sed -E 's/^declare -- /declare -g /; s/^declare -([A-Za-z]+) /declare -g\1 /'
    declare -f
    alias -p
    printf 'builtin cd -- %q\n' "$PWD"
  } >"$__swerl_session.tmp" 2>/dev/null
  command mv -f "$__swerl_session.tmp" "$__swerl_session"
}

# A command line is: NONCE TIMEOUT_S MODE(i|s) NOTIFY(0|1) CWD STDIN_PATH ENV_SCRIPT COMMAND,
# each word ANSI-C quoted by the node. Runs in the worker, i.e. in the command's process group.
__swerl_command() {
  local __n=$1 __t=$2 __m=$3 __no=$4 __cwd=$5 __in=${6:-/dev/null} __envs=$7 __cmd=$8
  printf 'arm %s %d %s\n' "$__n" "$BASHPID" "$__t" >&9
  printf '%s %d\n' "$__n" "$BASHPID" >"$__swerl_io/pgid"
  exec 9>&- <"$__in"
  [ "$__no" = 1 ] && printf '\0SWERL:%s:S:%d\0' "$__swerl_token" "$BASHPID"
  set +m
  trap - INT TERM QUIT HUP
  set --
  if [ "$__m" = s ]; then
    [ -f "$__swerl_session" ] && builtin source "$__swerl_session" >/dev/null 2>&1
    trap __swerl_save_session EXIT
  fi
  if [ -n "$__cwd" ]; then builtin cd -- "$__cwd" || exit 1; fi
  eval "$__envs"
  unset __n __t __m __no __cwd __in __envs __swerl_token
  eval "$__cmd"
}

__swerl_worker() {
  local __line __baton
  # Only the worker holding the baton reads stdin, so two idle workers never split a line.
  read -r -u 7 __baton
  # End of input means the node is gone: take the supervisor down with us.
  IFS= read -r __line || { kill -KILL "$$"; exit 0; }
  printf 'x\n' >&7
  # Tell the supervisor which worker (and so which process group) runs this command.
  printf '%d\n' "$BASHPID" >&6
  exec 6>&- 7>&-
  eval "__swerl_command $__line"
}

# Two workers are alive between commands: both forked ahead, one of them holding the baton. The
# worker that takes a command line reports its pid, the supervisor waits for exactly that pid
# (bash keeps the status of a child that already ended, so a fast command cannot be missed),
# kills what is left of its process group, reports, and forks a replacement while the node is
# busy with the result.
__swerl_loop() {
  # Names start with __ so commands (forked from here) neither see nor save them as their own.
  local __rc __cur
  __swerl_worker &
  __swerl_worker &
  while :; do
    read -r __cur <&6
    wait "$__cur" 2>/dev/null
    __rc=$?
    printf 'disarm\n' >&9
    kill -KILL -- "-$__cur" 2>/dev/null
    if [ -e "$__swerl_io/timeout" ]; then
      rm -f "$__swerl_io/timeout"
      printf '\0SWERL:%s:T\0' "$__swerl_token"
    fi
    printf '\0SWERL:%s:E:%d\0' "$__swerl_token" "$__rc"
    __swerl_worker &
  done
}

# Called by the node after it has exported the sandbox's environment; never returns.
__swerl_start() {
  printf '\0SWERL:ready:%d\0' "$$"
  __swerl_loop
}

set -m
__swerl_watchdog &
exec 9>"$__swerl_ctl" 7<>"$__swerl_baton" 6<>"$__swerl_who"
printf 'x\n' >&7
