#!/bin/sh
# as_user.sh HOME_DIR UID GID COMMAND...: COMMAND as the non-root user UID:GID (no supplementary groups), started by
# root inside `unshare --mount --propagation private` (a mount namespace of its own: nothing here is seen outside).
#
# Why: the only Python with torch on these machines lives under /root, mode 0700, which no other user may enter,
# so a plain `runuser -u USER -- python ...` cannot even load the interpreter. In this namespace /root is HOME_DIR
# (mode 0711, made by the caller) with the real /root/.pyenv mounted inside it: the same interpreter, torch and
# py-spy, at the same paths, and nothing else of root's. The command then runs as that user (setpriv sets the
# real, effective and saved uid and gid): every check the kernel makes on /proc and ptrace is that user's.
set -e
home=$1; uid=$2; gid=$3; shift 3
mkdir -p "$home/.pyenv"
mount --bind /root/.pyenv "$home/.pyenv"
mount --rbind "$home" /root
exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
