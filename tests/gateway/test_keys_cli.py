"""``inflight keys set`` / ``keys show`` against a real Redis."""

import redis

from gateway import keys
from inflight.cli import main


def test_keys_set_and_show(redis_url, capsys):
    client = redis.Redis.from_url(redis_url)
    key_id, _ = keys.create_key(client, "t", "cli")
    assert main(["keys", "set", key_id, "--rpm", "30", "--tpm", "5000", "--max-inflight", "2",
                 "--redis-url", redis_url]) == 0
    record = keys.get_key(client, key_id)
    assert (record.requests_per_min, record.tokens_per_min, record.max_inflight) == (30, 5000, 2)
    capsys.readouterr()
    assert main(["keys", "show", key_id, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "requests_per_min   30" in out and "tokens_per_min     5000" in out
    assert "0 requests, 0 tokens in the last 60 s; 0 in flight" in out


def test_keys_show_unknown_and_missing_id(redis_url, capsys):
    assert main(["keys", "show", "key_nope", "--redis-url", redis_url]) == 1
    assert main(["keys", "set", "--rpm", "3", "--redis-url", redis_url]) == 2
    assert keys.set_limits(redis.Redis.from_url(redis_url), "key_nope", requests_per_min=1) is None


def test_keys_priority_out_of_range_is_a_usage_error(redis_url, capsys):
    client = redis.Redis.from_url(redis_url)
    key_id, _ = keys.create_key(client, "t", "cli")
    for argv in (["keys", "create", "--tenant", "t", "--priority", "7"],
                 ["keys", "set", key_id, "--priority", "-1"]):
        try:
            code = main(argv + ["--redis-url", redis_url])
        except SystemExit as exc:  # argparse's usage error
            code = exc.code
        assert code == 2
        assert "--priority" in capsys.readouterr().err
    assert [r.key_id for r in keys.list_keys(client)] == [key_id]
    assert keys.get_key(client, key_id).priority == 1


def test_keys_set_model_with_key_only_limit_is_a_usage_error(redis_url, capsys):
    client = redis.Redis.from_url(redis_url)
    key_id, _ = keys.create_key(client, "t", "cli")
    for flags in (["--max-tokens-cap", "5"], ["--priority", "1"], ["--max-prompt-tokens", "9"]):
        assert main(["keys", "set", key_id, "--model", "smol-b", *flags, "--redis-url", redis_url]) == 2
        err = capsys.readouterr().err
        assert flags[0] in err and "cannot be set per model" in err and "Traceback" not in err
    assert keys.get_key(client, key_id).model_limits == ()
    assert main(["keys", "set", key_id, "--model", "smol-b", "--rpm", "3", "--redis-url", redis_url]) == 0
