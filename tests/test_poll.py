"""How often Ray Train's controller polls (launch/poll.py): the rule, and that Ray hands vitscale's value to
the controller it starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vitscale.launch import poll


@given(st.integers(1, 10_000), st.integers(1, 10_000))
def test_the_interval_grows_with_the_workers_within_its_bounds(a: int, b: int) -> None:
    small, large = sorted((a, b))
    assert poll.FASTEST_S <= poll.poll_interval_s(small) <= poll.poll_interval_s(large) <= poll.RAYS_S
    # Faster than Ray's own poll only as far as ASKS_PER_S asks a second allow (one per worker per poll).
    interval = poll.poll_interval_s(large)
    assert large / interval <= poll.ASKS_PER_S or interval in (poll.FASTEST_S, poll.RAYS_S)


def test_small_runs_poll_every_quarter_second_and_large_ones_as_ray_does() -> None:
    assert [poll.poll_interval_s(n) for n in (1, 2, 16, 32, 64, 128, 1024)] == [0.25, 0.25, 0.25, 0.5, 1.0, 2.0, 2.0]


def test_ray_hands_the_interval_to_the_controller_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    monkeypatch.delenv(poll.POLL_ENV, raising=False)
    monkeypatch.setattr(poll, "_USERS", None)
    poll.set_controller_poll(2)
    assert get_env_vars_to_propagate()[poll.POLL_ENV] == "0.25"  # what the controller actor's env gets
    poll.set_controller_poll(64)
    assert get_env_vars_to_propagate()[poll.POLL_ENV] == "1"

    monkeypatch.setenv(poll.POLL_ENV, "5")
    monkeypatch.setattr(poll, "_USERS", "5")
    poll.set_controller_poll(2)
    assert get_env_vars_to_propagate()[poll.POLL_ENV] == "5"
