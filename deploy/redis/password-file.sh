# Sourced by render-acl.sh and redis-ha.sh (from the same folder): read one password file,
# as common/credentials.py reads a secret file. The caller defines die().
#
#   password=$(read_password_file PATH)
#
# Surrounding whitespace is stripped; the rest must be one word of printable ASCII without
# spaces, not empty. Anything else calls die with a line naming the file, never its content.

read_password_file() {
    [ -r "$1" ] || die "cannot read the password file $1"
    content=$(cat "$1")
    old_ifs=$IFS
    IFS=$(printf ' \t\r\nx')
    IFS=${IFS%x}
    set -f
    # shellcheck disable=SC2086  # split on purpose: one word or the file is refused
    set -- "$1" $content
    set +f
    IFS=$old_ifs
    [ $# -ge 2 ] || die "password file $1 is empty"
    [ $# -eq 2 ] || die "password file $1: use printable ASCII without spaces"
    case "$2" in
        *[!!-~]*) die "password file $1: use printable ASCII without spaces" ;;
    esac
    printf %s "$2"
}
