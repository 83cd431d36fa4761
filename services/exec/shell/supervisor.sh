# swerl in-container supervisor: the container's side of the shell protocol.
#
# The protocol (channels, framing, markers, and the state tables of both sides that the tests
# cite by row) is written down once, in docs/shell-protocol.md; change this file only together
# with it. Rows C1-C7 there are this file.
#
# The exec node starts `bash --login -s` with stdin/stdout/stderr on FIFOs of the sandbox's I/O
# directory (so the image's profile runs as for `bash -lc`), feeds it this file, then one framed
# line per command. The supervisor never runs a command in its own context: it keeps two
# *workers* forked ahead of time (job-control subshells, each its own process group), and the
# fork (~0.4 ms, the dominant cost) happens while the node handles a result, off the critical
# path. Per command the supervisor wakes once (its worker ended); the watchdog is told nothing.
#
# Variables set by the node before this file: __swerl_io (the I/O directory in the container),
# __swerl_ctl, __swerl_baton0 and __swerl_baton1 (FIFOs in it for the watchdog's sleep and the
# workers' turns to read), __swerl_life (a FIFO only the supervisor itself holds open: its end
# tells the node the supervisor is gone, whoever else still holds the output FIFOs) and
# __swerl_token.

set +o history +o errexit +o nounset +o pipefail 2>/dev/null
__swerl_dir=/tmp/.swerl
command mkdir -p "$__swerl_dir" 2>/dev/null
__swerl_session="$__swerl_dir/session.sh"
# The container's task count (its pids cgroup, v1 or v2), when it can be read: see __swerl_loop.
__swerl_pids_file=
for __swerl_f in /sys/fs/cgroup/pids/pids.current /sys/fs/cgroup/pids.current; do
  if [ -r "$__swerl_f" ]; then
    __swerl_pids_file=$__swerl_f
    break
  fi
done
unset __swerl_f

# C7. The watchdog is told nothing: each command's worker writes its record to $__swerl_io/pgid as
# it starts (the node reads the same record for signals), and the watchdog looks at it at
# least once a second, then sleeps until the deadline it found or for a second,
# whichever is sooner. So a command pays no wake-up of the watchdog; a timeout of a second or
# more fires on time, a shorter one within a second. Past its deadline, a command whose process
# group still exists overran: the watchdog leaves the pgid in the timeout file for the
# supervisor, then kills the whole group. It sleeps in a read on a FIFO nobody writes to, holds
# none of the supervisor's output FIFOs nor its life FIFO, and exits when the supervisor is gone.
# A command that stops or kills it only delays the next timeout: the supervisor continues it
# (or forks a new one) after every command, and the node's backstop covers the command at hand.
__swerl_watchdog() {
  local n pgid dl end now left handled= boss=$$
  exec 8<>"$__swerl_ctl" 5>&- 9>&- </dev/null >/dev/null 2>&1
  while kill -0 "$boss" 2>/dev/null; do
    left=1000000
    # The nonce at both ends tells a whole record from one caught half-written.
    if read -r n pgid dl end <"$__swerl_io/pgid" && [ "$end" = "$n" ] && [ "$n" != "$handled" ]; then
      now=${EPOCHREALTIME/./}
      if ((now >= dl)); then
        if kill -0 -- "-$pgid" 2>/dev/null; then
          printf '%d\n' "$pgid" >"$__swerl_io/timeout"
          kill -KILL -- "-$pgid" 2>/dev/null
        fi
        handled=$n
      elif ((dl - now < left)); then
        left=$((dl - now))
      fi
    fi
    if ((left >= 1000000)); then left=1; else printf -v left '0.%06d' "$left"; fi
    read -r -t "$left" -u 8 n
  done
}

# C5 (mode s). SESSION mode: persist variables, functions, aliases and cwd for the next SESSION command.
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

# C5. The worker's EXIT trap. A supervisor the command stopped (SIGSTOP) is continued first: it
# must reap this worker and report. A SESSION command's state is saved next. Then, if the command ended
# on its own (not through `exit`, errexit or a signal: those leave __swerl_rc unset), stdout
# is still the supervisor's FIFO and the supervisor is not being killed, the early end marker W
# goes out with the command's status. Its
# id ($1) is a one-time value the node made for this command alone, not the supervisor's token:
# a command that reads it from `trap -p` can only end its own run early. A command that sets its
# own EXIT trap replaces this one, and the supervisor's E is then its only end marker.
__swerl_exit() {
  kill -s CONT "$$" 2>/dev/null
  [ "$__swerl_mode" = s ] && __swerl_save_session
  [ -n "${__swerl_rc-}" ] && [ /proc/self/fd/1 -ef "/proc/$$/fd/1" ] && __swerl_boss_alive &&
    printf '\0SWERL:%s:W:%d\0' "$1" "$__swerl_rc"
}

# C5. Whether the supervisor lives on: false once it is exiting or gone, or a SIGKILL is pending
# for it. A command that killed it (`kill -9 $$`, `kill -9 -1`) returns before the kernel has
# ended it, so without this its W could still get out as 0, or not, by timing; with it such a
# command always ends as the supervisor's end says (137, N10). The kernel marks the SIGKILL
# pending in the target before kill(2) returns, and the target is marked exiting (PF_EXITING)
# from just after it takes the signal until it is a zombie: /proc/PID/stat's field 31 is the
# pending set (bit 8 is SIGKILL), field 9 the task flags (0x4 is PF_EXITING), field 3 the state.
__swerl_boss_alive() {
  # Read into names, not split into an array (which costs several times more); the supervisor's
  # comm, bash, has no space.
  local IFS=' ' __p __c __s __x __f __g
  builtin read -r __p __c __s __x __x __x __x __x __f __x __x __x __x __x __x __x __x __x \
    __x __x __x __x __x __x __x __x __x __x __x __x __g __x <"/proc/$$/stat" 2>/dev/null || return 1
  [[ $__s != [ZX] ]] && (( !(${__f:-4} & 4) && !((${__g:-0} >> 8) & 1) ))
}

# C4. A command is: NONCE TIMEOUT(%012.3f) MODE(i|s) NOTIFY(0|1) END_ID CWD STDIN_PATH ENV_SCRIPT
# COMMAND, each word ANSI-C quoted by the node. Runs in the worker, i.e. in the command's
# process group.
__swerl_command() {
  local __n=$1 __t=$2 __m=$3 __no=$4 __end=$5 __cwd=$6 __in=${7:-/dev/null} __envs=$8 __cmd=$9
  local __now=${EPOCHREALTIME/./}
  printf -v __now '%s %d %d %s' "$__n" "$BASHPID" \
    $((__now + 10#${__t%.*} * 1000000 + 10#${__t#*.} * 1000)) "$__n"
  printf '%-127s\n' "$__now" 1<>"$__swerl_io/pgid"
  exec <"$__in"
  [ "$__no" = 1 ] && printf '\0SWERL:%s:S:%d\0' "$__swerl_token" "$BASHPID"
  set +m
  trap - INT TERM QUIT HUP
  set --
  __swerl_mode=$__m
  trap "__swerl_exit $__end" EXIT
  if [ "$__m" = s ]; then
    [ -f "$__swerl_session" ] && builtin source "$__swerl_session" >/dev/null 2>&1
  fi
  # A cwd it cannot enter is the caller's error, told by D (not by bash's message).
  if [ -n "$__cwd" ] && ! builtin cd -- "$__cwd" 2>/dev/null; then
    printf '\0SWERL:%s:D\0' "$__swerl_token"
    exit 1
  fi
  eval "$__envs"
  unset __n __t __m __no __end __cwd __in __envs __swerl_token
  eval "$__cmd"
  __swerl_rc=$?
  exit "$__swerl_rc"
}

# C3. $1: the fd of this worker's baton, $2: the fd of the next worker's. The life FIFO (fd 9)
# and the supervisor's /dev/null (fd 5) are closed first: only the supervisor holds the former.
__swerl_worker() {
  local __len __line
  exec 5>&- 9>&-
  read -r -N 1 -u "$1" __len
  # End of input means the node is gone: take the supervisor down with us.
  IFS= read -r -N 8 __len && [ ${#__len} = 8 ] || { kill -KILL "$$"; exit 0; }
  IFS= read -r -N "$((10#$__len))" __line || { kill -KILL "$$"; exit 0; }
  printf x >&"$2"
  exec 6>&- 7>&-
  eval "__swerl_command $__line"
}

# C2, C6. Workers take commands in the order they were forked (see the batons above): the supervisor
# waits for exactly the oldest one (bash keeps the status of a child that already ended, so a
# fast command cannot be missed; under job control a worker that is stopped counts as ended,
# 128 + SIGSTOP), kills what is left of its process group, reports, and forks a replacement
# while the node is busy with the result. What a command may have stopped or killed of the
# machinery is put right after its E: the next worker and the watchdog get SIGCONT, and a dead
# watchdog is forked again (one kill(2) each, off the critical path).
__swerl_loop() {
  # Names start with __ so commands (forked from here) neither see nor save them as their own.
  local __rc __cur __next __even=1 __t __tasks __alone=0 __st
  # After most commands their process group is empty, and killing an empty group is not free
  # here: bash's error path writes to pages the workers share, a copy-on-write fault each (~0.15
  # ms a command). When the container held nothing but init, its main process, this shell and
  # the watchdog at start, then a count of those four plus the next worker (checked alive: under
  # a pids limit its fork can fail) means nothing of the command survived, and the kill is
  # skipped. Any other count, or no count, kills the group.
  if [ -n "$__swerl_pids_file" ] && read -r __tasks <"$__swerl_pids_file" && [ "$__tasks" = 4 ]
  then
    __alone=5
  fi
  __swerl_worker 6 7 &
  __cur=$!
  __swerl_worker 7 6 &
  __next=$!
  while :; do
    wait "$__cur" 2>/dev/null
    __rc=$?
    # A 147 can be stale. After a command stopped every process, this loop continued the next
    # worker (below), but bash learns that a child continued only once the child has run again,
    # and until then `wait` reports the old stop at once. Killing that worker would lose the next
    # command's line (the worker after it never gets its baton). So a worker counts as stopped
    # only while the kernel shows it stopped (T, t); otherwise wait again, a millisecond later.
    while [ "$__rc" = 147 ] && read -r __st 2>&5 <"/proc/$__cur/stat"; do
      __st=${__st##*) }
      case ${__st%% *} in T | t) break ;; esac
      read -r -t 0.001 __st 2>&5 <>"$__swerl_ctl"
      wait "$__cur" 2>/dev/null
      __rc=$?
    done
    if [ "$__alone" = 0 ] || ! [ -d "/proc/$__next" ] || ! read -r __tasks <"$__swerl_pids_file" ||
      [ "$__tasks" != "$__alone" ]; then
      kill -KILL -- "-$__cur" 2>/dev/null
    fi
    if [ -s "$__swerl_io/timeout" ]; then
      read -r __t <"$__swerl_io/timeout"
      : >"$__swerl_io/timeout"
      [ "$__t" = "$__cur" ] && printf '\0SWERL:%s:T\0' "$__swerl_token"
    fi
    printf '\0SWERL:%s:E:%d\0' "$__swerl_token" "$__rc"
    __cur=$__next
    kill -s CONT "$__cur" 2>&5
    if ! kill -s CONT "$__swerl_wd" 2>&5; then
      __swerl_watchdog &
      __swerl_wd=$!
    fi
    if [ "$__even" = 1 ]; then __swerl_worker 6 7 & else __swerl_worker 7 6 & fi
    __next=$!
    __even=$((1 - __even))
  done
}

# C1. Called by the node after it has exported the sandbox's environment; never returns.
__swerl_start() {
  printf '\0SWERL:ready:%d\0' "$$"
  __swerl_loop
}

set -m
# fd 9: the life FIFO (the node's reader sees its end when this process is gone); fd 5: where
# the loop's kill(1)s of processes a command may have killed send their complaint.
exec 9>"$__swerl_life" 5>/dev/null
__swerl_watchdog &
__swerl_wd=$!
exec 6<>"$__swerl_baton0" 7<>"$__swerl_baton1"
printf x >&6
