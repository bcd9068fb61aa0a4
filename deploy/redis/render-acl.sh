#!/bin/sh
# Render Redis ACL templates with the passwords' hashes at container start, then run
# the command after "--" (redis-server ... --aclfile OUTPUT). Busybox sh is enough (the
# redis:7-alpine image); compose.yaml and deploy/k8s/redis.yaml call it.
#
#   sh render-acl.sh PASSWORD_FILE_PATTERN OUTPUT TEMPLATE... [-- COMMAND [ARG...]]
#
# Each @ROLE_SHA256@ placeholder of the templates (deploy/redis/users.acl, rendered by
# common/redis_acl.py; deploy/redis/keda.acl) becomes the SHA-256 of the password in
# the file `printf PASSWORD_FILE_PATTERN role` names (role in lower case), e.g.
# /run/secrets/redis_%s_password or /run/secrets/redis-passwords/%s. A password is
# read by password-file.sh (beside this file) as common/credentials.py reads a secret
# file: surrounding whitespace stripped, printable ASCII without spaces, not empty;
# anything else stops the start with an error naming the file (never its content).
# Passwords never appear on a command line: only the files' paths do. OUTPUT is written
# with mode 0600.
set -eu
export LC_ALL=C

die() { echo "render-acl: $*" >&2; exit 1; }

[ $# -ge 3 ] || die "usage: render-acl.sh PASSWORD_FILE_PATTERN OUTPUT TEMPLATE... [-- COMMAND...]"
pattern=$1
out=$2
shift 2
templates=
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    [ -r "$1" ] || die "cannot read template $1"
    templates="$templates $1"
    shift
done
[ -n "$templates" ] || die "no template given"
[ $# -eq 0 ] || shift  # the "--"

# shellcheck source=deploy/redis/password-file.sh
. "$(dirname "$0")/password-file.sh"

# The SHA-256 (hex) of the password in file $1.
secret_hash() {
    password=$(read_password_file "$1") || exit 1
    printf %s "$password" | sha256sum | cut -d ' ' -f 1
}

umask 077
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# shellcheck disable=SC2086  # template paths have no spaces
cat $templates > "$tmp"
for upper in $(grep -o '@[A-Z][A-Z0-9_]*_SHA256@' "$tmp" | sed -e 's/^@//' -e 's/_SHA256@$//' | sort -u); do
    role=$(printf %s "$upper" | tr 'A-Z' 'a-z')
    # shellcheck disable=SC2059  # the pattern is the format on purpose
    digest=$(secret_hash "$(printf "$pattern" "$role")")
    sed -i "s/@${upper}_SHA256@/${digest}/g" "$tmp"
done
mv "$tmp" "$out"
echo "render-acl: $out rendered from$templates" >&2

[ $# -eq 0 ] || exec "$@"
