"""RedisBackoff: the pause of the worker loop's Redis polling after failures."""

import time

from worker.serve.redis_backoff import RedisBackoff


def test_pause_doubles_up_to_the_cap_and_a_success_resets_it():
    backoff = RedisBackoff(first_s=0.5, max_s=3.0)
    assert backoff.allows()
    assert [backoff.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not backoff.allows()
    backoff.succeeded()
    assert backoff.allows()
    assert backoff.failed() == 0.5


def test_polling_is_allowed_again_once_the_pause_is_over():
    backoff = RedisBackoff(first_s=0.05)
    backoff.failed()
    assert not backoff.allows()
    time.sleep(0.06)
    assert backoff.allows()
