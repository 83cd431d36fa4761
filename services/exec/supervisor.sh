# swerl in-container supervisor. The exec node starts `bash --login -s` inside the sandbox
# (through one long-lived `docker exec`), so the image's profile and ~/.bashrc run as for
# `bash -lc`, then feeds it this file and one `__swerl_run ...` line per command.
#
# The supervisor never runs a command in its own context: each command runs in a job-control
# subshell (its own process group, ~1 ms) that starts from the supervisor's clean state. One
# watchdog job per supervisor enforces timeouts inside the container (no fork per command): the
# supervisor arms it with the command's process group and deadline and disarms it afterwards. Framing
# goes over the same stdout/stderr the command writes to, as NUL-delimited markers carrying a
# per-command nonce chosen by the node:
#   stderr  \0SWERL:<nonce>:S:<pgid>\0   command started (process group id)
#   stderr  \0SWERL:<nonce>:T\0          the in-container timeout fired, group was killed
#   stdout  \0SWERL:<nonce>:E:<rc>\0     command finished (after every survivor was killed)
#   stderr  \0SWERL:<nonce>:E:<rc>\0
# The node strips the markers; everything else is the command's own output, byte for byte.

set +o history +o errexit +o nounset +o pipefail 2>/dev/null
__swerl_dir=/tmp/.swerl
mkdir -p "$__swerl_dir" 2>/dev/null
__swerl_session="$__swerl_dir/session.sh"
__swerl_ctl="$__swerl_dir/watchdog.$$"
rm -f "$__swerl_ctl"
mkfifo "$__swerl_ctl" || { printf '\0SWERL:fatal:mkfifo\0' >&2; exit 97; }

# The watchdog reads "arm NONCE PGID SECONDS" / "disarm" lines. While armed, a read that times
# out means the command overran: it leaves a flag file for the supervisor, then kills the whole
# process group. It holds none of the supervisor's output pipes (so a dead supervisor's stream
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
      : >"$__swerl_dir/timeout.$n"
      kill -KILL -- "-$pgid" 2>/dev/null
      read -r verb <&8
    fi
  done
}

# SESSION mode: persist variables, functions, aliases and cwd for the next SESSION command.
# Shell-internal and read-only variables are skipped: restoring them would fail or misbehave.
__swerl_save_session() {
  local __v
  {
    for __v in $(compgen -v); do
      case $__v in
        BASH | BASH[_A-Z]* | EUID | PPID | UID | SHELLOPTS | FUNCNAME | GROUPS | HISTCMD | LINENO | \
          RANDOM | SECONDS | SRANDOM | EPOCHREALTIME | EPOCHSECONDS | PIPESTATUS | DIRSTACK | \
          COMP_* | _ | __*) continue ;;
      esac
      declare -p "$__v" 2>/dev/null
    done
    declare -f
    alias -p
    printf 'builtin cd -- %q\n' "$PWD"
  } >"$__swerl_session.tmp" 2>/dev/null
  command mv -f "$__swerl_session.tmp" "$__swerl_session"
}

# __swerl_run NONCE TIMEOUT_S MODE(i|s) CWD STDIN_PATH ENV_SCRIPT COMMAND
__swerl_run() {
  local __n=$1 __t=$2 __m=$3 __cwd=$4 __in=${5:-/dev/null} __envs=$6 __cmd=$7 __pid __rc
  # An open stdin is a FIFO the node feeds through a second, short-lived docker exec.
  [ -n "$5" ] && { rm -f "$5"; mkfifo -m 600 "$5"; }
  (
    set +m
    trap - INT TERM QUIT HUP
    set --
    exec 8>&- 9>&-
    if [ "$__m" = s ]; then
      [ -f "$__swerl_session" ] && builtin source "$__swerl_session" >/dev/null 2>&1
      trap __swerl_save_session EXIT
    fi
    if [ -n "$__cwd" ]; then builtin cd -- "$__cwd" || exit 1; fi
    eval "$__envs"
    unset __n __t __m __cwd __in __envs __pid __rc
    eval "$__cmd"
  ) <"$__in" &
  __pid=$!
  printf 'arm %s %d %s\n' "$__n" "$__pid" "$__t" >&9
  printf '\0SWERL:%s:S:%d\0' "$__n" "$__pid" >&2
  wait "$__pid" 2>/dev/null
  __rc=$?
  printf 'disarm\n' >&9
  kill -KILL -- "-$__pid" 2>/dev/null
  if [ -e "$__swerl_dir/timeout.$__n" ]; then
    rm -f "$__swerl_dir/timeout.$__n"
    printf '\0SWERL:%s:T\0' "$__n" >&2
  fi
  [ -n "$5" ] && rm -f "$5"
  printf '\0SWERL:%s:E:%d\0' "$__n" "$__rc"
  printf '\0SWERL:%s:E:%d\0' "$__n" "$__rc" >&2
}

# Called by the node after it has exported the sandbox's environment.
__swerl_ready() {
  printf '\0SWERL:ready:%d\0' "$$"
  printf '\0SWERL:ready:%d\0' "$$" >&2
}

set -m
__swerl_watchdog &
exec 9>"$__swerl_ctl"
