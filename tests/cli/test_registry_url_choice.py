"""Which Redis ``pdserve serve`` uses: the flag (or PDSERVE_REDIS_URL), then ``--config``'s
``redis_url``, else an embedded one; a flag's URL (it may carry a password) reaches the replicas
through the environment, not the application's config."""

from __future__ import annotations

from cli.serve import registry_url
from deploy.config import PDServeConfig
from settings import environment


def test_the_config_files_redis_is_used_when_no_flag_names_one(monkeypatch):
    monkeypatch.delenv(environment.REDIS_URL, raising=False)
    config = PDServeConfig(model="m", redis_url="redis://registry:6379/0")
    assert registry_url(None, config) == ("redis://registry:6379/0", config)
    assert registry_url(None, PDServeConfig(model="m"))[0] is None  # then: an embedded server


def test_a_flag_wins_and_stays_out_of_the_config(monkeypatch):
    monkeypatch.delenv(environment.REDIS_URL, raising=False)
    config = PDServeConfig(model="m", redis_url="redis://registry:6379/0")
    url, used = registry_url("redis://:secret@other:6379/1", config)
    assert url == "redis://:secret@other:6379/1" and used.redis_url is None
    assert environment.require_redis_url(used.redis_url) == url  # what a replica resolves
