"""Which Ray auth mode the command line joins a cluster with (``environment.use_ray_auth_token``):
the recorded token; token mode off for a service recorded without one, even with a token file of
Ray's own on this machine (sending it there waits until Ray times out); Ray's own token for a bare
address; and never over the user's own ``RAY_AUTH_MODE``."""

from __future__ import annotations

import os

import pytest

from settings import environment as env


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in (env.RAY_AUTH_MODE, env.RAY_AUTH_TOKEN, env.RAY_AUTH_TOKEN_PATH):
        monkeypatch.delenv(name, raising=False)


def test_a_recorded_token_is_sent_in_token_mode(monkeypatch):
    monkeypatch.setenv(env.RAY_AUTH_TOKEN_PATH, "/elsewhere/token")
    env.use_ray_auth_token("s3cret", ray_has_token=True, cluster_uses_tokens=True)
    assert os.environ[env.RAY_AUTH_MODE] == "token" and os.environ[env.RAY_AUTH_TOKEN] == "s3cret"
    assert env.RAY_AUTH_TOKEN_PATH not in os.environ


def test_a_service_recorded_without_a_token_is_joined_with_token_mode_off():
    env.use_ray_auth_token(None, ray_has_token=True, cluster_uses_tokens=False)
    assert os.environ[env.RAY_AUTH_MODE] == "disabled" and env.RAY_AUTH_TOKEN not in os.environ


def test_a_bare_address_takes_rays_own_token_when_there_is_one():
    env.use_ray_auth_token(None, ray_has_token=True)
    assert os.environ[env.RAY_AUTH_MODE] == "token"


def test_no_token_anywhere_sets_nothing():
    env.use_ray_auth_token(None, ray_has_token=False)
    assert env.RAY_AUTH_MODE not in os.environ


@pytest.mark.parametrize("uses_tokens", [None, False])
def test_the_users_own_mode_is_kept(monkeypatch, uses_tokens):
    monkeypatch.setenv(env.RAY_AUTH_MODE, "token")
    env.use_ray_auth_token(None, ray_has_token=True, cluster_uses_tokens=uses_tokens)
    assert os.environ[env.RAY_AUTH_MODE] == "token"
