#!/bin/sh
# The Sentinel variant (compose profile "sentinel", deploy/k8s-sentinel): write a Redis
# config file holding a password, then run the command after "--" with that file as its
# first argument. Busybox sh is enough; compose.yaml, deploy/compose.sentinel.yaml and
# deploy/k8s-sentinel call it (usually after render-acl.sh, which writes the ACL file).
#
#   sh redis-ha.sh server   PASSWORD_FILE_PATTERN CONF MASTER_HOST|-         -- redis-server [ARG...]
#   sh redis-ha.sh sentinel PASSWORD_FILE_PATTERN CONF MASTER_HOST NAME QUORUM -- redis-server [ARG...]
#
# server: a master or replica of the set. CONF says `masteruser replication` and
# `masterauth` (the password of the ACL user replication, deploy/redis/sentinel.acl), which
# a master needs too: after a failover the sentinels turn it into a replica of the new
# master. MASTER_HOST (not "-") adds `replicaof MASTER_HOST 6379`: a replica.
# MASTER_HOST may be HOST:PORT for a master on another port than 6379 (the tests).
# sentinel: a sentinel on 26379 monitoring NAME (the service name of the
# redis+sentinel:// URL) at MASTER_HOST:6379 with QUORUM, logging in as the ACL user
# sentinel; hostnames resolved and announced (Redis >= 6.2), so container and Service
# names work. Sentinel rewrites CONF as it learns, so CONF must be writable (e.g. /tmp).
#
# The password file is `printf PASSWORD_FILE_PATTERN replication` (or `sentinel`), read
# by password-file.sh beside this file, as render-acl.sh reads one (surrounding whitespace stripped, printable ASCII without
# spaces, not empty; an error names the file, never its content). It lands only in CONF
# (mode 0600), quoted, never on a command line.
set -eu
export LC_ALL=C

die() { echo "redis-ha: $*" >&2; exit 1; }

[ $# -ge 4 ] || die "usage: redis-ha.sh server|sentinel PASSWORD_FILE_PATTERN CONF MASTER_HOST [NAME QUORUM] -- COMMAND..."
mode=$1
pattern=$2
conf=$3
master=$4
shift 4
case "$mode" in
    server) user=replication ;;
    sentinel)
        [ $# -ge 2 ] || die "sentinel needs NAME and QUORUM"
        name=$1
        quorum=$2
        shift 2
        user=sentinel ;;
    *) die "unknown mode $mode (server or sentinel)" ;;
esac
[ $# -ge 2 ] && [ "$1" = "--" ] || die "no command after --"
shift

# shellcheck source=deploy/redis/password-file.sh
. "$(dirname "$0")/password-file.sh"

# shellcheck disable=SC2059  # the pattern is the format on purpose
password=$(read_password_file "$(printf "$pattern" "$user")")
# A double-quoted config string: \ and " escaped.
quoted=$(printf %s "$password" | sed -e 's/[\\"]/\\&/g')

case "$master" in
    *:*) master_port=${master##*:}; master=${master%:*} ;;
    *) master_port=6379 ;;
esac

umask 077
tmp="$conf.tmp.$$"
trap 'rm -f "$tmp"' EXIT
if [ "$mode" = server ]; then
    {
        printf '%s\n' "masteruser replication"
        printf '%s\n' "masterauth \"$quoted\""
        [ "$master" = "-" ] || printf '%s\n' "replicaof $master $master_port"
    } > "$tmp"
else
    {
        printf '%s\n' "port 26379"
        printf '%s\n' "protected-mode no"
        printf '%s\n' "sentinel resolve-hostnames yes"
        printf '%s\n' "sentinel announce-hostnames yes"
        printf '%s\n' "sentinel monitor $name $master $master_port $quorum"
        printf '%s\n' "sentinel auth-user $name sentinel"
        printf '%s\n' "sentinel auth-pass $name \"$quoted\""
        printf '%s\n' "sentinel down-after-milliseconds $name 5000"
        printf '%s\n' "sentinel failover-timeout $name 60000"
        printf '%s\n' "sentinel parallel-syncs $name 1"
    } > "$tmp"
fi
mv "$tmp" "$conf"
trap - EXIT
printf '%s\n' "redis-ha: $conf written ($mode)" >&2

command=$1
shift
exec "$command" "$conf" "$@"
